"""SLOs, attainment, and goodput: the highest request rate at which the SLO attainment target holds.

Why a bracket-then-bisect search seeded by an analytic capacity estimate: each probe is a whole
simulation, so a good first guess (from the latency model alone) saves most of them. Attainment is
assumed to fall as the rate rises (true up to sampling noise, which the fixed workload sample limits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from aiollm.planner.simulator import SimConfig, SimResult, simulate
from aiollm.planner.workload import Workload


@dataclass(frozen=True)
class SLO:
    """Latency targets and the share of requests that must meet them.

    mode 'joint': a request counts only if it meets both TTFT and TPOT (DistServe's goodput);
    'separate': the TTFT and TPOT percentiles are checked on their own (DistServe's simulator script:
    P90 TTFT <= ttft and P90 TPOT <= tpot)."""

    ttft: float
    tpot: float
    attainment: float = 0.9
    mode: str = "joint"

    def __post_init__(self) -> None:
        if not (self.ttft > 0 and self.tpot > 0):
            raise ValueError(f"SLO.ttft and SLO.tpot must be > 0 seconds, got {self.ttft}, {self.tpot}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"SLO.attainment must be in (0, 1], got {self.attainment}")
        if self.mode not in ("joint", "separate"):
            raise ValueError(f"SLO.mode must be 'joint' or 'separate', got {self.mode!r}")

    def met_by(self, result: SimResult, phase: str = "both") -> bool:
        """Whether `result` attains the SLO; `phase` 'prefill' or 'decode' checks only TTFT or TPOT."""
        share = result.attainment(self.ttft, self.tpot)
        if phase == "prefill":
            return share["ttft"] >= self.attainment
        if phase == "decode":
            return share["tpot"] >= self.attainment
        if self.mode == "joint":
            return share["both"] >= self.attainment
        return share["ttft"] >= self.attainment and share["tpot"] >= self.attainment


# A probe's arrivals must span at least this many SLO-bound request lifetimes (TTFT + TPOT * mean output);
# with fewer, a short burst fits in memory and an overloaded configuration looks fine.
SPAN_LIFETIMES = 3.0
# ...but a probe never simulates more than this many times the workload sample.
MAX_GROWTH = 10


class InfeasibleSLO(ValueError):
    """No rate attains the SLO: even a lone request misses it on this configuration."""


def capacity_estimate(config: SimConfig, workload: Workload, slo: SLO) -> float:
    """Rough requests/s the instances sustain, from the latency model alone (the search's first guess)."""
    lat = config.latency
    prompt = workload.prompt.astype(np.float64)
    output = workload.output.astype(np.float64)
    spec = config.decode if config.mode == "colocated" else config.prefill
    stack = lat.stack(spec.tp)
    l_m = config.max_batch_tokens or lat.compute_bound_length(spec.tp)
    per_batch = max(1.0, l_m / prompt.mean())
    a, b, c = stack.prefill
    prefill_s = a / per_batch + b * prompt.mean() + c * (prompt**2).mean()
    prefill_rate = config.n_prefill * spec.pp / prefill_s
    dstack = lat.stack(config.decode.tp)
    lanes = config.n_decode * config.decode.pp
    per_lane_kv = config.decode_kv_tokens / config.decode.pp
    mean_len = prompt.mean() + output.mean()
    batch = max(1.0, per_lane_kv / mean_len)
    d, e, f = dstack.decode_coeffs(int(batch))
    ctx_per_seq = prompt.mean() + output.mean() / 2
    if d + (e + f * ctx_per_seq) * batch > slo.tpot and e + f * ctx_per_seq > 0:
        batch = max(1.0, (slo.tpot - d) / (e + f * ctx_per_seq))
    step = d + (e + f * ctx_per_seq) * batch
    decode_rate = lanes * batch / (step * max(output.mean() - 1, 1.0))
    if config.mode == "prefill-only":
        return prefill_rate
    if config.mode == "decode-only":
        return decode_rate
    if config.mode == "colocated":
        return 1.0 / (1.0 / prefill_rate + 1.0 / decode_rate)
    return min(prefill_rate, decode_rate)


def probe_workload(workload: Workload, slo: SLO, rate: float, phase: str = "both") -> Workload:
    """`workload`, lengthened so that its arrivals at `rate` span SPAN_LIFETIMES request lifetimes
    (for the prefill phase alone a request lives about its TTFT)."""
    lifetime = slo.ttft if phase == "prefill" else slo.ttft + slo.tpot * float(workload.output.mean())
    return workload.longer(min(MAX_GROWTH * len(workload), math.ceil(rate * SPAN_LIFETIMES * lifetime)))


def goodput(
    config: SimConfig,
    workload: Workload,
    slo: SLO,
    phase: str = "both",
    rel_tol: float = 0.03,
    hint: float | None = None,
) -> float:
    """Highest rate (req/s) whose simulation meets `slo` (to within rel_tol); 0.0 if none does."""

    def ok(rate: float) -> bool:
        return slo.met_by(simulate(config, probe_workload(workload, slo, rate, phase), rate), phase)

    guess = hint or capacity_estimate(config, workload, slo)
    if not math.isfinite(guess) or guess <= 0:
        guess = 1.0
    lo, hi = guess, guess
    if ok(guess):
        while True:
            hi = lo * 1.5
            if not ok(hi):
                break
            lo = hi
            if lo > guess * 1e4:
                return lo
    else:
        floor = guess * 1e-3
        while True:
            lo = hi / 1.5
            if lo < floor:
                return 0.0 if not ok(floor) else _bisect(ok, floor, hi, rel_tol)
            if ok(lo):
                break
            hi = lo
    return _bisect(ok, lo, hi, rel_tol)


def _bisect(ok, lo: float, hi: float, rel_tol: float) -> float:
    while hi / lo - 1 > rel_tol:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def goodput_task(args: tuple) -> float:
    """`goodput(*args)`, as a top-level function a process pool can run."""
    return goodput(*args)
