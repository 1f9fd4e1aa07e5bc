"""FastDecode sizing: the batch B and R-worker count P from the S-part step time T(B) and the R-part cost R.

Why P ~= B*S*R / (2*T(B)): under the load-stabilising schedule the B sequences are spread evenly over
lengths 0..S, so a step's attention reads about B*S/2 context tokens, B*S*R/2 seconds of R-part work split
over P R-workers. With the two-minibatch pipeline the R-part of one half overlaps the S-part of the other,
so neither side waits when the R time per step equals the S time T(B): B*S*R / (2*P) = T(B).
B itself is the largest batch whose T(B) meets the latency target, or, without one, the smallest batch that
reaches 90 % of the best measured S-part throughput B/T(B) (past it, more batch adds latency, not tokens/s).

That formula ignores two costs that dominate on a small CPU box (measured on 2 shared vCPUs: the formula
predicted 0.60x the real step). `predict_step` adds them:
- communication: every layer sends each R-worker one `Attend` per mini-batch and waits for the reply; its
  round trip C(b) at b rows (encode, loopback TCP, decode, handling, reply) is measured, not assumed, and
  counts both as latency on each mini-batch's chain and as CPU work on the two processes;
- core sharing: when the S-worker and the P R-workers have fewer cores than processes, no part overlaps for
  free: the step is at least all the CPU work (S-part + attention + communication) over the cores.
The step is the largest of four bounds: the S-worker's own work, the busiest R-worker's work, one mini-batch's
dependency chain through the layers, and all the work over the cores.
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

THROUGHPUT_KNEE = 0.9


@dataclass(frozen=True)
class Sizing:
    """The chosen batch and R-worker count, with the inputs and the reasoning."""

    batch: int
    t_of_b: float
    r_per_token: float
    seq_len: int
    workers_exact: float
    workers: int
    tokens_per_s: float
    reasoning: list[str] = field(default_factory=list)
    # the step predicted with communication and core sharing (0 when only the classic formula was used)
    predicted_step: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def explain(self) -> str:
        step = f", predicted step {self.predicted_step*1e3:.1f} ms" if self.predicted_step else ""
        return "\n".join(self.reasoning + [f"=> B = {self.batch}, P = {self.workers} R-workers "
                                           f"(formula alone {self.workers_exact:.3g}){step}, "
                                           f"~{self.tokens_per_s:.0f} tokens/s"])


@dataclass(frozen=True)
class StepPrediction:
    """A decode step's predicted time and the bounds it is the largest of (seconds)."""

    step: float
    s_worker: float
    r_worker: float
    chain: float
    all_over_cores: float
    # the communication CPU included above, and the round trip per ask it came from
    communication: float
    round_trip: float

    def explain(self) -> str:
        bounds = {"S-worker work": self.s_worker, "busiest R-worker": self.r_worker,
                  "one mini-batch's chain": self.chain, "all work / cores": self.all_over_cores}
        binding = max(bounds, key=bounds.get)
        return (", ".join(f"{k} {v*1e3:.1f} ms" for k, v in bounds.items())
                + f" -> {self.step*1e3:.1f} ms ({binding} binds; communication {self.communication*1e3:.1f} ms "
                  f"of CPU at {self.round_trip*1e3:.2f} ms per ask)")


