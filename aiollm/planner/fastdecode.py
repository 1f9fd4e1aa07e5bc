"""FastDecode sizing: the batch B and R-worker count P from the S-part step time T(B) and the R-part cost R.

Why P ~= B*S*R / (2*T(B)): under the load-stabilising schedule the B sequences are spread evenly over
lengths 0..S, so a step's attention reads about B*S/2 context tokens, B*S*R/2 seconds of R-part work split
over P R-workers. With the two-minibatch pipeline the R-part of one half overlaps the S-part of the other,
so neither side waits when the R time per step equals the S time T(B): B*S*R / (2*P) = T(B).
B itself is the largest batch whose T(B) meets the latency target, or, without one, the smallest batch that
reaches 90 % of the best measured S-part throughput B/T(B) (past it, more batch adds latency, not tokens/s).

That formula ignores costs that dominate on a small CPU box (on 2 shared vCPUs it predicts 0.60x the real
step). `predict_step` adds them, each measured in real steps of S-worker and
R-worker processes with their CPU clocks (`step_costs`, `long_step_terms` in
`aiollm.calibrate.fastdecode_probes`, which measures every input this module prices), not assumed:
- communication and bookkeeping: every layer sends each R-worker one `Attend` per mini-batch and waits for the
  reply. Per ask at b rows: the S-worker's CPU beyond its S-part T(B) (encoding, the event loop, sampling
  spread over the asks), the R-worker's CPU beyond the attention (decoding, KV write, block tables, reply),
  and the time neither computes (wire, wake-ups): `AskCost`;
- the R-part in situ: attention CPU per KV entry in a real R-worker while its peers attend too, and the
  S-worker's CPU that grows with the KV the R-workers stream (0.05-0.4 us per entry on a 2-core box: their
  streaming evicts its weights from the shared cache);
- core sharing: when the S-worker and the P R-workers have fewer cores than processes, no part overlaps for
  free: the step is at least all the CPU work over the cores.
- the pipeline's overlap loss: two mini-batches overlap S-side and R-side only as far as each side's per-layer
  work arrives in time for the other; where the two sides balance, every layer's jitter leaves one waiting
  (on a 2-core box pipelined steps run 14-31 % above the busier side's CPU, most where the sides are equal). One
  balanced probe (`measure_overlap`: a pipelined step whose S-side and R-side CPU the model prices equal) gives
  the idle beyond the bounds as a fraction of the lesser side (`overlap_loss`), and a pipelined step is charged
  that fraction of its own lesser side: nothing where one side dominates, the most where they balance.
The step is the largest of four bounds: the S-worker's own work, the busiest R-worker's work, one mini-batch's
dependency chain through the layers, and all the work over the cores, with the overlap loss on the first, second
and fourth when pipelined.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
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
    # how the chosen configuration runs: "pipelined" (two mini-batches, the S-part on one thread beside the
    # R-workers) or "time-shared" (one mini-batch, the S-part on every core, then the attention)
    mode: str = "pipelined"

    def to_json(self) -> dict:
        return asdict(self)

    def explain(self) -> str:
        step = f", predicted step {self.predicted_step * 1e3:.1f} ms" if self.predicted_step else ""
        return "\n".join(
            self.reasoning
            + [
                f"=> B = {self.batch}, P = {self.workers} R-workers, {self.mode} "
                f"(formula alone {self.workers_exact:.3g}){step}, "
                f"~{self.tokens_per_s:.0f} tokens/s"
            ]
        )


@dataclass(frozen=True)
class AskCost:
    """What one `Attend` ask at some rows costs beyond the S-part and the attention themselves (seconds)."""

    # the S-worker's CPU (its S-part measured alone excluded)
    s: float
    # the R-worker's CPU (its attention excluded)
    r: float
    # the time neither computes: wire, wake-ups
    wait: float

    @property
    def total(self) -> float:
        return self.s + self.r + self.wait

    @classmethod
    def even(cls, seconds: float) -> AskCost:
        """A round trip known only as a total: its CPU charged half to each side, no wait."""
        return cls(seconds / 2, seconds / 2, 0.0)


@dataclass(frozen=True)
class TimeShared:
    """What `size` needs to price the time-shared mode: no pipeline, the S-part on every core while the
    R-workers wait, then their attention while the S-worker waits. On few cores this can beat the pipeline
    (each phase has the machine to itself instead of the processes competing for it), so the sizing weighs both."""

    # T(B) with the S-part on every core
    t_of_b: dict[int, float]
    # unpipelined steps' ask costs, {P: {rows per ask: AskCost}} (`step_costs` with pipeline=False)
    round_trip: dict[int, dict[int, AskCost]]


@dataclass(frozen=True)
class StepPrediction:
    """A decode step's predicted time and the bounds it is the largest of (seconds)."""

    step: float
    s_worker: float
    r_worker: float
    chain: float
    all_over_cores: float
    # the communication included above (CPU of both sides and waits), and the ask cost it came from
    communication: float
    ask: AskCost
    # the S-worker's CPU alone (s_worker less the waits), and the pipeline's overlap loss charged (0 unpipelined)
    s_cpu: float = 0.0
    idle: float = 0.0

    def explain(self) -> str:
        bounds = {
            "S-worker work": self.s_worker,
            "busiest R-worker": self.r_worker,
            "one mini-batch's chain": self.chain,
            "all work / cores": self.all_over_cores,
        }
        binding = max(bounds, key=bounds.get)
        idle = f" + overlap loss {self.idle * 1e3:.1f} ms" if self.idle else ""
        return (
            ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in bounds.items())
            + idle
            + f" -> {self.step * 1e3:.1f} ms ({binding} binds; communication {self.communication * 1e3:.1f} ms at "
            f"{self.ask.total * 1e3:.2f} ms per ask: S {self.ask.s * 1e3:.2f}, R {self.ask.r * 1e3:.2f}, "
            f"wait {self.ask.wait * 1e3:.2f})"
        )


