"""The planner bench's simulator-vs-real check: the simulator replays a real `bench serve` run (its exact
requests, lengths and arrival times; 1 prefill + 1 decode instance as served) and its SLO attainment is
compared with the measured one, rate by rate.

Two latency models are compared. "same-run steps" (the headline when the run was made with
`--step-log`): each rate's simulation uses the prefill batch, decode step and KV pull times the
instances logged while that rate was served, so the slowdown of instances sharing the cores (with each
other, the controller, the frontend, the client and anything else on the machine) is in the model, and
the request hop (client -> prefill instance, prefill -> client's first token) measured per request in
the same run. "offline profile": the local profile of `python -m aiollm.plan profile` (measured alone)
plus fixed overheads from an idle calibration run, as before.

Noise: the simulator replays the same trace, so the workload's sampling noise is shared; what remains
is per-request disagreement. The paired standard error of (sim - real) attainment over n requests,
sqrt(b + c - (b - c)^2 / n) / n with b, c the requests only one side counts as meeting the SLOs
(McNemar), is printed beside each difference, with the unpaired binomial s.e. of the attainment itself.
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from aiollm.planner.latency import LatencyModel, StackLatency, fit_decode, nonneg_lstsq, piecewise
from aiollm.planner.models import get_model
from aiollm.planner.profiles import load_local
from aiollm.planner.simulator import InstanceSpec, SimConfig, SimResult, simulate
from aiollm.planner.workload import LengthSample, Workload
from bench.report import table

# shuffles of the measured request hops averaged by the same-run model
_SHUFFLES = 16

def read_serve_results(path: Path) -> dict | None:
    """A real serving run to compare with, or None if the file does not exist.

    The file this reads (written by `python -m bench serve --json PATH`, issue 7) is JSON with
      "model": "smollm2", "ttft_slo": seconds, "tpot_slo": seconds, "kv_tokens": decode KV capacity,
      optional "max_running" (default 128) and "max_batch_tokens" (default: L_m of the local profile),
      "runs": [{"setup": "disaggregated", "rate": req/s, "attainment": share in [0, 1] meeting both SLOs,
                "prompt_lens": [...], "output_lens": [...], "arrivals": [seconds from start, ...],
                optional "ttft": [...], "tpot": [...] per request in seconds (null: failed)}, ...]
    and the latency profile measured on the same machine by `python -m aiollm.plan profile`.
    """
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if "runs" not in data:
        raise ValueError(f"{path}: no 'runs' list (expected the format in bench/planner.py:read_serve_results)")
    return data


def deployment_overheads(path: Path, latency: LatencyModel) -> dict:
    """The real system's fixed per-request costs beyond the profiled compute, from an idle `bench serve` run
    (requests seldom overlap, so each sees a lone prefill and a decode batch of 1): TTFT minus the profile's
    prefill time (HTTP, tokenisation, controller hop, first token back), and the first-to-last token time
    minus the profile's decode steps (KV pull over loopback TCP and its set-up, token delivery), the latter
    fitted as set-up + seconds per prompt token. Medians and a least-squares line, robust to one overlap."""
    data = read_serve_results(path)
    if data is None:
        raise FileNotFoundError(f"no {path}")
    ttft_extra, prompts, pull_extra = [], [], []
    for run_ in data["runs"]:
        if run_["setup"] != "disaggregated" or "ttft" not in run_:
            continue
        for p, out, ttft, tpot in zip(run_["prompt_lens"], run_["output_lens"], run_["ttft"], run_["tpot"]):
            if ttft is None:
                continue
            ttft_extra.append(ttft - latency.prefill_time([p]))
            if out > 1:
                steps = sum(latency.decode_time(1, p + 1 + k) for k in range(out - 1))
                prompts.append(p)
                pull_extra.append(tpot * (out - 1) - steps)
    if len(pull_extra) < 3:
        raise ValueError(f"{path}: fewer than 3 served requests with per-request times")
    slope, setup = np.polyfit(prompts, pull_extra, 1)
    if slope < 0 or setup < 0:
        slope, setup = 0.0, float(np.median(pull_extra))
    return {"request_overhead_s": max(0.0, float(np.median(ttft_extra))), "pull_overhead_s": max(0.0, float(setup)),
            "pull_s_per_prompt_token": float(slope), "calibration_requests": len(pull_extra)}


def _simulate_run(data: dict, run_: dict, latency: LatencyModel, overheads: dict) -> tuple[float, SimResult]:
    """Simulated attainment of one real run: its own requests at its own arrival times, one prefill and one
    decode instance with the run's KV, L_m and batch limits."""
    lengths = LengthSample("served", np.array(run_["prompt_lens"]), np.array(run_["output_lens"]))
    workload = Workload(lengths, np.array(run_["arrivals"]) * run_["rate"])
    per_token = overheads.get("pull_s_per_prompt_token", 0.0)
    cfg = SimConfig(latency, "disaggregated", InstanceSpec(1), InstanceSpec(1), data["kv_tokens"],
                    data["kv_tokens"], 1, link_bandwidth=1.0 / per_token if per_token > 0 else math.inf,
                    max_batch_tokens=data.get("max_batch_tokens", 0), max_running=data.get("max_running", 128),
                    request_overhead=overheads.get("request_overhead_s", 0.0),
                    request_overheads=tuple(overheads.get("request_overheads_s", ())),
                    pull_overhead=overheads.get("pull_overhead_s", 0.0))
    result = simulate(cfg, workload, run_["rate"])
    return result.attainment(data["ttft_slo"], data["tpot_slo"])["both"], result