def predict_step(t_of_b: dict[int, float], r_per_token: float, round_trip: dict[int, float], n_layers: int,
                 batch: int, kv_tokens: float, workers: int, pipelined: bool, cores: float) -> StepPrediction:
    """Predicted decode step of `batch` sequences holding `kv_tokens` KV entries in all, on `workers` R-workers.

    t_of_b: S-part seconds per batch size; r_per_token: attention seconds per KV entry (all layers, one
    thread); round_trip: seconds of one `Attend` ask per rows carried; cores: the cores the S-worker and the
    R-workers share (the effective count when other load is on them). Rows are spread evenly over R-workers."""
    if batch <= 0 or workers <= 0 or n_layers <= 0 or cores <= 0 or kv_tokens < 0:
        raise ValueError(f"need batch, workers, n_layers, cores > 0 and kv_tokens >= 0, got {batch}, {workers}, "
                         f"{n_layers}, {cores}, {kv_tokens}")
    if not round_trip:
        raise ValueError("round_trip: need measured {rows: seconds}")
    groups = 2 if pipelined else 1
    half = batch / groups
    s_part = groups * interpolate(t_of_b, half)
    attention = r_per_token * kv_tokens
    rows = max(1.0, half / workers)
    trip = interpolate(round_trip, rows)
    asks = n_layers * groups * workers
    communication = asks * trip
    # the round trip's CPU is split between the S-worker (encode q/k/v, decode o) and the R-worker (the reverse)
    s_worker = s_part + communication / 2
    r_worker = attention / workers + n_layers * groups * trip / 2
    # a mini-batch waits for its own S-part (all layers), a round trip per layer, and its share of attention,
    # which its R-workers run side by side only as far as there are cores for them
    chain = interpolate(t_of_b, half) + n_layers * trip + attention / (groups * min(workers, cores))
    all_over_cores = (s_part + attention + communication) / min(cores, workers + 1)
    step = max(s_worker, r_worker, chain, all_over_cores)
    return StepPrediction(step, s_worker, r_worker, chain, all_over_cores, communication, trip)


def interpolate(curve: dict[int, float], batch: float) -> float:
    """T(B) by linear interpolation between measured batches (linear extrapolation beyond them)."""
    bs = np.array(sorted(curve), dtype=np.float64)
    ts = np.array([curve[int(b)] for b in bs])
    if len(bs) == 1:
        return float(ts[0] * max(batch, 1) / bs[0])
    if batch > bs[-1]:
        slope = (ts[-1] - ts[-2]) / (bs[-1] - bs[-2])
        return float(ts[-1] + slope * (batch - bs[-1]))
    return float(np.interp(batch, bs, ts))


def size(t_of_b: dict[int, float], r_per_token: float, seq_len: int, latency_target: float | None = None,
         round_trip: dict[int, dict[int, float]] | None = None, n_layers: int = 0, cores: float = 0.0) -> Sizing:
    """Pick B from the measured T(B) curve, then P = B*S*R / (2*T(B)); with C(b) measured per R-worker count
    ({P: {rows per ask: seconds}}, see `step_round_trip`; a P not measured uses the largest measured one below
    it), the model's layer count and the cores the roles share, P is instead the fewest R-workers whose
    `predict_step` is within 5 % of the best, and the predicted step is the one reported."""
    if not t_of_b or any(b <= 0 or t <= 0 for b, t in t_of_b.items()):
        raise ValueError("t_of_b: need measured {batch: seconds} with positive values")
    if r_per_token <= 0 or seq_len <= 0:
        raise ValueError(f"r_per_token and seq_len must be > 0, got {r_per_token}, {seq_len}")
    batches = sorted(t_of_b)
    lines = ["T(B), the S-part step time measured per batch size: " +
             ", ".join(f"T({b})={t_of_b[b]*1e3:.2f} ms" for b in batches),
             f"R, attention time per context token on one R-worker: {r_per_token*1e9:.2f} ns; S = {seq_len} tokens"]
    if latency_target is not None:
        if latency_target <= 0:
            raise ValueError(f"latency_target must be > 0, got {latency_target}")
        fitting = [b for b in range(1, 2 * batches[-1] + 1) if interpolate(t_of_b, b) <= latency_target]
        if not fitting:
            raise ValueError(f"latency target {latency_target*1e3:.1f} ms is below T(1) = "
                             f"{interpolate(t_of_b, 1)*1e3:.2f} ms: no batch meets it")
        batch = fitting[-1]
        lines.append(f"B = {batch}: the largest batch whose S-part step T(B) stays within the "
                     f"{latency_target*1e3:.1f} ms target (the two-minibatch pipeline keeps the step at ~T(B))")
    else:
        throughput = {b: b / t_of_b[b] for b in batches}
        best = max(throughput.values())
        batch = min(b for b in batches if throughput[b] >= THROUGHPUT_KNEE * best)
        lines.append(f"B = {batch}: the smallest measured batch reaching {THROUGHPUT_KNEE*100:.0f} % of the best "
                     f"S-part throughput ({best:.0f} sequences/s); larger batches add latency, not throughput")
    t = interpolate(t_of_b, batch)
    exact = batch * seq_len * r_per_token / (2 * t)
    workers = max(1, math.ceil(exact - 1e-9))
    lines.append(f"P = B*S*R / (2*T(B)) = {batch}*{seq_len}*{r_per_token:.3e} / (2*{t:.4f}) = {exact:.3g}: "
                 f"a step's attention covers ~B*S/2 tokens (lengths spread over 0..S), which P R-workers finish in T(B)")
    if round_trip is None:
        return Sizing(batch, t, r_per_token, seq_len, exact, workers, batch / t, lines)
    if n_layers <= 0 or cores <= 0:
        raise ValueError(f"with round_trip, need n_layers and cores > 0, got {n_layers}, {cores}")
    if not round_trip or min(round_trip) < 1:
        raise ValueError("round_trip: need {R-workers: {rows: seconds}} for at least one R-worker count >= 1")
    for p in sorted(round_trip):
        lines.append(f"C(b), a step's per-layer cost per ask beyond S-part and attention, measured in real steps "
                     f"with {p} R-worker(s): " +
                     ", ".join(f"C({b})={t*1e3:.2f} ms" for b, t in sorted(round_trip[p].items())))
    lines.append(f"{n_layers} layers x 2 mini-batches x P asks per step; {cores:.3g} cores shared by the S-worker "
                 f"and the P R-workers (one thread each)")
    pipelined = batch >= 2

    def curve(p: int) -> dict[int, float]:
        return round_trip[max(m for m in round_trip if m <= p)]

    options = {p: predict_step(t_of_b, r_per_token, curve(p), n_layers, batch, batch * seq_len / 2, p, pipelined,
                               cores) for p in range(1, max(2 * workers, math.ceil(cores) + 2, 4) + 1)}
    best = min(o.step for o in options.values())
    chosen = min(p for p, o in options.items() if o.step <= 1.05 * best)
    for p, o in options.items():
        lines.append(f"  P={p}: {o.explain()}")
    lines.append(f"P = {chosen}: the fewest R-workers within 5 % of the best predicted step; past it, more "
                 f"R-workers add asks (communication) and processes competing for the {cores:.3g} cores, not speed")
    step = options[chosen].step
    return Sizing(batch, t, r_per_token, seq_len, exact, chosen, batch / step, lines, predicted_step=step)