def predict_step(
    t_of_b: dict[int, float],
    r_per_token: float | dict[int, float],
    round_trip: dict[int, AskCost],
    n_layers: int,
    batch: int,
    kv_tokens: float,
    workers: int,
    pipelined: bool,
    cores: float,
    r_cores: float = 0.0,
    s_per_token: float = 0.0,
    overlap: float = 0.0,
) -> StepPrediction:
    """Predicted decode step of `batch` sequences holding `kv_tokens` KV entries in all, on `workers` R-workers.

    t_of_b: S-part seconds per batch size; r_per_token: attention seconds per KV entry (all layers, one
    thread), or {KV entries per R-worker: seconds} measured in situ (it rises with the KV an R-worker holds);
    round_trip: `AskCost` per rows carried; cores: the cores the S-worker and the R-workers share (the
    effective count when other load is on them); s_per_token: the S-worker's CPU per KV entry the R-workers
    stream. Rows are spread evenly over R-workers. r_cores > 0 is FastDecode's placement instead: the R-workers
    confined to `r_cores` cores of their own, the S-worker alone on the other `cores - r_cores` (its T(B)
    measured there), so each side's work is bounded by its own cores and only the pipeline's overlap is left.
    overlap: the pipeline's overlap loss (`overlap_loss`, 0..1): a pipelined step is the larger of the chain and
    its largest other bound plus `overlap` times the lesser of the S-worker's CPU and the busiest R-worker's."""
    if batch <= 0 or workers <= 0 or n_layers <= 0 or cores <= 0 or kv_tokens < 0:
        raise ValueError(
            f"need batch, workers, n_layers, cores > 0 and kv_tokens >= 0, got {batch}, {workers}, "
            f"{n_layers}, {cores}, {kv_tokens}"
        )
    if r_cores < 0 or (r_cores and r_cores >= cores):
        raise ValueError(f"r_cores must be 0 (all shared) or in (0, cores={cores}), got {r_cores}")
    if not round_trip:
        raise ValueError("round_trip: need measured {rows: AskCost}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1] (a fraction of the lesser side), got {overlap}")
    groups = 2 if pipelined else 1
    half = batch / groups
    s_part = groups * interpolate(t_of_b, half)
    r = per_entry(r_per_token, kv_tokens / workers)
    attention = r * kv_tokens
    rows = max(1.0, half / workers)
    ask = interpolate_cost(round_trip, rows)
    asks = n_layers * groups * workers
    # pipelined, the S-worker's timeline also holds the waits measured where it binds (a loop wake-up per reply)
    s_cpu = s_part + asks * ask.s + s_per_token * kv_tokens
    s_worker = s_cpu + (asks * ask.wait if pipelined else 0.0)
    r_each = attention / workers + n_layers * groups * ask.r
    # R-workers on cores of their own run side by side only as far as those cores go; sharing, see all_over_cores.
    # A fractional effective count means slower cores, not fewer: R in situ is measured with the R-workers attending
    # at once, so their slow-down side by side is in it already (dividing by 1.49 effective cores instead of 2
    # would price a time-shared step ~1.3x too long)
    side_by_side = min(workers, r_cores or math.ceil(cores - 1e-9))
    r_worker = r_each * workers / min(workers, r_cores) if r_cores else r_each
    # a mini-batch waits for its own S-side work, then per layer for its R-workers (side by side as far as there
    # are cores for them) and the wait of the ask
    chain = (
        interpolate(t_of_b, half)
        + n_layers * workers * ask.s
        + s_per_token * kv_tokens / groups
        + n_layers * (ask.wait + workers * ask.r / side_by_side)
        + attention / (groups * side_by_side)
    )
    all_over_cores = (s_worker + workers * r_each) / min(cores, workers + 1)
    idle = overlap * min(s_cpu, r_worker) if pipelined else 0.0
    step = max(max(s_worker, r_worker, all_over_cores) + idle, chain)
    return StepPrediction(step, s_worker, r_worker, chain, all_over_cores, asks * ask.total, ask, s_cpu, idle)


