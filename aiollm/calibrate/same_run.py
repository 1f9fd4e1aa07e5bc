"""The same-run latency model of the simulator-vs-real check: what one pass of a `bench serve` run logged
(aiollm.loadgen.step_logs) turned into the simulator's inputs — step times, KV pull, request hops, and which token
of each request its client saw first.

Why from the same pass: the instances share two cores with each other, the controller, the frontend and
the client, so how long a step takes depends on the load of that very run; a profile measured alone misses
it. The model is fitted to the pass's own step times; the request-level inputs (hops, first visible token)
are measured per request, and the hops are dealt to the simulated requests in shuffled orders, so the
simulator does not replay the real requests' own delays.
"""

from __future__ import annotations

import numpy as np

from aiollm.planner.latency import (
    LatencyModel,
    StackLatency,
    fit_decode,
    nonneg_lstsq,
    piecewise,
)

# seconds per period of the measured slowdown series (~9 decode steps each at ~18 steps/s)
SLOWDOWN_PERIOD = 0.5


def same_run_model(
    steps: dict, seed: int = 0, visible: list[int] | None = None, varying: bool = True
) -> tuple[LatencyModel, dict]:
    """The latency model and overheads of one pass from what its instances logged (aiollm.loadgen.step_logs):
    prefill a + b*t + c*t2 by least squares on the batches' times (absolute: the queue sees the sum of
    busy times); decode f*context from a fit, then the mean step (with its tokens' sending) per batch size
    as a table; KV pull set-up + seconds per prompt token; the request hops measured over the requests the
    controller did not hold back (see `hops`), dealt to the simulated requests in an order shuffled by
    `seed`: the way in delays a request's arrival at the controller, the way out its first visible token.
    `visible`: each request's first visible token (see `visible_steps`; None: all the prefill's), then only
    the requests that saw the prefill's token give way-out times (the others' include decode steps).
    `varying`: the machine's measured slow and fast spells (see `slowdowns`), started at a point of the
    series chosen by `seed`; else every step takes the model's average time."""
    prefill = np.array(steps["prefill"], dtype=np.float64)
    if len(prefill) < 3 or len(steps["decode"]) < 3:
        raise ValueError("fewer than 3 prefill batches or decode steps logged")
    scale = np.maximum(prefill[:, :2].max(axis=0), 1.0)
    features = np.column_stack([np.ones(len(prefill)), prefill[:, 0] / scale[0], prefill[:, 1] / scale[1]])
    a, b, c = nonneg_lstsq(features, prefill[:, 2]) / np.array([1.0, *scale])
    decode = np.array(steps["decode"], dtype=np.float64)
    d, e, f = fit_decode(decode[:, 0], decode[:, 1], decode[:, 2])
    base = decode[:, 2] - f * decode[:, 1]
    table_ = piecewise(decode[:, 0], base) if len(set(decode[:, 0])) >= 2 else ()
    stack = StackLatency((float(a), float(b), float(c)), (d, e, f), decode_table=table_)
    latency = LatencyModel("smollm2", "this machine, same run", "same-run steps", {1: stack})
    pulls = np.array(steps["pull"], dtype=np.float64).reshape(-1, 2)
    slope, setup = np.polyfit(pulls[:, 0], pulls[:, 1], 1) if len(pulls) >= 3 else (0.0, 0.0)
    if slope < 0 or setup < 0:
        slope, setup = 0.0, float(np.median(pulls[:, 1])) if len(pulls) else 0.0
    way_in, way_out, offset = hops(steps)
    if visible is not None:
        way_out = way_out[np.array([k == 0 for k in visible])[_used(steps)]]
    rng = np.random.default_rng(seed)  # fixed shuffled orders: not paired with the requests measured on
    overheads = {
        "request_overhead_s": float(np.median(way_in)) if len(way_in) else 0.0,
        "request_overheads_s": [float(x) for x in rng.permutation(way_in)],
        "first_token_delays_s": [float(x) for x in rng.permutation(way_out)],
        "pull_overhead_s": float(setup),
        "pull_s_per_prompt_token": float(slope),
        "matched_requests": len(way_in),
        "clock_offset_s": offset,
    }
    if visible is not None:
        overheads["first_visible_steps"] = [int(k) for k in visible]
    if varying and "decode_at" in steps and "prefill_at" in steps:
        prefill_s, decode_s = slowdowns(steps, stack)
        shift = int(rng.integers(len(decode_s)))  # the same point in both series: they are correlated
        overheads.update(
            {
                "prefill_slowdown": list(np.roll(prefill_s, -shift)),
                "decode_slowdown": list(np.roll(decode_s, -shift)),
                "slowdown_period": SLOWDOWN_PERIOD,
            }
        )
    return latency, overheads