def read_t_of_b(path: str | Path, key: str = "t_of_b") -> dict[int, float]:
    """T(B) from `python -m bench model --json` output: under `key` (`t_of_b` for fp32, `t_of_b_bf16`...),
    [{"batch": B, "seconds": T}, ...] as bench model writes it, or {B: T}, or [[B, T], ...]."""
    data = json.loads(Path(path).read_text())
    if key not in data:
        raise ValueError(f"{path}: no key {key!r} (expected the JSON of `python -m bench model --json`)")
    raw = data[key]
    if isinstance(raw, dict):
        return {int(b): float(t) for b, t in raw.items()}
    if raw and isinstance(raw[0], dict):
        return {int(row["batch"]): float(row["seconds"]) for row in raw}
    return {int(b): float(t) for b, t in raw}


def measure_t_of_b(model_name: str, batches: str | list[int], repeats: int = 3) -> dict[int, float]:
    """S-part step time (every layer's dense work and the logits, no attention) per batch size."""
    torch, model = _load_model(model_name)
    sizes = [int(b) for b in batches.split(",")] if isinstance(batches, str) else list(batches)
    out = {}
    c = model.config
    with torch.inference_mode():
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
    """Seconds of decode attention per context token (all layers) on one R-worker, via aiollm.kv."""
    try:
        from aiollm.kv.pool import KVConfig, KVPool
    except ImportError as exc:
        raise ImportError(f"measuring R needs aiollm.kv (not importable: {exc}); pass --r-per-token instead") from None
    torch, model = _load_model(model_name)
    c = model.config
    block = 16
    per_seq = -(-(seq_len + 1) // block)
    pool = KVPool(KVConfig(n_layers=c.n_layers, n_blocks=batch * per_seq, n_kv_heads=c.n_kv_heads,
                           head_dim=c.head_dim, block_size=block, dtype="fp16"))
    for arr in (pool.k, pool.v, pool.k_scale, pool.v_scale):  # touch the memory: untouched pages all map the
        if arr is not None:                                    # one shared zero page and read far too fast
            arr.fill(1)
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    lens = np.full(batch, seq_len, dtype=np.int32)
    q = np.random.default_rng(0).standard_normal((batch, c.n_heads, c.head_dim)).astype(np.float32)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in range(c.n_layers):
            pool.attend(layer, q, tables, lens)
        best = min(best, time.perf_counter() - start)
    return best / (batch * seq_len)


def measure_round_trip(model_name: str, rows: list[int], t_of_b: dict[int, float], r_per_token: float,
                       workers: tuple[int, ...] = (1, 2), kv_dtype: str = "fp16") -> dict[int, dict[int, float]]:
    """{P: C(b)} by `step_round_trip` against P R-worker processes started here for the purpose
    (`python -m aiollm.node --role r-worker`, loopback TCP, as the S-worker talks to its R-workers)."""
    import asyncio

    from aiollm.graph import Graph

    _, model = _load_model(model_name)

    async def run() -> dict[int, dict[int, float]]:
        async with Graph(startup_timeout=120.0) as graph:
            nodes = [await graph.start_node("r-worker", process=True, args=(
                "--model", model_name, "--kv-memory", "1GiB", "--kv-dtype", kv_dtype, "--threads", "1"))
                for _ in range(max(workers))]
            urls = [node.actors["r-worker"] for node in nodes]
            return {p: await step_round_trip(graph.driver, model, urls[:p], rows, t_of_b, r_per_token)
                    for p in workers}

    return asyncio.run(run())


async def step_round_trip(driver, model, r_workers: list[str], rows: list[int], t_of_b: dict[int, float],
                          r_per_token: float, context: int = 16, steps: int = 4) -> dict[int, float]:
    """C(b): seconds per layer that a real decode step spends beyond its S-part and attention, with b rows per ask.

    An S-worker spawned on `driver` (a Node) decodes P*b synthetic sequences of `context` entries through the
    P R-workers at `r_workers` without the pipeline, so C(b) = (median step - T(P*b) - R*W/P) / layers. That is
    each layer's `Attend` round trip with everything a real step adds to it (encoding the q/k/v slices, waking
    the R-workers, their KV write and block tables, decoding the replies; with more processes than cores, the
    waits for a core) plus the step's sampling, spread over the layers. An idle ping-pong with the same tensors
    measured 2-3x less here: it misses the wake-ups and the competition for cores."""
    import asyncio

    from aiollm.workers.fastdecode_messages import GetTrace, Synthetic
    from aiollm.workers.messages import GetLoad
    from aiollm.workers.s_worker import SWorker, SWorkerConfig

    out = {}
    p = len(r_workers)
    for b in rows:
        name = f"round-trip-probe-{p}-{b}"
        s = await driver.spawn(SWorker(model, r_workers, SWorkerConfig(max_batch=p * b, pipeline=False)), name)
        try:
            await s.ask(Synthetic([context] * (p * b), steps + 1), timeout=300.0)
            deadline = time.monotonic() + 120.0
            while len((trace := await s.ask(GetTrace())).step_s) < steps + 1 or (await s.ask(GetLoad())).running:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"round-trip probe at {b} rows: the S-worker did not finish its steps")
                await asyncio.sleep(0.02)
        finally:
            await driver.stop_actor(name)
        step = float(np.median(trace.step_s[1:]))
        attention = r_per_token * float(np.mean(trace.tokens[1:])) / p
        out[b] = max(0.0, (step - interpolate(t_of_b, p * b) - attention) / model.config.n_layers)
    return out


@functools.lru_cache(maxsize=1)
def _load_model(name: str):
    """The model once per process (T(B) and R are measured on the same one)."""
    try:
        import torch

        from aiollm import model as aiollm_model
        return torch, aiollm_model.load(name, dtype="bf16")
    except ImportError as exc:
        raise ImportError(f"measuring needs aiollm.model (not importable: {exc}); pass --t-of-b PATH instead") from None