def overlap_loss(step: float, s_cpu: float, r_cpus: list[float], cores: float, waits: float) -> float:
    """The pipeline's overlap loss from one measured pipelined step: the time beyond the largest bound
    `predict_step` prices from the same CPU (the S-worker's CPU plus `waits`, its measured per-ask waits summed;
    the busiest R-worker's CPU; all of it over the cores the processes can use), as a fraction of the lesser of
    the S-worker's and the busiest R-worker's CPU, clamped to [0, 1] (0: perfect overlap; 1: no overlap at all).
    `predict_step` with this loss and these CPUs gives back `step` exactly, so the probe's configuration is
    reproduced and others are priced by how balanced their sides are."""
    if step <= 0 or s_cpu <= 0 or not r_cpus or min(r_cpus) < 0 or cores <= 0 or waits < 0:
        raise ValueError(
            f"need step, s_cpu, cores > 0, R-worker CPUs and waits >= 0, got {step}, {s_cpu}, "
            f"{r_cpus}, {cores}, {waits}"
        )
    r_cpu = max(r_cpus)
    if r_cpu <= 0:
        return 0.0
    bound = max(s_cpu + waits, r_cpu, (s_cpu + waits + sum(r_cpus)) / min(cores, len(r_cpus) + 1))
    return min(1.0, max(0.0, (step - bound) / min(s_cpu, r_cpu)))


def balanced_context(price: Callable[[int], StepPrediction], longest: int, shortest: int = 16) -> int:
    """The context (a multiple of 16 in [shortest, longest]) at which `price(context)` (e.g. `predict_step` at
    that context without overlap loss) has its S-worker CPU closest to its busiest R-worker's work: where the
    overlap loss is largest, so the probe measures it best."""
    contexts = range(shortest, longest + 1, 16)
    if not contexts:
        raise ValueError(f"need shortest <= longest, got {shortest}, {longest}")
    return min(contexts, key=lambda c: abs((p := price(c)).s_cpu - p.r_worker))


@dataclass(frozen=True)
class Overlap:
    """One balanced probe's measurement and the overlap loss it yields (seconds, `overlap_loss`)."""

    loss: float
    batch: int
    context: int
    workers: int
    step: float
    s_cpu: float
    r_cpu: float
    waits: float

    def explain(self) -> str:
        return (
            f"overlap loss {self.loss:.3f} of the lesser side, from a balanced pipelined probe (B={self.batch} at "
            f"context {self.context}, {self.workers} R-worker(s)): step {self.step * 1e3:.1f} ms vs S-worker CPU "
            f"{self.s_cpu * 1e3:.1f} ms (+ {self.waits * 1e3:.1f} ms measured waits), busiest R-worker CPU "
            f"{self.r_cpu * 1e3:.1f} ms"
        )


