"""The analytic latency model of DistServe's appendix A, its least-squares fit, and TP/PP scaling.

Why this shape: a prefill iteration's cost is GEMMs linear in the batch's total tokens t plus causal
attention quadratic in each prompt's length (the sum of squares t2), on top of a fixed cost of
streaming the weights once:  T_prefill = a + b*t + c*t2.  A decode step streams the weights (d),
does GEMM work per sequence (e*B), and reads every sequence's KV cache (f*C for C context tokens in
the batch):  T_decode = d + e*B + f*C.  Both are for the whole layer stack on `tp` GPUs; a pipeline of
`pp` stages runs each stage in T/pp (stages are balanced) and keeps pp batches in flight.

Tensor parallelism is not free: each coefficient scales as coef(tp) = coef(1) * (s + (1-s)/tp), an
Amdahl form whose serial fraction s (all-reduce, launch overhead, smaller GEMMs) is fitted by least
squares from DistServe's multi-TP A100 profiles (`fit_tp_scaling`) and used wherever a profile lacks
a TP degree (all derived profiles, the CPU profile).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

COEFF_NAMES = ("a", "b", "c", "d", "e", "f")

# Serial fractions per coefficient (a, b, c, d, e, f), fitted by `fit_tp_scaling` on DistServe's
# A100-80G profile (OPT-13B TP 1/2/4, OPT-66B TP 2/3/4/8); tests/unit/test_planner_latency.py
# re-fits them from the data and checks these numbers.
DEFAULT_TP_SERIAL = (0.42, 0.12, 0.0, 0.25, 0.47, 0.0)


@dataclass(frozen=True)
class StackLatency:
    """Coefficients (seconds) of one model's whole layer stack on one TP group."""

    # Prefill: a + b * total_tokens + c * sum(len^2).
    prefill: tuple[float, float, float]
    # Decode: d + e * batch + f * context_tokens.
    decode: tuple[float, float, float]
    # DistServe's profiles switch to other decode coefficients from this batch size on (0 = never).
    decode_large: tuple[float, float, float] | None = None
    large_batch_threshold: int = 0
    # Piecewise-linear tables (see `piecewise`) that replace (a, b) resp. (d, e) where one line fits the
    # measurements poorly, as on a CPU, whose small decode batches and short prompts share no one slope.
    # x is the batch's total prompt tokens (prefill) or its size (decode); c and f stay as fitted.
    prefill_table: tuple[tuple[float, float, float], ...] = ()
    decode_table: tuple[tuple[float, float, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if len(getattr(self, name)) != 3:
                raise ValueError(f"StackLatency.{name} needs 3 coefficients")
        if any(x < 0 for x in self.prefill) or any(x < 0 for x in self.decode):
            raise ValueError(f"StackLatency coefficients must be >= 0: {self.prefill} {self.decode}")

    def prefill_time(self, total_tokens: float, sum_sq: float) -> float:
        a, b, c = self.prefill
        if self.prefill_table:
            a, b = _segment(self.prefill_table, total_tokens)
        return a + b * total_tokens + c * sum_sq

    def decode_coeffs(self, batch: int) -> tuple[float, float, float]:
        if self.decode_table:
            return (*_segment(self.decode_table, batch), self.decode[2])
        if self.decode_large is not None and batch >= self.large_batch_threshold:
            return self.decode_large
        return self.decode

    def decode_time(self, batch: int, context_tokens: float) -> float:
        d, e, f = self.decode_coeffs(batch)
        return d + e * batch + f * context_tokens

    def scaled(self, factors: tuple[float, ...]) -> StackLatency:
        """Every coefficient multiplied by its factor (a, b, c, d, e, f)."""
        pre = tuple(x * k for x, k in zip(self.prefill, factors[:3]))
        dec = tuple(x * k for x, k in zip(self.decode, factors[3:]))
        large = tuple(x * k for x, k in zip(self.decode_large, factors[3:])) if self.decode_large else None
        pre_table = tuple((x, i * factors[0], s * factors[1]) for x, i, s in self.prefill_table)
        dec_table = tuple((x, i * factors[3], s * factors[4]) for x, i, s in self.decode_table)
        return StackLatency(pre, dec, large, self.large_batch_threshold, pre_table, dec_table)


def _segment(table: tuple[tuple[float, float, float], ...], x: float) -> tuple[float, float]:
    """(intercept, slope) of the table's row for x: the last row starting at or below x (the first below it)."""
    row = table[0]
    for candidate in table:
        if candidate[0] > x:
            break
        row = candidate
    return row[1], row[2]


def piecewise(xs, ys) -> tuple[tuple[float, float, float], ...]:
    """Rows (from_x, intercept, slope) of the line through consecutive measured (x, y) points, y averaged
    over equal x and made non-decreasing (more work never takes less time; a dip is measurement noise).
    The first row also covers x below the first point, the last extends beyond the last point."""
    points: dict[float, list[float]] = {}
    for x, y in zip(xs, ys):
        points.setdefault(float(x), []).append(float(y))
    if len(points) < 2:
        raise ValueError(f"piecewise needs >= 2 distinct x, got {sorted(points)}")
    x = np.array(sorted(points))
    y = np.maximum.accumulate([float(np.mean(points[k])) for k in x])
    slopes = np.diff(y) / np.diff(x)
    return tuple((float(x[i]), float(y[i] - slopes[i] * x[i]), float(slopes[i])) for i in range(len(slopes)))


def amdahl(tp: int, serial: float) -> float:
    """Time at `tp` relative to tp=1 when a fraction `serial` does not parallelise."""
    return serial + (1.0 - serial) / tp


@dataclass(frozen=True)
class LatencyModel:
    """A model's latency on one kind of hardware: measured coefficients per TP degree, Amdahl scaling
    for the others. `source` says where the numbers came from (shown in every plan)."""

    model: str
    hardware: str
    source: str
    by_tp: dict[int, StackLatency]
    tp_serial: tuple[float, ...] = DEFAULT_TP_SERIAL
    # KV tokens that fit per (tp, pp), when the profile states them (DistServe's max_num_tokens.csv).
    kv_capacity: dict[tuple[int, int], int] = field(default_factory=dict)
    # the profiled model's weights in the profiled dtype and its KV per token in the profiled KV dtype, in bytes,
    # when the profile states them (a local profile does); 0: unknown
    weights_bytes: int = 0
    kv_bytes_per_token: float = 0.0

    def __post_init__(self) -> None:
        if not self.by_tp:
            raise ValueError(f"LatencyModel {self.model}/{self.hardware}: no coefficients")
        if len(self.tp_serial) != 6 or not all(0.0 <= s <= 1.0 for s in self.tp_serial):
            raise ValueError(f"LatencyModel.tp_serial must be 6 fractions in [0, 1], got {self.tp_serial}")

    def stack(self, tp: int) -> StackLatency:
        """Coefficients at `tp`: measured if the profile has them, else scaled from the nearest measured TP."""
        if tp <= 0:
            raise ValueError(f"tp must be > 0, got {tp}")
        if tp in self.by_tp:
            return self.by_tp[tp]
        base = min(self.by_tp, key=lambda t: (abs(np.log(t / tp)), t))
        factors = tuple(amdahl(tp, s) / amdahl(base, s) for s in self.tp_serial)
        return self.by_tp[base].scaled(factors)

    def prefill_time(self, lengths, tp: int = 1) -> float:
        """Whole-stack prefill time of one batch of prompts (seconds)."""
        arr = np.asarray(lengths, dtype=np.float64)
        return self.stack(tp).prefill_time(arr.sum(), (arr * arr).sum())

    def decode_time(self, batch: int, context_tokens: float, tp: int = 1) -> float:
        """Whole-stack time of one decode step (seconds)."""
        return self.stack(tp).decode_time(batch, context_tokens)

    def compute_bound_length(self, tp: int = 1, share: float = 0.9) -> int:
        """L_m: the batch token count at which prefill reaches `share` of its asymptotic throughput
        1/b (t/(a+b*t) = share/b, so t = share*a / ((1-share)*b)); beyond it batching only adds latency."""
        a, b, _ = self.stack(tp).prefill
        if b <= 0:
            raise ValueError(f"{self.model}: prefill b coefficient is 0, L_m undefined")
        return max(1, int(share * a / ((1.0 - share) * b)))


def nonneg_lstsq(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0, by trying each subset of active columns (3 columns:
    8 small solves). A negative fitted cost would be nonsense and could make a simulated step negative."""
    best, best_err = None, np.inf
    cols = features.shape[1]
    for k in range(cols, 0, -1):
        for subset in itertools.combinations(range(cols), k):
            sol, *_ = np.linalg.lstsq(features[:, subset], target, rcond=None)
            if (sol < 0).any():
                continue
            err = float(np.sum((features[:, subset] @ sol - target) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(cols)
                best[list(subset)] = sol
    if best is None:
        raise ValueError("no non-negative fit exists for these points")
    return best


def fit_prefill(total_tokens, sum_sq, times) -> tuple[float, float, float]:
    """Fit (a, b, c) of T = a + b*t + c*t2 to measured prefill iterations."""
    return _fit_two_terms("fit_prefill", total_tokens, sum_sq, times)


def fit_decode(batch, context_tokens, times) -> tuple[float, float, float]:
    """Fit (d, e, f) of T = d + e*B + f*C to measured decode steps."""
    return _fit_two_terms("fit_decode", batch, context_tokens, times)


def _fit_two_terms(name: str, x1, x2, times) -> tuple[float, float, float]:
    """(k, k1, k2) of T = k + k1*x1 + k2*x2 fitted to the measured times (`_relative_fit`)."""
    x1 = np.asarray(x1, dtype=np.float64)
    x2 = np.asarray(x2, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if not (len(x1) == len(x2) == len(y)) or len(y) < 3:
        raise ValueError(f"{name} needs >= 3 matching points, got {len(x1)}, {len(x2)}, {len(y)}")
    return _relative_fit(np.column_stack([np.ones_like(x1), x1, x2]), y)


def _relative_fit(features: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Non-negative least squares on relative errors (rows divided by the measured time): step times span
    orders of magnitude, and a 10 ms step off by 10 ms matters more than a 2 s one off by 10 ms. Columns are
    scaled so the solver sees comparable magnitudes (t2 reaches 1e7)."""
    if (y <= 0).any():
        raise ValueError("measured times must be > 0")
    scale = np.maximum(features.max(axis=0), 1.0)
    sol = nonneg_lstsq(features / scale / y[:, None], np.ones_like(y)) / scale
    return tuple(float(x) for x in sol)


def fit_tp_scaling(models: list[LatencyModel]) -> tuple[float, ...]:
    """Serial fraction s per coefficient minimising the squared log error of
    coef(tp)/coef(tp0) = amdahl(tp, s)/amdahl(tp0, s) over every model and TP pair (grid search on s)."""
    grid = np.linspace(0.0, 1.0, 1001)
    fractions = []
    for index in range(6):
        err = np.zeros_like(grid)
        used = 0
        for model in models:
            tps = sorted(model.by_tp)
            base = tps[0]
            for tp in tps[1:]:
                c0 = _coeff(model.by_tp[base], index)
                c1 = _coeff(model.by_tp[tp], index)
                if c0 <= 0 or c1 <= 0:
                    continue
                predicted = (grid + (1 - grid) / tp) / (grid + (1 - grid) / base)
                err += (np.log(predicted) - np.log(c1 / c0)) ** 2
                used += 1
        fractions.append(float(grid[np.argmin(err)]) if used else DEFAULT_TP_SERIAL[index])
    return tuple(fractions)


def _coeff(stack: StackLatency, index: int) -> float:
    return (stack.prefill + stack.decode)[index]