def same_run_model(steps: dict, seed: int = 0) -> tuple[LatencyModel, dict]:
    """The latency model and overheads of one rate from what its instances logged (bench.serve_steps):
    prefill a + b*t + c*t2 by least squares on the batches' times (absolute: the queue sees the sum of
    busy times); decode f*context from a fit, then the mean step (with its tokens' sending) per batch size
    as a table; KV pull set-up + seconds per prompt token; the request hop (way in + way out) as the spread
    measured over the requests the controller did not hold back, dealt to the simulated requests in an
    order shuffled by `seed`."""
    prefill = np.array(steps["prefill"], dtype=np.float64)
    if len(prefill) < 3 or len(steps["decode"]) < 3:
        raise ValueError("fewer than 3 prefill batches or decode steps logged")
    scale = np.maximum(prefill[:, :2].max(axis=0), 1.0)
    features = np.column_stack([np.ones(len(prefill)), prefill[:, 0] / scale[0], prefill[:, 1] / scale[1]])
    a, b, c = nonneg_lstsq(features, prefill[:, 2]) / np.array([1.0, *scale])
    decode = np.array(steps["decode"], dtype=np.float64)
    d, e, f = fit_decode(decode[:, 0], decode[:, 1], decode[:, 2])
    base = decode[:, 2] - f * decode[:, 1]
    table = piecewise(decode[:, 0], base) if len(set(decode[:, 0])) >= 2 else ()
    stack = StackLatency((float(a), float(b), float(c)), (d, e, f), decode_table=table)
    latency = LatencyModel("smollm2", "this machine, same run", "same-run steps", {1: stack})
    pulls = np.array(steps["pull"], dtype=np.float64).reshape(-1, 2)
    slope, setup = np.polyfit(pulls[:, 0], pulls[:, 1], 1) if len(pulls) >= 3 else (0.0, 0.0)
    if slope < 0 or setup < 0:
        slope, setup = 0.0, float(np.median(pulls[:, 1])) if len(pulls) else 0.0
    held = steps.get("held", [False] * len(steps["hop_in"]))
    hops = [i + o for i, o, h in zip(steps["hop_in"], steps["hop_out"], held) if i is not None and o is not None and not h]
    # the measured spread, in a fixed shuffled order (not paired with the requests they were measured on)
    spread = np.random.default_rng(seed).permutation(np.maximum(hops, 0.0)) if hops else np.zeros(0)
    overheads = {"request_overhead_s": float(np.median(spread)) if hops else 0.0,
                 "request_overheads_s": [float(x) for x in spread],
                 "pull_overhead_s": float(setup), "pull_s_per_prompt_token": float(slope),
                 "matched_requests": len(hops)}
    return latency, overheads