def per_entry(r_per_token: float | dict[int, float], entries: float) -> float:
    """R at an R-worker's load: a number as is, or {entries: seconds} interpolated linearly and held flat past
    the measured loads (a per-entry cost, not a total: extrapolating it could go negative)."""
    if not isinstance(r_per_token, dict):
        return r_per_token
    loads = sorted(r_per_token)
    return float(np.interp(entries, loads, [r_per_token[w] for w in loads]))


def interpolate_cost(costs: dict[int, AskCost], rows: float) -> AskCost:
    """Each part of an `AskCost` interpolated linearly between measured row counts (see `interpolate`)."""
    return AskCost(*(interpolate({b: getattr(c, f) for b, c in costs.items()}, rows) for f in ("s", "r", "wait")))


def schedule_gain(step: Callable[[float], float], batch: int, prompt: int, seq_len: int, points: int = 32) -> float:
    """Tokens/s with / without the load-stabilising schedule for `batch` sequences of `prompt` tokens decoding to
    `seq_len`, by a step-time function of W (the KV entries a step attends over, e.g. `predict_step`).

    Without the schedule a batch started together steps through equal contexts from the prompt to S, so its
    tokens/s is B over the mean step of that life; with it W stays at the life's mean. Only a step convex in W
    (FastDecode's max of S-part and R-part on hardware of their own) makes the held mean faster than the swing."""
    if not 0 < prompt < seq_len or batch <= 0:
        raise ValueError(f"need batch > 0 and 0 < prompt < seq_len, got {batch}, {prompt}, {seq_len}")
    contexts = np.linspace(prompt + 1, seq_len, points)
    life = float(np.mean([step(batch * c) for c in contexts]))
    return life / step(batch * float(np.mean(contexts)))


def balanced_seq_len(step: Callable[[float], float], batch: int, prompt: int, longest: int) -> int:
    """The S (a multiple of 16 up to `longest`) at which `schedule_gain` is largest: the unscheduled batch's
    mean W sits where the R-part starts to bind, so the S-part binds through the first half of its life and the
    R-part through the second (FastDecode's balanced case, up to ~25 % with a sharp max). Gains equal to within
    1e-3 go to the longer S: where the S-part binds at every S up to `longest` (the balance lies beyond it) the gain is
    1.000 throughout, and the longest S is the one nearest the balance, not the shortest."""
    lengths = range(max(32, 2 * prompt), longest + 1, 16)
    if not lengths:
        raise ValueError(f"longest ({longest}) must be >= {max(32, 2 * prompt)}")
    return max(lengths, key=lambda s: (round(schedule_gain(step, batch, prompt, s), 3), s))


@dataclass(frozen=True)
class StepCurve:
    """A decode step's seconds as a function of W, the KV entries it attends over, fitted to steps measured at a
    few W: a line while the S-part binds, bending at `knee` into a steeper one once the R-part does (FastDecode's
    max of the two sides), the bend rounded over `width` entries (a softplus; 0: a sharp corner).

    The schedule's balanced S comes from this rather than from the step model, whose inputs drift run to run and
    whose shape is off: it can price the gain still rising at S = 2880 where real steps at B=128 already bend at
    W ~110-160 K (S ~1700-2500). The rounding is what the pipeline loses where the sides balance (held steps sit
    1.02-1.19x above the S-bound floor): a held W
    at a sharp corner would look free, so the rounding moves the best S past the corner."""

    base: float
    slope_before: float
    slope_after: float
    knee: float
    width: float = 0.0
    # the root-mean-square residual of the fit (seconds): how far the points scatter about it
    residual: float = 0.0

    def __call__(self, w: float) -> float:
        return (
            self.base
            + self.slope_before * w
            + (self.slope_after - self.slope_before) * _bend(w - self.knee, self.width)
        )

    def explain(self) -> str:
        return (
            f"{self.base * 1e3:.1f} ms + {self.slope_before * 1e9:.0f} ns per entry, bending at W = "
            f"{self.knee:.0f} (rounded over {self.width:.0f} entries) into {self.slope_after * 1e9:.0f} ns per "
            f"entry (rms residual {self.residual * 1e3:.1f} ms)"
        )