def slowdowns(steps: dict, stack: StackLatency, period: float = SLOWDOWN_PERIOD) -> tuple[np.ndarray, np.ndarray]:
    """Per `period` of the pass, how much slower than `stack` its prefill batches and decode steps ran (mean
    ratio of measured to modelled time of those that started in it; periods with none interpolated).

    Why: on two shared cores the step times wander in spells of about a second (a decode step's excess over
    its batch size's mean keeps ~0.8 of itself from one step to the next, and prefill and decode slow down
    together), so a request's TPOT averages correlated steps, and its spread, which decides attainment near
    an SLO, is several times what independent steps would give. The simulator replays such a series, from a
    random point, so it gets the spread and the correlation but not the timing."""
    decode = np.array(steps["decode"], dtype=np.float64).reshape(-1, 3)
    decode_at = np.array(steps["decode_at"], dtype=np.float64).reshape(-1, 2)
    prefill = np.array(steps["prefill"], dtype=np.float64).reshape(-1, 3)
    prefill_at = np.array(steps["prefill_at"], dtype=np.float64).reshape(-1, 2)
    end = max(decode_at[:, 1].max(initial=0.0), prefill_at[:, 1].max(initial=0.0))
    bins = max(1, int(np.ceil(end / period)))
    decode_model = np.array([stack.decode_time(int(b), c) for b, c in decode[:, :2]])
    prefill_model = np.array([stack.prefill_time(t, t2) for t, t2 in prefill[:, :2]])
    return (
        _binned(prefill_at[:, 0], prefill[:, 2] / prefill_model, period, bins),
        _binned(decode_at[:, 0], decode[:, 2] / decode_model, period, bins),
    )


def _binned(times: np.ndarray, ratios: np.ndarray, period: float, bins: int) -> np.ndarray:
    """Mean ratio per period; empty periods interpolated between their neighbours (1 with no data at all)."""
    index = np.clip((times // period).astype(int), 0, bins - 1)
    sums, counts = np.bincount(index, ratios, bins), np.bincount(index, minlength=bins)
    full = counts > 0
    if not full.any():
        return np.ones(bins)
    centres = np.arange(bins)
    return np.interp(centres, centres[full], sums[full] / counts[full])


def _used(steps: dict) -> np.ndarray:
    """Which requests' hops count: matched to a prefill record and not held back by the controller (their
    way in includes its queueing, which the simulator models itself)."""
    held = steps.get("held", [False] * len(steps["hop_in"]))
    return np.array(
        [i is not None and o is not None and not h for i, o, h in zip(steps["hop_in"], steps["hop_out"], held)],
        dtype=bool,
    )


def hops(steps: dict) -> tuple[np.ndarray, np.ndarray, float]:
    """(way in, way out, clock offset) of the requests `_used` selects, in request order.

    Why an offset: bench serve takes a request's send time as its scheduled arrival after a wall-clock
    reading taken just before the client starts, so every way in is measured long and every way out short
    by the same few tens of ms (their sum is exact). The offset is the middle of the range that makes both
    fastest hops >= 0 (a few ms wide on real runs: the fastest way in and way out are both ~1 ms); a run
    whose hops need no shift keeps offset 0."""
    used = _used(steps)
    pairs = np.array(
        [(i, o) for (i, o), u in zip(zip(steps["hop_in"], steps["hop_out"]), used) if u], dtype=np.float64
    ).reshape(-1, 2)
    if not len(pairs):
        return np.zeros(0), np.zeros(0), 0.0
    low, high = -pairs[:, 1].min(), pairs[:, 0].min()  # offsets keeping way out resp. way in >= 0
    offset = 0.0 if low <= 0 <= high else (low + high) / 2
    return np.maximum(pairs[:, 0] - offset, 0.0), np.maximum(pairs[:, 1] + offset, 0.0), float(offset)


def visible_steps(run_: dict) -> list[int | None] | None:
    """Per request, which token its client saw first: 0 = the prefill's, k = the k-th decode step's (counted
    as the decode steps that started after its KV pull ended and ended before its first text arrived);
    None where the request was not matched; None for a run logged without step times (`decode_at`)."""
    steps = run_["steps"]
    if "decode_at" not in steps:
        return None
    _, _, offset = hops(steps)
    decode = np.array(steps["decode_at"], dtype=np.float64).reshape(-1, 2)
    pulls = np.array(steps["pull_at"], dtype=np.float64).reshape(-1, 3)
    out: list[int | None] = []
    for arrival, ttft, hop_out, prompt in zip(run_["arrivals"], run_["ttft"], steps["hop_out"], run_["prompt_lens"]):
        if ttft is None or hop_out is None:
            out.append(None)
            continue
        prefilled = arrival + ttft - hop_out  # the end of its prefill batch, on the sends' clock
        seen = arrival + ttft + offset  # its first text at the client, on the instances' clock
        mine = pulls[(pulls[:, 2] == prompt) & (pulls[:, 0] >= prefilled - 1e-3)]
        joined = mine[np.argmin(mine[:, 0]), 1] if len(mine) else prefilled
        out.append(int(np.sum((decode[:, 0] >= joined - 5e-4) & (decode[:, 1] <= seen))))
    return out


def consensus(values: list[list[int | None]], skip: int) -> list[int]:
    """Each request's first visible token by the median over the other passes of the same trace (leave one
    out: a pass is never simulated with what its own timings said); the pass's own where no other has one."""
    out = []
    for i in range(len(values[skip])):
        others = [v[i] for j, v in enumerate(values) if j != skip and v[i] is not None]
        own = values[skip][i]
        out.append(int(np.median(others)) if others else (own or 0))
    return out