def _meets(ttft, tpot, ttft_slo: float, tpot_slo: float) -> np.ndarray:
    t = np.array([np.inf if x is None else x for x in ttft], dtype=np.float64)
    p = np.array([np.inf if x is None else x for x in tpot], dtype=np.float64)
    return (t <= ttft_slo) & (p <= tpot_slo)


def paired_noise(sim_ok: np.ndarray, real_ok: np.ndarray) -> dict:
    """Per-request agreement over the same requests (`sim_ok`: pass probabilities in [0, 1], `real_ok`: pass/fail)
    and the standard errors (points) of the attainment difference (paired: the s.d. of the per-request
    differences over sqrt(n), McNemar's for 0/1) and of one attainment alone (binomial)."""
    n = len(real_ok)
    d = np.asarray(sim_ok, dtype=np.float64) - np.asarray(real_ok, dtype=np.float64)
    paired = math.sqrt(max(0.0, float(np.mean(d * d) - np.mean(d) ** 2)) / n) * 100
    p = float(np.mean(real_ok))
    return {"disagree": round(float(np.sum(np.abs(d))), 1), "paired_se_points": paired,
            "binomial_se_points": math.sqrt(p * (1 - p) / n) * 100}


def _linear_only(latency: LatencyModel) -> LatencyModel:
    """The same profile with its piecewise tables dropped: the DistServe linear form alone."""
    by_tp = {tp: replace(s, prefill_table=(), decode_table=()) for tp, s in latency.by_tp.items()}
    return replace(latency, by_tp=by_tp, source=latency.source.replace("measured points interpolated", "linear fit"))


def _p90_ms(values) -> float:
    finite = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.percentile(finite, 90)) * 1e3 if finite else float("nan")


def _variants(data: dict, calibration: Path) -> tuple[dict, str]:
    """The latency models to compare, by name: {name: (run -> (LatencyModel, overheads))}."""
    variants, notes = {}, []
    try:
        offline = load_local()[get_model(data["model"]).name]
    except (FileNotFoundError, ValueError, KeyError) as exc:
        notes.append(f"no offline profile ({exc})")
    else:
        try:
            fixed = deployment_overheads(calibration, offline)
            notes.append(f"offline: {offline.source}, request {fixed['request_overhead_s']*1e3:.0f} ms from {calibration}")
        except (FileNotFoundError, ValueError, KeyError) as exc:
            fixed = {}
            notes.append(f"offline: no fixed overheads modelled ({exc})")
        variants["offline linear, no overheads"] = lambda run_: (_linear_only(offline), {})
        variants["offline profile + overheads"] = lambda run_: (offline, fixed)
    if all("steps" in r for r in data["runs"] if r["setup"] == "disaggregated"):
        variants["same-run steps"] = lambda run_, seed=0: same_run_model(run_["steps"], seed)
        notes.append("same-run: each rate's own logged prefill/decode/pull times and request hop")
    return variants, "; ".join(notes)


