"""The FastDecode sizing's measurements: T(B) and R on this machine, and the step model's terms read from real
decode steps of an S-worker and R-worker processes, each side timed by its own process CPU clock.

`aiollm.planner.fastdecode` is the model (pure arithmetic over measured inputs); this module measures those
inputs, so the model can be tested with given numbers and `python -m aiollm.plan fastdecode --t-of-b PATH
--r-per-token R` runs without a model loaded. The probes drive real actors (an S-worker spawned on the caller's
driver, R-workers wherever their URLs point) because every term they read, a wake-up, a KV write, the cores two
processes share, is one a synthetic ping-pong misses (it reads 2-3x less).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable

import numpy as np

from aiollm.planner.fastdecode import (
    AskCost,
    Overlap,
    balanced_context,
    effective_cores,
    interpolate,
    interpolate_cost,
    overlap_loss,
    predict_step,
)

# threads of the S-part and of each R-worker's attention while measuring: the roles' defaults (`--role s-worker
# --threads 1`, `--role r-worker --threads 1`), the placement the model prices. Left at torch's default (every
# core), the S-part would run on every core (on 2 cores its CPU per step reads ~1.7x its wall time), and the sizing
# would price B=256 on one R-worker at ~2x the step `bench fastdecode` measures (~500 against ~220 ms)
S_THREADS = 1
R_THREADS = 1


@contextlib.contextmanager
def _s_part_threads(torch):
    """The S-part on S_THREADS torch threads within the block (as the S-worker role runs it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(S_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure_t_of_b(model_name: str, batches: str | list[int], repeats: int = 3) -> dict[int, float]:
    """S-part step time (every layer's dense work and the logits, no attention) per batch size, on S_THREADS."""
    torch, model = _load_model(model_name)
    sizes = [int(b) for b in batches.split(",")] if isinstance(batches, str) else list(batches)
    out = {}
    c = model.config
    with torch.inference_mode(), _s_part_threads(torch):
        for batch in sizes:
            ids = torch.randint(0, c.vocab, (batch,))
            positions = torch.full((batch,), 100)
            best = math.inf
            for _ in range(repeats):
                start = time.perf_counter()
                h = model.embed(ids)
                rope = model.rope(positions)
                for layer in range(c.n_layers):
                    q, _, _ = model.pre_attention(layer, h, positions, rope)
                    h = model.post_attention(layer, h, q)
                model.logits(h)
                best = min(best, time.perf_counter() - start)
            out[batch] = best
    return out


def measure_r(model_name: str, seq_len: int, batch: int = 16, repeats: int = 3) -> float:
    """Seconds of decode attention per context token (all layers) on one R-worker (R_THREADS), via aiollm.kv."""
    try:
        from aiollm.kv.pool import KVConfig, KVPool
    except ImportError as exc:
        raise ImportError(f"measuring R needs aiollm.kv (not importable: {exc}); pass --r-per-token instead") from None
    torch, model = _load_model(model_name)
    c = model.config
    block = 16
    per_seq = -(-(seq_len + 1) // block)
    pool = KVPool(KVConfig.for_model(c, batch * per_seq, block, "fp16"))
    for arr in (pool.k, pool.v, pool.k_scale, pool.v_scale):  # touch the memory: untouched pages all map the
        if arr is not None:  # one shared zero page and read far too fast
            arr.fill(1)
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    lens = np.full(batch, seq_len, dtype=np.int32)
    q = np.random.default_rng(0).standard_normal((batch, c.n_heads, c.head_dim)).astype(np.float32)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in range(c.n_layers):
            pool.attend(layer, q, tables, lens, n_threads=R_THREADS)
        best = min(best, time.perf_counter() - start)
    return best / (batch * seq_len)


def measure_costs(
    model_name: str,
    rows: list[int],
    t_of_b: dict[int, float],
    r_per_token: float,
    workers: tuple[int, ...] = (1, 2),
    kv_dtype: str = "fp16",
    seq_len: int = 1024,
) -> tuple[dict[int, dict[int, AskCost]], float, float, Overlap]:
    """({P: ask costs} by `step_costs`, R in situ and the S-worker's CPU per streamed KV entry by `long_step_terms`
    with the most R-workers, and the overlap loss by `measure_overlap` with one R-worker) against R-worker processes started here for the purpose (`python -m aiollm.node
    --role r-worker`, loopback TCP, as the S-worker talks to its R-workers)."""
    import asyncio

    from aiollm.deploy.graph import Graph

    torch, model = _load_model(model_name)

    async def run() -> tuple[dict[int, dict[int, AskCost]], float, float, Overlap]:
        async with Graph(startup_timeout=120.0) as graph:
            nodes = [
                await graph.start_node(
                    "r-worker",
                    process=True,
                    args=(
                        "--model",
                        model_name,
                        "--kv-memory",
                        "4GiB",
                        "--kv-dtype",
                        kv_dtype,
                        "--threads",
                        str(R_THREADS),
                    ),
                )
                for _ in range(max(workers))
            ]
            urls = [node.actors["r-worker"] for node in nodes]
            # the sizing prices pipelined steps; the long probe runs unpipelined, so it subtracts that mode's costs
            costs = {
                p: await step_costs(graph.driver, model, urls[:p], rows, t_of_b, r_per_token, pipeline=True)
                for p in workers
            }
            p = max(workers)
            plain = await step_costs(graph.driver, model, urls[:p], [max(rows)], t_of_b, r_per_token)
            terms = await long_step_terms(
                graph.driver, model, urls[:p], p * max(rows), seq_len // 2, t_of_b, plain, r_per_token, repeats=3
            )
            p, cores = min(workers), len(os.sched_getaffinity(0))
            batch = 2 * p * max(rows)
            context = balanced_context(
                lambda c: predict_step(
                    t_of_b,
                    terms[0],
                    costs[p],
                    model.config.n_layers,
                    batch,
                    batch * c,
                    p,
                    True,
                    cores,
                    s_per_token=terms[1],
                ),
                seq_len - 8,
            )
            loss = await measure_overlap(
                graph.driver, model, urls[:p], batch, context, costs[p], cores, longest=seq_len - 8
            )
            return costs, *terms, loss

    with _s_part_threads(torch):  # the probes' S-worker runs in this process
        return asyncio.run(run())


async def probe_step(
    driver,
    model,
    r_workers: list[str],
    context_lens: list[int],
    steps: int = 4,
    pipeline: bool = False,
    name: str = "step-probe",
) -> tuple[float, float, list[float], float]:
    """(median step wall seconds, the S-worker's CPU per step, each R-worker's CPU per step, mean KV
    entries held) of `steps` decode steps (after one warm-up step) of synthetic sequences with `context_lens`,
    by an S-worker spawned on `driver` (this process) and the R-worker processes at `r_workers`, each side
    timed by its own process CPU clock."""
    import asyncio

    from aiollm.serving.distserve.messages import GetLoad
    from aiollm.serving.fastdecode.messages import GetRLoad, GetTrace, Synthetic
    from aiollm.serving.fastdecode.s_worker import SWorker, SWorkerConfig

    refs = [driver.ref(url) for url in r_workers]
    config = SWorkerConfig(max_batch=len(context_lens), pipeline=pipeline, pipeline_min_batch=2)
    s = await driver.spawn(SWorker(model, r_workers, config), name)
    deadline = time.monotonic() + 300.0

    async def steps_done(n: int) -> int:
        while len(trace := (await s.ask(GetTrace())).step_s) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the S-worker did not finish its steps")
            await asyncio.sleep(0.02)
        return len(trace)

    try:
        await s.ask(Synthetic(context_lens, steps + 2), timeout=300.0)
        first = await steps_done(1)
        before = [(await r.ask(GetRLoad())).cpu_s for r in refs]
        last = await steps_done(steps + 1)
        after = [(await r.ask(GetRLoad())).cpu_s for r in refs]
        trace = await s.ask(GetTrace())
        while (await s.ask(GetLoad())).running:
            await asyncio.sleep(0.02)
    finally:
        await driver.stop_actor(name)
    r_cpu = [(b - a) / max(1, last - first) for a, b in zip(before, after)]
    return (
        float(np.median(trace.step_s[1:])),
        float(np.median(trace.cpu_s[1:])),
        r_cpu,
        float(np.mean(trace.tokens[1:])),
    )


async def measure_overlap(
    driver,
    model,
    r_workers: list[str],
    batch: int,
    context: int,
    costs: dict[int, AskCost],
    cores: float,
    steps: int = 8,
    longest: int = 0,
) -> Overlap:
    """The pipeline's overlap loss (`overlap_loss`) from a pipelined probe of `batch` sequences at `context`
    entries on the R-workers at `r_workers` (choose it with `balanced_context`), each side timed by its own CPU
    clock, the waits per ask taken from the pipelined `costs` (`step_costs`) as `predict_step` takes them. Median
    of 8 steps: on a machine whose speed drifts, the loss of a 4-step probe can read 0.007 in one run and 0.178 in
    the next.

    The loss shows only where the sides balance, and `context` is where the model expects them to. With `longest`
    > 0, a probe whose sides came out more than 15 % apart is followed by one at the context where the measured
    sides meet (the busiest R-worker's CPU beyond its asks taken as proportional to the context; at most
    `longest`), and the better balanced of the two is kept. (A probe off balance shows almost no loss: with the
    S-worker at 104.5 and the R-worker at 150.9 ms of CPU it can read 0.007, so the model would expect a perfect
    overlap and price at 122 ms a step that runs 163.)"""
    p = len(r_workers)
    layers = model.config.n_layers
    ask = interpolate_cost(costs, max(1.0, batch / (2 * p)))
    waits = layers * 2 * p * ask.wait

    async def probe(at: int) -> Overlap:
        step, s_cpu, r_cpus, _ = await probe_step(
            driver, model, r_workers, [at] * batch, steps, pipeline=True, name=f"overlap-probe-{p}"
        )
        return Overlap(overlap_loss(step, s_cpu, r_cpus, cores, waits), batch, at, p, step, s_cpu, max(r_cpus), waits)

    def imbalance(o: Overlap) -> float:
        return abs(math.log((o.s_cpu + o.waits) / max(o.r_cpu, 1e-9)))

    probes = [await probe(context)]
    first = probes[0]
    fixed = layers * 2 * ask.r  # the busiest R-worker's CPU for its asks, whatever the context
    if longest > 0 and imbalance(first) > math.log(1.15) and first.r_cpu > fixed:
        meet = round(context * max(first.s_cpu + waits - fixed, 0.0) / (first.r_cpu - fixed))
        meet = min(longest, max(16, meet))
        if meet != context:
            probes.append(await probe(meet))
    return min(probes, key=imbalance)


async def step_curve(
    driver, model, r_workers: list[str], batch: int, contexts: list[int], steps: int = 6, passes: int = 2
) -> list[tuple[float, float]]:
    """(W, step seconds) of pipelined decode steps of `batch` synthetic sequences at each of `contexts`, for
    `fit_step_curve`: W is the mean KV entries the steps held, the step the median of `steps` (`probe_step`),
    the fastest of `passes` passes (a slow phase of a shared machine only ever adds time: a pass that meets one can
    scatter 20 ms rms about its fit where a calm one scatters 6.6, and move the placed S by ~10 %). The
    first pass visits the contexts from the middle outwards, alternating sides, the next in the reverse order, and
    so on, so that a slow phase seconds long falls on different W each pass."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    order = sorted(contexts, key=lambda c: abs(c - float(np.median(contexts))))
    best: dict[int, tuple[float, float]] = {}
    for i in range(passes):
        for c in order if i % 2 == 0 else order[::-1]:
            step, _, _, held = await probe_step(
                driver, model, r_workers, [c] * batch, steps, pipeline=True, name=f"curve-probe-{c}"
            )
            if c not in best or step < best[c][1]:
                best[c] = (held, step)
    return sorted(best.values())


async def _s_part_off_loop(s_part_now: Callable[[int], float], rows: int) -> float:
    """s_part_now(rows) on the step thread (aiollm.serving.step_thread), as a serving process runs its steps: a
    large T(B) takes seconds on a slow host, and the event loop must keep the R-workers' heartbeats going meanwhile
    (blocked 5 s, they drop this node as dead)."""
    from aiollm.serving.step_thread import run_step

    return await run_step(s_part_now, rows)


async def step_costs(
    driver,
    model,
    r_workers: list[str],
    rows: list[int],
    t_of_b: dict[int, float],
    r_per_token: float,
    context: int = 16,
    steps: int = 4,
    pipeline: bool = False,
    s_part_now: Callable[[int], float] | None = None,
) -> dict[int, AskCost]:
    """{b: AskCost}: what a real decode step spends per ask beyond its S-part and attention, with b rows per ask.

    Synthetic sequences of `context` entries, b per R-worker in each mini-batch (one, or two with `pipeline`),
    decode through the P R-workers at `r_workers` (`probe_step`). Per ask: the S-worker's CPU beyond its S-part
    (encoding q/k/v, decoding replies, the event loop, sampling spread over the asks: (CPU per step - groups *
    T(P*b)) / asks), the busiest R-worker's CPU beyond its attention, and the wait: the part of the step the
    busier side does not compute. Pipelined steps cost the S-worker more per ask than two unpipelined halves
    (two coroutines interleaving, a loop wake-up per reply), so each mode is priced with its own. An idle
    ping-pong with the same tensors reads 2-3x less: it misses the wake-ups, the KV write and block
    tables, and the competition for cores.

    s_part_now(b): the S-part's seconds at b rows measured now; given, it is read right before and right after
    each probe and the mean subtracted instead of `t_of_b`'s: the S share of an ask is the small difference of
    two large numbers, and a shared machine's speed drifts by up to 2x in phases of seconds (T(128) alone can read
    66-137 ms within 25 s), which puts 0-8 ms per ask into it from a T(B) measured minutes earlier."""
    out = {}
    p = len(r_workers)
    groups = 2 if pipeline else 1
    asks = model.config.n_layers * groups
    for b in rows:
        before = await _s_part_off_loop(s_part_now, p * b) if s_part_now else 0.0
        step, s_cpu, r_cpus, held = await probe_step(
            driver, model, r_workers, [context] * (groups * p * b), steps, pipeline, name=f"cost-probe-{p}-{b}-{groups}"
        )
        s_part = (before + await _s_part_off_loop(s_part_now, p * b)) / 2 if s_part_now else interpolate(t_of_b, p * b)
        r_cpu = max(r_cpus)
        r_over = max(0.0, r_cpu - r_per_token * held / p)
        busy = max(s_cpu, r_cpu) if pipeline else s_cpu + r_cpu
        out[b] = AskCost(max(0.0, s_cpu - groups * s_part) / (asks * p), r_over / asks, max(0.0, step - busy) / asks)
    return out


async def long_step_terms(
    driver,
    model,
    r_workers: list[str],
    batch: int,
    context: int,
    t_of_b: dict[int, float],
    costs: dict[int, AskCost],
    r_kernel: float,
    floor: bool = True,
    s_part_now: Callable[[int], float] | None = None,
    repeats: int = 1,
) -> tuple[float, float]:
    """(R in situ, the S-worker's CPU per KV entry streamed) from unpipelined probes of `batch` sequences at
    `context` entries on the R-workers at `r_workers`: the busiest R-worker's CPU beyond its asks per entry it
    holds (a real R-worker's blocks, its peers attending at the same time), and the S-worker's CPU beyond T(B) and
    its asks per entry all R-workers hold (T(B) read right before and after each probe with `s_part_now`, as in
    `step_costs`); each the median over `repeats` probes (both are small residues of large CPU totals: one probe
    can read 3.3 us per entry and 345 ns of S-worker CPU per entry where the one before read 1.3 us and 0). With
    `floor` the kernel alone on a fresh pool, `r_kernel`, bounds R from below; without, it only stands in where
    the probes give no positive value (the fresh pool and real R-workers' steps read about the same per entry,
    ~1.9-2.5 us on a small host, so with `floor` the kernel often replaces the in-situ value)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    p = len(r_workers)
    layers = model.config.n_layers
    ask = interpolate_cost(costs, batch / p)
    situs, s_tokens = [], []
    for i in range(repeats):
        before = await _s_part_off_loop(s_part_now, batch) if s_part_now else 0.0
        _, s_cpu, r_cpus, held = await probe_step(
            driver, model, r_workers, [context] * batch, name=f"long-probe-{p}-{i}"
        )
        s_part = (before + await _s_part_off_loop(s_part_now, batch)) / 2 if s_part_now else interpolate(t_of_b, batch)
        situs.append((max(r_cpus) - layers * ask.r) / (held / p))
        s_tokens.append(max(0.0, (s_cpu - s_part - layers * p * ask.s) / held))
    situ = float(np.median(situs))
    r_situ = max(r_kernel, situ) if floor else (situ if situ > 0 else r_kernel)
    return r_situ, float(np.median(s_tokens))


_CORES_JOB = """import sys, time
import numpy as np
a = np.ones((192, 192), np.float32)
while time.time() < float(sys.argv[1]):
    time.sleep(0.002)
t = time.perf_counter()
for _ in range({iterations}):
    a = (a @ a) * (1.0 / 192)
print(time.perf_counter() - t)
"""


def measure_effective_cores(cores: int, rounds: int = 3, iterations: int = 1000) -> float:
    """`effective_cores` from `rounds` paired rounds of a ~0.2 s single-threaded GEMM loop, alone and as `cores`
    processes started together (each timed by itself from a common start instant, so process start-up is not in
    it)."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    job = _CORES_JOB.format(iterations=iterations)

    def timed(n: int) -> list[float]:
        start = time.time() + 0.3 + 0.1 * n  # after every copy has imported numpy
        procs = [
            subprocess.Popen([sys.executable, "-c", job, str(start)], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(n)
        ]
        return [float(proc.communicate()[0]) for proc in procs]

    alone, together = [], []
    for _ in range(rounds):
        alone += timed(1)
        together.append(timed(cores))
    return effective_cores(cores, alone, together)


@functools.lru_cache(maxsize=1)
def _load_model(name: str):
    """The model once per process (T(B) and R are measured on the same one)."""
    try:
        import torch

        from aiollm import model as aiollm_model
        from aiollm.model.linear import fastest_cpu_dtype

        return torch, aiollm_model.load(name, dtype=fastest_cpu_dtype())
    except ImportError as exc:
        raise ImportError(f"measuring needs aiollm.model (not importable: {exc}); pass --t-of-b PATH instead") from None