def _bend(x: np.ndarray | float, width: float) -> np.ndarray | float:
    """max(0, x) rounded over `width` (a softplus of scale `width`; the exact max at 0)."""
    return np.maximum(0.0, x) if width <= 0 else width * np.logaddexp(0.0, np.asarray(x) / width)


def fit_step_curve(points: list[tuple[float, float]], grid: int = 64) -> StepCurve:
    """The `StepCurve` through measured (W, step seconds) points with the least squared error. The knee is
    searched between the second lowest and the second highest W (a line on each side needs two points) and the
    width from 0 to a quarter of the W spanned, on a `grid` x `grid` grid and then again as finely around the best
    pair; for each pair the other three coefficients are linear, so least squares gives them. Needs 5 points or
    more (five coefficients)."""
    if len(points) < 5:
        raise ValueError(f"need at least 5 (W, step) points to fit a rounded bent line, got {len(points)}")
    w = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    if np.any(w < 0) or np.any(t <= 0):
        raise ValueError(f"need W >= 0 and steps > 0, got {points}")
    ordered = np.sort(w)

    def best_of(knees: np.ndarray, widths: np.ndarray) -> tuple[float, float, float, np.ndarray]:
        best = None
        for width in widths:
            for knee in knees:
                basis = np.stack([np.ones_like(w), w, _bend(w - knee, width)], axis=1)
                coef, *_ = np.linalg.lstsq(basis, t, rcond=None)
                error = float(np.sum((basis @ coef - t) ** 2))
                if best is None or error < best[0] - 1e-15:
                    best = (error, float(knee), float(width), coef)
        return best

    low, high, widest = ordered[1], ordered[-2], (ordered[-1] - ordered[0]) / 4
    _, knee, width, _ = best_of(np.linspace(low, high, grid), np.linspace(0.0, widest, grid))
    dk, dw = (high - low) / (grid - 1), widest / (grid - 1)
    error, knee, width, (base, before, bend) = best_of(
        np.linspace(max(low, knee - dk), min(high, knee + dk), grid),
        np.linspace(max(0.0, width - dw), min(widest, width + dw), grid),
    )
    return StepCurve(float(base), float(before), float(before + bend), knee, width, math.sqrt(error / len(w)))


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


