"""The measuring tools every part of `bench fastdecode` shares: T(B) of the S-part in this process, the attention
kernel alone, R-worker processes, and the median decode step of synthetic sequences through them, with T(B) read
right before and after it."""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import torch

from aiollm.calibrate.fastdecode_probes import probe_step
from aiollm.deploy.graph import Graph
from aiollm.kv.pool import KVConfig, KVPool
from aiollm.serving.distserve.messages import GetLoad
from aiollm.serving.fastdecode.messages import GetTrace
from bench.model import s_part_step

# tokens in each trace request's prompt, and the shortest context of the synthetic rows (spread over [it, S))
PROMPT_LEN = 16
# the bundled model every part of this benchmark runs
MODEL = "smollm2"


def t_fastest(model, sizes: list[int], repeats: int = 5) -> dict[int, float]:
    """T(B): the S-part step (bench.model.s_part_step) per batch size, the fastest of `repeats` after a warm-up
    (the least disturbed by the other processes on these cores; the mean let one spike double a point)."""
    curve = {}
    with torch.inference_mode():
        for b in sizes:
            ids = torch.randint(0, model.config.vocab, (b,))
            rope = model.rope(torch.arange(b) % 1024 + 64)
            times = []
            for _ in range(repeats + 1):
                started = time.perf_counter()
                s_part_step(model, model.embed(ids), rope)
                times.append(time.perf_counter() - started)
            curve[b] = min(times[1:])
    return curve


def _t_runs(model, sizes: list[int], rounds: int, warm: bool, out: dict[int, list[float]]):
    """S-part step times (bench.model.s_part_step) per batch size into `out`, `rounds` rounds over all sizes (after
    a warm-up of each unless `warm` is False): interleaved, so a slow phase of a shared machine (up to 2x,
    lasting seconds) falls on every size alike. Yields after each run (see `t_samples_async`)."""
    with torch.inference_mode():
        inputs = {
            b: (torch.randint(0, model.config.vocab, (b,)), model.rope(torch.arange(b) % 1024 + 64)) for b in sizes
        }
        for rnd in range(rounds + warm):
            for b, (ids, rope) in inputs.items():
                started = time.perf_counter()
                s_part_step(model, model.embed(ids), rope)
                if rnd >= warm:
                    out.setdefault(b, []).append(time.perf_counter() - started)
                yield


def t_samples(model, sizes: list[int], rounds: int, warm: bool = True) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for _ in _t_runs(model, sizes, rounds, warm, out):
        pass
    return out


def t_now(model, b: int) -> float:
    """T(b) read once, now: the `s_part_now` that step_costs and long_step_terms read around each probe."""
    return t_samples(model, [b], 1)[b][0]


async def t_samples_async(model, sizes: list[int], rounds: int, warm: bool = True) -> dict[int, list[float]]:
    """`t_samples` giving the event loop a turn after each run: the R-worker connections' heartbeats time out after
    5 s, which a few runs at B=512 in a slow phase exceed."""
    out: dict[int, list[float]] = {}
    for _ in _t_runs(model, sizes, rounds, warm, out):
        await asyncio.sleep(0)
    return out


def t_median(model, sizes: list[int], rounds: int = 5) -> dict[int, float]:
    """T(B) as the median of interleaved rounds (`t_samples`): the min of one size's back-to-back repeats would
    take the fastest phase, or a whole slow one, while a row's median step sits at the typical speed."""
    return {b: statistics.median(t) for b, t in t_samples(model, sizes, rounds).items()}


def kernel_r(model, seq_len: int, dtype: str = "fp16", batch: int = 16) -> float:
    """R: seconds of attention per context entry, all layers, one thread (one R-worker)."""
    c = model.config
    per_seq = -(-seq_len // 16)
    pool = KVPool(
        KVConfig(
            n_layers=c.n_layers, n_blocks=batch * per_seq, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype=dtype
        )
    )
    for arr in (pool.k, pool.v, pool.k_scale, pool.v_scale):  # touch the memory (untouched pages all read
        if arr is not None:  # as the one shared zero page)
            arr.fill(1)
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    lens = np.full(batch, seq_len, np.int32)
    q = np.random.default_rng(0).standard_normal((batch, c.n_heads, c.head_dim)).astype(np.float32)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for layer in range(c.n_layers):
            pool.attend(layer, q, tables, lens, n_threads=1)
        best = min(best, time.perf_counter() - started)
    return best / (batch * seq_len)


async def start_r_workers(
    graph: Graph, n: int, threads: int = 1, kv_dtype: str = "fp16", prefix: tuple[str, ...] = ()
) -> list[str]:
    args = ("--model", MODEL, "--kv-memory", "8GiB", "--kv-dtype", kv_dtype, "--threads", str(threads))
    nodes = await asyncio.gather(
        *(graph.start_node("r-worker", process=True, args=args, prefix=prefix) for _ in range(n))
    )
    return [node.actors["r-worker"] for node in nodes]


async def synthetic_step(
    graph: Graph,
    model,
    urls: list[str],
    batch: int,
    seq_len: int,
    name: str,
    steps: int = 5,
    pipeline: bool = True,
    context: int = 0,
    s_threads: int = 1,
    t_rounds: int = 2,
) -> dict:
    """Median step time of B sequences with contexts spread over [16, S - steps) (or all at `context`), of 5 steps
    by default (the median of 3 can swing between 403 and 635 ms for one configuration) after a warm-up step
    (aiollm.planner.fastdecode.probe_step); the S-worker (this process) runs its S-part on
    `s_threads` torch threads. With each side's CPU per step: where a step is longer than its CPU over the
    cores, cores sat idle (a side waiting on the other), which no bound of the step model prices."""
    torch.set_num_threads(s_threads)
    try:
        # the S-part alone at this row's batch and half-batch, right before and right after it (median of both):
        # the model's T(B) at this moment, bracketing the row against the machine's drift
        sizes = sorted({batch, max(1, batch // 2)})
        before = await t_samples_async(model, sizes, t_rounds)
        span = seq_len - PROMPT_LEN - steps - 3
        lens = [context or PROMPT_LEN + (i * span) // batch for i in range(batch)]
        step, s_cpu, r_cpus, held = await probe_step(
            graph.driver, model, urls, lens, steps, pipeline and batch >= 2, name
        )
        after = await t_samples_async(model, sizes, t_rounds, warm=False)
        local = {b: statistics.median(before[b] + after[b]) for b in sizes}
    finally:
        torch.set_num_threads(1)
    return {
        "batch": batch,
        "r_workers": len(urls),
        "s_threads": s_threads,
        "pipelined": pipeline and batch >= 2,
        "step_ms": 1e3 * step,
        "tokens_per_s": batch / step,
        "kv_tokens": int(held),
        "s_cpu_ms": 1e3 * s_cpu,
        "r_cpu_ms": 1e3 * sum(r_cpus),
        "busy": (s_cpu + sum(r_cpus)) / step,
        "t_local_ms": {str(b): 1e3 * t for b, t in local.items()},
    }


async def wait_steps(s, steps: int) -> None:
    """Wait until the S-worker has run `steps` steps; RuntimeError if it stops working before."""
    while len((await s.ask(GetTrace())).step_s) < steps:
        load = await s.ask(GetLoad())
        if not load.running and not load.waiting and len((await s.ask(GetTrace())).step_s) < steps:
            raise RuntimeError(f"the S-worker stopped after fewer than {steps} steps (its log says why)")
        await asyncio.sleep(0.1)


def random_prompts(model, batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, model.config.vocab, (batch, length), generator=gen).tolist()
