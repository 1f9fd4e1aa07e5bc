"""Prefill and decode instances taking turns on a host's cores (aiollm.serving.turns): a prefill batch waits for
the decode step in progress only, and no decode step starts while it waits or runs."""

import fcntl
import subprocess
import sys
import threading
import time

from aiollm.serving.turns import Turns, taking


def _in_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    return t


def test_prefill_goes_after_the_step_in_progress_and_before_later_steps(tmp_path):
    path = str(tmp_path / "turns")
    # one Turns per instance: separate open files, as separate processes hold
    decode, prefill = Turns(path), Turns(path)
    order, in_step, end_step = [], threading.Event(), threading.Event()

    def step_in_progress():
        with decode.decode():
            in_step.set()
            end_step.wait(5)
            order.append("step 1")

    def prefill_batch():
        with prefill.prefill():
            order.append("prefill")
            time.sleep(0.05)  # a later step arriving now must still wait

    def later_step():
        with Turns(path).decode():
            order.append("step 2")

    first = _in_thread(step_in_progress)
    assert in_step.wait(5)
    batch = _in_thread(prefill_batch)
    time.sleep(0.05)  # the prefill waits at the cores, holding the gate
    second = _in_thread(later_step)
    time.sleep(0.05)
    assert order == []  # neither the prefill nor the later step runs during step 1
    end_step.set()
    for t in (first, batch, second):
        t.join(5)
    assert order == ["step 1", "prefill", "step 2"]


def test_a_dead_process_gives_its_turn_back(tmp_path):
    path = str(tmp_path / "turns")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom aiollm.serving.turns import Turns\n"
            f"t = Turns({path!r})\nwith t.prefill():\n    print('held', flush=True)\n    time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        done = threading.Event()
        waiter = _in_thread(lambda: (Turns(path).decode().__enter__(), done.set()))
        assert not done.wait(0.2)  # held by the live process
        holder.kill()
        holder.wait()
        assert done.wait(5)  # its locks went with it
        waiter.join(5)
    finally:
        holder.kill()
        holder.wait()


def test_taking_runs_the_function_inside_the_turn(tmp_path):
    turns = Turns(str(tmp_path / "turns"))
    assert taking(None, max)(1, 2) == 2
    seen = []

    def probe(x):
        # the cores lock is held: another instance cannot take a turn now
        other = Turns(turns.path)

        try:
            fcntl.flock(other._cores, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append("free")
        except BlockingIOError:
            seen.append("held")
        return x * 2

    assert taking(turns.decode, probe)(21) == 42
    assert taking(turns.prefill, probe)(1) == 2
    assert seen == ["held", "held"]
