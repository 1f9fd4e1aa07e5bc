"""The turns two S-workers of the schedule trace take on one core (aiollm.calibrate.turns): who runs when, and each run's own
clock."""

import asyncio

import pytest

from aiollm.calibrate.turns import Turns, active_clock


async def _run(turns: Turns, names: list[str], iterations: int) -> list[str]:
    """Workers that loop until stopped, as an S-worker does, yielding to the event loop inside each iteration (a
    step awaits its R-workers): who ran, in order, over the first `iterations` iterations of all of them."""
    ran: list[str] = []
    enough = asyncio.Event()

    async def worker(name: str) -> None:
        while True:
            await turns.wait(name)
            ran.append(name)
            if len(ran) == iterations:
                enough.set()
            await asyncio.sleep(0)

    tasks = [asyncio.create_task(worker(n)) for n in names]
    await asyncio.wait_for(enough.wait(), timeout=5.0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return ran[:iterations]


async def test_the_lead_runs_alone_then_the_cycle_repeats_in_its_order():
    turns = Turns([("without", 2), ("with", 1)], lead=("with", 3))
    ran = await _run(turns, ["with", "without"], 12)
    assert ran == ["with"] * 3 + ["without", "without", "with"] * 3


async def test_starts_mark_each_stretch_of_a_workers_turns():
    turns = Turns([("a", 1), ("b", 2)], lead=("a", 2))
    ran = await _run(turns, ["b", "a"], 9)
    assert ran == ["a"] * 3 + ["b", "b", "a"] * 2
    # a: the lead and its first cycle turn are one stretch of its clock; then a stretch after each of b's turns
    a, b = turns.starts["a"], turns.starts["b"]
    assert a[0] < b[0] < a[1] < b[1] < a[2]


async def test_a_worker_that_leaves_gives_up_its_turns_even_while_it_holds_one():
    turns = Turns([("a", 2), ("b", 1)])
    await turns.wait("a")  # a holds the turn with an iteration left, then goes idle without coming back
    await turns.leave("a")
    assert turns.current == "b"
    ran = await _run(turns, ["b"], 3)
    assert ran == ["b"] * 3  # b alone, turn after turn
    await turns.leave("b")
    assert turns.current is None


async def test_unknown_worker_and_empty_turns_are_refused():
    turns = Turns([("a", 1)])
    with pytest.raises(ValueError, match="'z' has no turn"):
        await turns.wait("z")
    with pytest.raises(ValueError, match="at least 1 iteration"):
        Turns([("a", 0)])
    with pytest.raises(ValueError, match="at least 1 iteration"):
        Turns([])


def test_active_clock_cuts_out_the_other_workers_turns():
    # turns start at 0 and 10; steps end at 1, 3 (turn 1), 12, 13 (turn 2): 10-3 s belonged to another worker
    assert active_clock([1.0, 3.0, 12.0, 13.0], [0.0, 10.0]) == [1.0, 3.0, 5.0, 6.0]


def test_active_clock_on_one_turn_is_the_wall_clock_from_its_start():
    assert active_clock([2.0, 2.5, 4.0], [1.0]) == [1.0, 1.5, 3.0]
    with pytest.raises(ValueError, match="starts"):
        active_clock([1.0], [])


async def test_parked_returns_once_a_worker_that_left_is_between_iterations():
    turns = Turns([("a", 1), ("b", 1)])
    in_iteration = asyncio.Event()
    finish = asyncio.Event()

    async def a() -> None:  # one iteration that lasts until told to finish (an admission streaming, say)
        while True:
            await turns.wait("a")
            in_iteration.set()
            await finish.wait()

    task = asyncio.create_task(a())
    await in_iteration.wait()
    await turns.leave("a")
    await turns.leave("b")
    with pytest.raises(ValueError, match="has not left"):
        await Turns([("c", 1)]).parked("c")
    parked = asyncio.create_task(turns.parked("a"))
    await asyncio.sleep(0.01)
    assert not parked.done()  # a is still inside its iteration
    finish.set()
    await asyncio.wait_for(parked, timeout=1.0)  # back at its turn, which never comes again
    b_parked = asyncio.create_task(turns.parked("b"))
    waiting_b = asyncio.create_task(turns.wait("b"))  # b waits at the top of its loop
    await asyncio.wait_for(b_parked, timeout=1.0)
    assert not waiting_b.done()
    for t in (task, waiting_b):
        t.cancel()
    await asyncio.gather(task, waiting_b, return_exceptions=True)