def size(
    t_of_b: dict[int, float],
    r_per_token: float | dict[int, float],
    seq_len: int,
    latency_target: float | None = None,
    round_trip: dict[int, dict[int, AskCost]] | None = None,
    n_layers: int = 0,
    cores: float = 0.0,
    s_per_token: dict[int, float] | None = None,
    time_shared: TimeShared | None = None,
    overlap: dict[int, Overlap] | None = None,
) -> Sizing:
    """Pick B from the measured T(B) curve, then P = B*S*R / (2*T(B)); with the ask costs measured per R-worker
    count ({P: {rows per ask: AskCost}}, see `step_costs`; a P not measured uses the largest measured one below
    it), the model's layer count and the cores the roles share, P is instead the fewest R-workers whose
    `predict_step` is within 5 % of the best, and the predicted step is the one reported. s_per_token: the
    S-worker's CPU per streamed KV entry, {P: seconds} like round_trip (default none).

    The pipelined options use round_trip, which should hold the pipelined steps' costs (`step_costs` with
    pipeline=True). With `time_shared` the same B and P are also priced time-shared (its T(B) on every core, its
    unpipelined ask costs), and the faster mode at the chosen P is the one reported (`Sizing.mode`). overlap:
    {P: `Overlap`} measured by `measure_overlap` (like round_trip; default none, a perfect overlap)."""
    if not t_of_b or any(b <= 0 or t <= 0 for b, t in t_of_b.items()):
        raise ValueError("t_of_b: need measured {batch: seconds} with positive values")
    r_curve = r_per_token
    if isinstance(r_curve, dict):  # {KV entries per R-worker: seconds}; the formula takes it at the mean load
        if not r_curve:
            raise ValueError("r_per_token: need {KV entries per R-worker: seconds}")
        r_per_token = min(r_curve.values())
    if r_per_token <= 0 or seq_len <= 0:
        raise ValueError(f"r_per_token and seq_len must be > 0, got {r_per_token}, {seq_len}")
    batches = sorted(t_of_b)
    lines = [
        "T(B), the S-part step time measured per batch size: "
        + ", ".join(f"T({b})={t_of_b[b] * 1e3:.2f} ms" for b in batches),
        f"R, attention time per context token on one R-worker: {r_per_token * 1e9:.2f} ns; S = {seq_len} tokens",
    ]
    if latency_target is not None:
        if latency_target <= 0:
            raise ValueError(f"latency_target must be > 0, got {latency_target}")
        fitting = [b for b in range(1, 2 * batches[-1] + 1) if interpolate(t_of_b, b) <= latency_target]
        if not fitting:
            raise ValueError(
                f"latency target {latency_target * 1e3:.1f} ms is below T(1) = "
                f"{interpolate(t_of_b, 1) * 1e3:.2f} ms: no batch meets it"
            )
        batch = fitting[-1]
        lines.append(
            f"B = {batch}: the largest batch whose S-part step T(B) stays within the "
            f"{latency_target * 1e3:.1f} ms target (the two-minibatch pipeline keeps the step at ~T(B))"
        )
    else:
        throughput = {b: b / t_of_b[b] for b in batches}
        best = max(throughput.values())
        batch = min(b for b in batches if throughput[b] >= THROUGHPUT_KNEE * best)
        lines.append(
            f"B = {batch}: the smallest measured batch reaching {THROUGHPUT_KNEE * 100:.0f} % of the best "
            f"S-part throughput ({best:.0f} sequences/s); larger batches add latency, not throughput"
        )
    t = interpolate(t_of_b, batch)
    if isinstance(r_curve, dict):
        r_per_token = per_entry(r_curve, batch * seq_len / 2)
    exact = batch * seq_len * r_per_token / (2 * t)
    workers = max(1, math.ceil(exact - 1e-9))
    lines.append(
        f"P = B*S*R / (2*T(B)) = {batch}*{seq_len}*{r_per_token:.3e} / (2*{t:.4f}) = {exact:.3g}: "
        f"a step's attention covers ~B*S/2 tokens (lengths spread over 0..S), which P R-workers finish in T(B)"
    )
    if round_trip is None:
        return Sizing(batch, t, r_per_token, seq_len, exact, workers, batch / t, lines)
    if n_layers <= 0 or cores <= 0:
        raise ValueError(f"with round_trip, need n_layers and cores > 0, got {n_layers}, {cores}")
    if not round_trip or min(round_trip) < 1:
        raise ValueError("round_trip: need {R-workers: {rows: AskCost}} for at least one R-worker count >= 1")
    for p in sorted(round_trip):
        lines.append(
            f"C(b), a step's cost per ask beyond S-part and attention (S-worker CPU + R-worker CPU + "
            f"wait), measured in real steps with {p} R-worker(s): "
            + ", ".join(
                f"C({b})={t.total * 1e3:.2f} ms ({t.s * 1e3:.2f} + {t.r * 1e3:.2f} + {t.wait * 1e3:.2f})"
                for b, t in sorted(round_trip[p].items())
            )
        )
    lines.append(
        f"{n_layers} layers x 2 mini-batches x P asks per step; {cores:.3g} cores shared by the S-worker "
        f"and the P R-workers (one thread each)"
    )

    def measured(p: int, by_workers: dict):
        return by_workers[max(m for m in by_workers if m <= p)]

    streamed = s_per_token or {1: 0.0}
    for p, o in sorted((overlap or {}).items()):
        lines.append(f"pipelined steps with {p} R-worker(s): {o.explain()}")
    losses = {p: o.loss for p, o in (overlap or {1: Overlap(0.0, 0, 0, 1, 0.0, 0.0, 0.0, 0.0)}).items()}
    counts = range(1, max(2 * workers, math.ceil(cores) + 2, 4) + 1)

    def priced(b: int) -> dict[str, dict[int, StepPrediction]]:
        """{mode: {P: predicted step}} at batch b, W = b*S/2."""
        modes = {
            "pipelined": {
                p: predict_step(
                    t_of_b,
                    r_curve,
                    measured(p, round_trip),
                    n_layers,
                    b,
                    b * seq_len / 2,
                    p,
                    b >= 2,
                    cores,
                    s_per_token=measured(p, streamed),
                    overlap=measured(p, losses),
                )
                for p in counts
            }
        }
        if time_shared is not None:
            modes["time-shared"] = {
                p: predict_step(
                    time_shared.t_of_b,
                    r_curve,
                    measured(p, time_shared.round_trip),
                    n_layers,
                    b,
                    b * seq_len / 2,
                    p,
                    False,
                    cores,
                    s_per_token=measured(p, streamed),
                )
                for p in counts
            }
        return modes

    def pick(modes: dict[str, dict[int, StepPrediction]]) -> tuple[int, str]:
        best = min(o.step for by_p in modes.values() for o in by_p.values())
        chosen = min(p for by_p in modes.values() for p, o in by_p.items() if o.step <= 1.05 * best)
        return chosen, min(modes, key=lambda m: modes[m][chosen].step)

    # B: with a latency target the largest within it (above); without, the measured batch with the most predicted
    # tokens/s (the smallest within 5 % of the best): the S-part's knee assumes enough R-workers on cores of their
    # own hide the R-part, while on shared cores the R-part and the asks decide where tokens/s peaks
    if latency_target is None:
        by_batch = {b: priced(b) for b in batches if b >= 2} or {batch: priced(batch)}
        rate = {b: b / m[pick(m)[1]][pick(m)[0]].step for b, m in by_batch.items()}
        top = max(rate.values())
        batch = min(b for b, x in rate.items() if x >= 0.95 * top)
        lines.append(
            "predicted tokens/s at the best P and mode per measured batch: "
            + ", ".join(f"B={b}: {x:.0f}" for b, x in sorted(rate.items()))
            + f" -> B = {batch}, the smallest within 5 % of the most"
        )
        t = interpolate(t_of_b, batch)
        r_per_token = per_entry(r_curve, batch * seq_len / 2) if isinstance(r_curve, dict) else r_per_token
        exact = batch * seq_len * r_per_token / (2 * t)
        modes = by_batch[batch]
    else:
        modes = priced(batch)
    chosen, mode = pick(modes)
    for name, by_p in modes.items():
        if len(modes) > 1:
            lines.append(f" {name}:")
        for p, o in by_p.items():
            lines.append(f"  P={p}: {o.explain()}")
    lines.append(
        f"P = {chosen}: the fewest R-workers within 5 % of the best predicted step; past it, more "
        f"R-workers add asks (communication) and processes competing for the {cores:.3g} cores, not speed"
        + (f"; {mode}, the faster mode there" if len(modes) > 1 else "")
    )
    step = modes[mode][chosen].step
    return Sizing(batch, t, r_per_token, seq_len, exact, chosen, batch / step, lines, predicted_step=step, mode=mode)


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


def effective_cores(cores: int, alone: list[float], together: list[list[float]]) -> float:
    """How many of `cores` a run gets right now, from paired rounds of a fixed single-threaded job: round i timed
    alone (`alone[i]`, seconds) and as `cores` copies at once (`together[i]`, each copy's own time). Per round
    cores * alone / mean(together), capped at `cores`; the median over rounds, so one disturbed round (the
    machine's speed drifts in phases of seconds) moves it less than a single reading (one ~3 s reading can
    read 1.49 while the rounds around it read ~2)."""
    if (
        cores <= 0
        or not alone
        or len(alone) != len(together)
        or any(len(t) != cores for t in together)
        or min(alone) <= 0
        or min(min(t) for t in together) <= 0
    ):
        raise ValueError(
            f"need cores > 0 and paired rounds of positive times ({cores} copies each), got {cores}, "
            f"{alone}, {together}"
        )
    return float(np.median([min(float(cores), cores * a / float(np.mean(t))) for a, t in zip(alone, together)]))
