"""The schedule trace's two runs: S-workers with and without the load-stabilising schedule, each on an R-worker of
its own, taking turns on the same cores (aiollm.calibrate.turns) so that both sample the same minutes of the host."""

from __future__ import annotations

import asyncio
import math
import time

from aiollm.actors.actor import Actor, handler
from aiollm.calibrate.turns import TakingTurns, Turns, active_clock
from aiollm.deploy.graph import Graph
from aiollm.sched.sls import SLSConfig
from aiollm.serving.distserve.messages import Generate, Sampling, Tokens
from aiollm.serving.fastdecode.messages import GetRLoad, GetTrace, Synthetic
from aiollm.serving.fastdecode.s_worker import SWorker, SWorkerConfig
from bench.fastdecode_steps import PROMPT_LEN, random_prompts, wait_steps

# seconds a turn of the interleaved schedule trace lasts (aiollm.calibrate.turns): short beside the host's drift, which moves
# the step by a quarter over minutes, and long beside a handover (one event-loop wake-up)
TURN_S = 6.0


class Sink(Actor):
    """Receives the trace run's tokens (the S-worker tells them to a client) and counts finished requests."""

    def __init__(self) -> None:
        self.finished = 0

    @handler(Tokens)
    async def on_tokens(self, msg: Tokens) -> None:
        self.finished += sum(d.finish is not None or d.error is not None for d in msg.deltas)


def trace_schedule(batch: int, seq_len: int, micro_batch: int) -> SLSConfig:
    """The schedule for requests of PROMPT_LEN + (S - PROMPT_LEN) tokens: a sequence decodes for S' = S - PROMPT_LEN
    steps, so F = M*S'/B keeps B sequences active. W_lim is the paper's B*(S'+F)/2 plus the prompts every sequence
    holds from its first step, plus one micro-batch at its longest (M*S): at an admission slot Algorithm 1 still
    counts the oldest micro-batch for its last steps beside the new one, so with the paper's bound alone it
    delays micro-batches and the batch runs ~10 % short of B (115.8 of 128 in a trace at S=544)."""
    life = seq_len - PROMPT_LEN
    interval = max(1, micro_batch * life // batch)
    config = SLSConfig(batch, life, interval)
    return SLSConfig(
        batch,
        life,
        interval,
        workload_limit=batch * (PROMPT_LEN + (life + interval + 1) // 2) + config.micro_batch_size * seq_len,
    )


async def touch_kv(graph: Graph, model, url: str, batch: int, seq_len: int) -> float:
    """Have the R-worker at `url` write zeros over what `batch` sequences of `seq_len` entries reserve, then release
    them; the seconds it took. On a VM a page a process touches for the first time can be slow (1 GiB page by page
    11 s, the same again 0.21 s), so without this the run whose R-worker grows into fresh memory pays seconds
    the other does not: on a fresh R-worker each admission of 8 prompts then takes ~1 s instead of 0.1."""
    started = time.perf_counter()
    s = await graph.driver.spawn(SWorker(model, [url], SWorkerConfig(max_batch=batch)), "s-touch")
    await s.ask(Synthetic([PROMPT_LEN] * batch, seq_len - PROMPT_LEN - 1), timeout=600.0)
    await graph.driver.stop_actor("s-touch")  # releases them on the R-worker (a tell)
    while (await graph.ref(url).ask(GetRLoad())).sequences:
        await asyncio.sleep(0.05)
    return time.perf_counter() - started


async def interleaved_traces(
    graph: Graph,
    model,
    urls: dict[str, str],
    batch: int,
    seq_len: int,
    schedule: SLSConfig,
    pipeline_min: int,
    ramp: int,
    steps: dict[str, int],
    order: tuple[str, str],
    rounds: int,
    tag: str,
) -> dict[str, dict]:
    """Real requests (prompts of PROMPT_LEN, completions to `seq_len`) through two S-workers, "with" the schedule
    and "without", each on its own R-worker (`urls[name]`), taking turns on this core (aiollm.calibrate.turns): "with" ramps up
    alone for `ramp` iterations, then they alternate in `order`, `rounds` turns each, until each has run
    `steps[name]` steps. Their traces, each step's end on its worker's own clock."""
    cycle = [(name, math.ceil((steps[name] - (ramp if name == "with" else 0)) / rounds)) for name in order]
    turns = Turns(cycle, lead=("with", ramp))
    workers = {}
    for name in ("with", "without"):
        config = SWorkerConfig(
            max_batch=batch, pipeline_min_batch=pipeline_min, schedule=schedule if name == "with" else None
        )
        actor = f"s-trace-{name}-{tag}"
        workers[name] = (
            actor,
            await graph.driver.spawn(TakingTurns(model, [urls[name]], config, turns=turns, turn_name=name), actor),
        )
    sink_name = f"sink-trace-{tag}"
    sink_ref = await graph.driver.spawn(Sink(), sink_name)
    sampling = Sampling(
        max_tokens=seq_len - PROMPT_LEN, temperature=0.0, top_k=0, top_p=1.0, seed=None, ignore_eos=True
    )
    prompts = random_prompts(model, 4 * batch, PROMPT_LEN)  # the same prompts for both runs
    for name, (_, ref) in workers.items():
        for i, prompt in enumerate(prompts):
            await ref.tell(Generate(f"trace-{name}-{tag}-{i}", prompt, sampling, sink_ref))
    await asyncio.gather(*(wait_steps(ref, steps[name]) for name, (_, ref) in workers.items()))
    out = {}
    for name, (_actor, ref) in workers.items():
        trace = await ref.ask(GetTrace())
        n = steps[name]
        out[name] = {
            "step_s": trace.step_s[:n],
            "batch": trace.batch[:n],
            "tokens": trace.tokens[:n],
            "ended": active_clock(trace.ended[:n], turns.starts[name]),
            "started": trace.started[:n],
            "turns": len(turns.starts[name]),
        }
    # both done: each finishes the iteration it is in (an admission may be streaming a prompt's KV to its R-worker)
    # and stops at its next turn; only then is it stopped (an idle one waits inside an iteration: not after 60 s)
    for name in workers:
        await turns.leave(name)
    for name in workers:
        try:
            await asyncio.wait_for(turns.parked(name), timeout=60.0)
        except TimeoutError:
            print(
                f"   the trace's S-worker {name!r} did not come back to its turn within 60 s; stopping it anyway",
                flush=True,
            )
    for actor, _ in workers.values():
        await graph.driver.stop_actor(actor)
    await graph.driver.stop_actor(sink_name)
    return out