def sim_vs_real(path: Path, calibration: Path) -> dict:
    """Max |simulated - measured| attainment (percentage points) over the real run's rates, by the best
    available model (same-run steps, else the offline profile + overheads), with its noise."""
    data = read_serve_results(path)
    variants, note = ({}, f"no {path}") if data is None else _variants(data, calibration)
    if not variants:
        return {"sim_vs_real_attainment_max_diff_points": None,
                "sim_vs_real_status": f"not measured: bench serve results or a latency model not available ({note})"}
    headline = "same-run steps" if "same-run steps" in variants else "offline profile + overheads"
    rows, diffs, pooled = [], {name: [] for name in variants}, {"sim": [], "real": []}
    for run_ in (r for r in data["runs"] if r["setup"] == "disaggregated"):
        real_ok = _meets(run_["ttft"], run_["tpot"], data["ttft_slo"], data["tpot_slo"]) if "ttft" in run_ else None
        row = {"rate": run_["rate"], "requests": len(run_["prompt_lens"]), "real %": run_["attainment"] * 100}
        for name, build in variants.items():
            # the same-run model deals the measured request hops in a shuffled order: averaged over shuffles
            results = [_simulate_run(data, run_, *build(run_, seed))[1] for seed in range(_SHUFFLES)] \
                if name == "same-run steps" else [_simulate_run(data, run_, *build(run_))[1]]
            passes = np.mean([(r.ttft <= data["ttft_slo"]) & (r.tpot <= data["tpot_slo"]) for r in results], axis=0)
            sim = float(passes.mean())
            diffs[name].append(abs(sim - run_["attainment"]) * 100)
            row[f"sim % ({name})"] = sim * 100
            if name == headline:
                best = results[0]
                row["diff points"] = diffs[name][-1]
                if real_ok is not None:
                    sim_ok = passes
                    row.update(paired_noise(sim_ok, real_ok))
                    pooled["sim"].append(sim_ok)
                    pooled["real"].append(real_ok)
        row.update({"sim TTFT p90 ms": _p90_ms(best.ttft), "real TTFT p90 ms": _p90_ms(run_.get("ttft", [])),
                    "sim TPOT p90 ms": _p90_ms(best.tpot), "real TPOT p90 ms": _p90_ms(run_.get("tpot", []))})
        rows.append(row)
    print(f"\nSimulator vs the real bench serve run in {path} (headline model: {headline}; {note})")
    print(table([{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]))
    out = {"sim_vs_real_attainment_max_diff_points": max(diffs[headline]), "sim_vs_real_rows": rows,
           "sim_vs_real_model": headline,
           "sim_vs_real_max_diff_points_by_model": {n: max(d) for n, d in diffs.items()},
           "sim_vs_real_requests_per_rate": min(r["requests"] for r in rows),
           "sim_vs_real_status": f"measured against {path} ({len(rows)} rates); {note}"}
    if pooled["real"]:
        sim_all, real_all = np.concatenate(pooled["sim"]), np.concatenate(pooled["real"])
        noise = paired_noise(sim_all, real_all)
        out.update({"sim_vs_real_pooled_diff_points": float(sim_all.mean() - real_all.mean()) * 100,
                    "sim_vs_real_pooled_paired_se_points": noise["paired_se_points"],
                    "sim_vs_real_noise_points": max(r["paired_se_points"] for r in rows),
                    "sim_vs_real_requests_for_2_points": _requests_for(rows)})
        print(f"noise: paired s.e. of each rate's difference up to {out['sim_vs_real_noise_points']:.1f} points "
              f"({out['sim_vs_real_requests_per_rate']} requests per rate; 2 points would take ~"
              f"{out['sim_vs_real_requests_for_2_points']} per rate to resolve at 2 s.e.); all rates pooled: "
              f"sim - real {out['sim_vs_real_pooled_diff_points']:+.1f} +- {noise['paired_se_points']:.1f} points")
    return out


def _requests_for(rows: list[dict]) -> int:
    """Requests per rate at which the worst paired s.e. seen would shrink to 1 point (2 points = 2 s.e.)."""
    worst = max(rows, key=lambda r: r["paired_se_points"])
    return math.ceil(worst["requests"] * worst["paired_se_points"] ** 2)
