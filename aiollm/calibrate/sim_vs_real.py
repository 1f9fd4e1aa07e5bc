"""The planner bench's simulator-vs-real check: the simulator replays real `bench serve` runs (their exact
requests, lengths and arrival times; 1 prefill + 1 decode instance as served) and its SLO attainment is
compared with the measured one, rate by rate.

Latency models compared. "same-run steps" (the headline when the runs were made with `--step-log`): each
pass's simulation uses the prefill batch, decode step and KV pull times the instances logged while that
pass was served, so the slowdown of instances sharing the cores (with each other, the controller, the
frontend, the client and anything else on the machine) is in the model, and the request hop (client ->
prefill instance, prefill -> client's first token) measured in the same pass, dealt to the simulated
requests in shuffled orders. "same-run, no controller hold" is the same without the controller's limit of
requests sent ahead to the prefill instance (what modelling it changes). "offline profile": the local
profile of `python -m aiollm.plan profile` (measured alone) plus fixed overheads from an idle calibration
run.

Noise: the simulator replays the same trace, so the workload's sampling noise is shared; what remains is
the real system's own run-to-run variation and the model's per-request errors. A rate served in several
passes of the same trace (`bench serve --request-rate R,R`) gives the floor directly: real pass minus real
pass, over the same requests. Each difference is printed with its 95 % interval (aiollm.calibrate.sim_vs_real_stats).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from aiollm.calibrate.same_run import consensus, same_run_model, visible_steps
from aiollm.calibrate.sim_vs_real_stats import difference, plot, request_errors
from aiollm.planner.latency import LatencyModel
from aiollm.planner.models import get_model
from aiollm.planner.profiles import load_local
from aiollm.planner.simulator import InstanceSpec, SimConfig, SimResult, simulate
from aiollm.planner.workload import LengthSample, Workload
from aiollm.report import table

# shuffles of the measured request hops averaged by the same-run model
_SHUFFLES = 16
# the controller's default prefill_queue_limit (aiollm.serving.distserve.controller), for runs that do not state theirs
_QUEUE_LIMIT = 4
HEADLINE = "same-run steps"
_TARGET_POINTS = 2.0


def read_serve_results(path: Path) -> dict | None:
    """A real serving run to compare with, or None if the file does not exist.

    The file this reads (written by `python -m bench serve --json PATH`) is JSON with
      "model": "smollm2", "ttft_slo": seconds, "tpot_slo": seconds, "kv_tokens": decode KV capacity,
      optional "max_running" (default 128), "max_batch_tokens" (default: L_m of the local profile) and
      "prefill_queue_limit" (default 4, the controller's),
      "runs": [{"setup": "disaggregated", "rate": req/s, "attainment": share in [0, 1] meeting both SLOs,
                "prompt_lens": [...], "output_lens": [...], "arrivals": [seconds from start, ...],
                optional "ttft": [...], "tpot": [...] per request in seconds (null: failed),
                optional "steps": what the instances logged (aiollm.loadgen.step_logs)}, ...]
    A rate may appear in several runs (passes of the same trace: `--request-rate R,R`).
    """
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if "runs" not in data:
        raise ValueError(
            f"{path}: no 'runs' list (expected the format in aiollm/calibrate/sim_vs_real.py:read_serve_results)"
        )
    return data


def merge_serve_results(paths: list[Path]) -> dict | None:
    """Several `bench serve` files (e.g. one per rate, so each holds the bench lock for a few minutes) as one:
    their runs together; the SLOs, model and limits must agree. None if none of the files exists."""
    found = [(p, d) for p in paths if (d := read_serve_results(p)) is not None]
    if not found:
        return None
    keys = ("model", "ttft_slo", "tpot_slo", "kv_tokens", "max_batch_tokens", "max_running", "prefill_queue_limit")
    first_path, merged = found[0]
    merged = {**merged, "runs": [], "sources": [str(p) for p, _ in found]}
    for path, data in found:
        for key in keys:
            if data.get(key) != merged.get(key):
                raise ValueError(f"{path}: {key} {data.get(key)!r} differs from {first_path}'s {merged.get(key)!r}")
        merged["runs"] += [r for r in data["runs"] if r["setup"] == "disaggregated"]
    return merged


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
    return {
        "request_overhead_s": max(0.0, float(np.median(ttft_extra))),
        "pull_overhead_s": max(0.0, float(setup)),
        "pull_s_per_prompt_token": float(slope),
        "calibration_requests": len(pull_extra),
    }


def _simulate_run(
    data: dict, run_: dict, latency: LatencyModel, overheads: dict, queue_limit: int | None = None
) -> tuple[float, SimResult]:
    """Simulated attainment of one real run: its own requests at its own arrival times, one prefill and one
    decode instance with the run's KV, L_m, batch and controller limits."""
    lengths = LengthSample("served", np.array(run_["prompt_lens"]), np.array(run_["output_lens"]))
    workload = Workload(lengths, np.array(run_["arrivals"]) * run_["rate"])
    per_token = overheads.get("pull_s_per_prompt_token", 0.0)
    limit = data.get("prefill_queue_limit", _QUEUE_LIMIT) if queue_limit is None else queue_limit
    cfg = SimConfig(
        latency,
        "disaggregated",
        InstanceSpec(1),
        InstanceSpec(1),
        data["kv_tokens"],
        data["kv_tokens"],
        1,
        link_bandwidth=1.0 / per_token if per_token > 0 else math.inf,
        max_batch_tokens=data.get("max_batch_tokens", 0),
        max_running=data.get("max_running", 128),
        request_overhead=overheads.get("request_overhead_s", 0.0),
        request_overheads=tuple(overheads.get("request_overheads_s", ())),
        first_token_delays=tuple(overheads.get("first_token_delays_s", ())),
        first_visible_steps=tuple(overheads.get("first_visible_steps", ())),
        pull_overhead=overheads.get("pull_overhead_s", 0.0),
        prefill_queue_limit=limit,
        prefill_slowdown=tuple(overheads.get("prefill_slowdown", ())),
        decode_slowdown=tuple(overheads.get("decode_slowdown", ())),
        slowdown_period=overheads.get("slowdown_period", 0.5),
    )
    result = simulate(cfg, workload, run_["rate"])
    return result.attainment(data["ttft_slo"], data["tpot_slo"])["both"], result


def _meets(ttft, tpot, ttft_slo: float, tpot_slo: float) -> np.ndarray:
    t = np.array([np.inf if x is None else x for x in ttft], dtype=np.float64)
    p = np.array([np.inf if x is None else x for x in tpot], dtype=np.float64)
    return (t <= ttft_slo) & (p <= tpot_slo)


def _linear_only(latency: LatencyModel) -> LatencyModel:
    """The same profile with its piecewise tables dropped: the DistServe linear form alone."""
    by_tp = {tp: replace(s, prefill_table=(), decode_table=()) for tp, s in latency.by_tp.items()}
    return replace(latency, by_tp=by_tp, source=latency.source.replace("measured points interpolated", "linear fit"))


def _p90_ms(values) -> float:
    finite = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.percentile(finite, 90)) * 1e3 if finite else float("nan")


def _variants(data: dict, calibration: Path) -> tuple[dict, str]:
    """The models to compare, by name: {name: (run, seed) -> (LatencyModel, overheads, queue limit or None)};
    a model that uses the seed (dealt hops) is averaged over shuffles."""
    variants, notes = {}, []
    if all("steps" in r for r in data["runs"]):
        variants[HEADLINE] = lambda run_, seed: (*same_run_model(run_["steps"], seed, run_["_visible"]), None)
        variants["same-run, no controller hold"] = lambda run_, seed: (
            *same_run_model(run_["steps"], seed, run_["_visible"]),
            0,
        )
        variants["same-run, steady speed"] = lambda run_, seed: (
            *same_run_model(run_["steps"], seed, run_["_visible"], varying=False),
            None,
        )
        variants["same-run, first token at prefill"] = lambda run_, seed: (*same_run_model(run_["steps"], seed), None)
        notes.append("same-run: each pass's own logged prefill/decode/pull times and request hops")
    try:
        offline = load_local()[get_model(data["model"]).name]
    except (FileNotFoundError, ValueError, KeyError) as exc:
        notes.append(f"no offline profile ({exc})")
    else:
        try:
            fixed = deployment_overheads(calibration, offline)
            notes.append(
                f"offline: {offline.source}, request {fixed['request_overhead_s'] * 1e3:.0f} ms from {calibration}"
            )
        except (FileNotFoundError, ValueError, KeyError) as exc:
            fixed = {}
            notes.append(f"offline: no fixed overheads modelled ({exc})")
        variants["offline profile + overheads"] = lambda run_, seed: (offline, fixed, None)
        variants["offline linear, no overheads"] = lambda run_, seed: (_linear_only(offline), {}, None)
    return variants, "; ".join(notes)


def _first_visible(runs: list[dict]) -> None:
    """Each run's requests' first visible tokens (run["_visible"], None if not logged), from the other passes
    of the same trace (same requests) where there are any: a property of the requests, not of the pass."""
    traces: dict[tuple, list[dict]] = {}
    for run_ in runs:
        traces.setdefault((tuple(run_["prompt_lens"]), tuple(run_["output_lens"])), []).append(run_)
    for group in traces.values():
        counted = [visible_steps(r) if "steps" in r else None for r in group]
        for k, run_ in enumerate(group):
            run_["_visible"] = None if any(c is None for c in counted) else consensus(counted, k)


def _evaluate_pass(data: dict, run_: dict, build, shuffles: int) -> dict:
    """One real pass replayed `shuffles` times: per-request pass probabilities (both SLOs, each alone) and
    per-request median simulated TTFT/TPOT, with the simulated prefill batch sizes."""
    results = [_simulate_run(data, run_, *build(run_, seed))[1] for seed in range(shuffles)]
    ttft = np.array([r.ttft for r in results])
    tpot = np.array([r.tpot for r in results])
    ok_ttft, ok_tpot = ttft <= data["ttft_slo"], tpot <= data["tpot_slo"]
    # requests whose first token came at the same simulated instant shared a prefill batch
    _, sizes = np.unique(results[0].prefilled[np.isfinite(results[0].prefilled)], return_counts=True)
    both = ok_ttft & ok_tpot
    return {
        "ok": both.mean(axis=0),
        "ok_ttft": ok_ttft.mean(axis=0),
        "ok_tpot": ok_tpot.mean(axis=0),
        # how much the attainment moves with where the dealt hops and slow spells fall: the model's own
        # estimate of a pass-to-pass difference on the same trace (x sqrt(2))
        "spread": float(np.std(both.mean(axis=1), ddof=1)) * 100 if shuffles > 1 else float("nan"),
        "ttft": np.median(ttft, axis=0),
        "tpot": np.median(tpot, axis=0),
        "ttft_all": ttft,
        "tpot_all": tpot,
        "batch": float(np.mean(sizes)) if len(sizes) else float("nan"),
    }


def _real_pass(data: dict, run_: dict) -> dict:
    ttft = np.array([np.inf if x is None else x for x in run_["ttft"]], dtype=np.float64)
    tpot = np.array([np.inf if x is None else x for x in run_["tpot"]], dtype=np.float64)
    count = len(run_.get("steps", {}).get("prefill", []))  # batches logged while the pass was served
    return {
        "ok": _meets(run_["ttft"], run_["tpot"], data["ttft_slo"], data["tpot_slo"]).astype(np.float64),
        "ok_ttft": (ttft <= data["ttft_slo"]).astype(np.float64),
        "ok_tpot": (tpot <= data["tpot_slo"]).astype(np.float64),
        "ttft": ttft,
        "tpot": tpot,
        "batch": len(ttft) / count if count else float("nan"),
    }


def sim_vs_real(paths: list[Path] | Path, calibration: Path, plot_path: Path | None = None) -> dict:
    """Per rate: simulated minus measured attainment (points) with its 95 % interval, beside the real system's
    own pass-to-pass difference on the same trace; the headline is the largest |difference| over the rates,
    by the best available model (same-run steps, else the offline profile + overheads)."""
    paths = [paths] if isinstance(paths, Path) else list(paths)
    data = merge_serve_results(paths)
    variants, note = ({}, f"no {', '.join(map(str, paths))}") if data is None else _variants(data, calibration)
    if not variants or not data["runs"] or any("ttft" not in r for r in data["runs"]):
        return {
            "sim_vs_real_attainment_max_diff_points": None,
            "sim_vs_real_status": f"not measured: bench serve results with per-request times or a latency model "
            f"not available ({note})",
        }
    headline = HEADLINE if HEADLINE in variants else "offline profile + overheads"
    _first_visible(data["runs"])
    by_rate: dict[float, list[dict]] = {}
    for run_ in data["runs"]:
        by_rate.setdefault(float(run_["rate"]), []).append(run_)
    pass_rows, rate_rows, model_rows, plotted = [], [], [], []
    for rate, runs in sorted(by_rate.items()):
        real = [_real_pass(data, r) for r in runs]
        sims = {
            name: [_evaluate_pass(data, r, build, _SHUFFLES if name.startswith("same-run") else 1) for r in runs]
            for name, build in variants.items()
        }
        model_rows.append(
            {
                "rate": rate,
                **{
                    f"{name}": difference([s["ok"] for s in sim], [x["ok"] for x in real])["diff"]
                    for name, sim in sims.items()
                },
            }
        )
        sim = sims[headline]
        pass_rows += [_pass_row(rate, k, s, x, r) for k, (s, x, r) in enumerate(zip(sim, real, runs))]
        d = difference([s["ok"] for s in sim], [x["ok"] for x in real])
        row = {
            "rate": rate,
            "passes": len(runs),
            "requests": sum(len(x["ok"]) for x in real),
            "real %": 100 * np.mean([x["ok"].mean() for x in real]),
            "sim %": 100 * np.mean([s["ok"].mean() for s in sim]),
            "sim - real": d["diff"],
            "paired s.e.": d["paired_se"],
            "batch s.e.": d["batch_se"],
            "95% CI": _ci(d),
            "within 2": _verdict(d),
        }
        if len(runs) >= 2:  # the floor: the real system against itself on the same trace (its two most different
            # passes), and as the model sees it (spell placement alone)
            low, high = np.argmin([x["ok"].mean() for x in real]), np.argmax([x["ok"].mean() for x in real])
            floor = difference([real[high]["ok"]], [real[low]["ok"]])
            row.update(
                {
                    "real max - min": floor["diff"],
                    "real-real 95% CI": _ci(floor),
                    "model's pass-pass s.d.": math.sqrt(2) * float(np.mean([s["spread"] for s in sim])),
                }
            )
        rate_rows.append({**row, "_d": d})
        plotted.append(
            {
                "rate": rate,
                "real": row["real %"],
                "sim": row["sim %"],
                "ci95": d["ci95"],
                "pass_ci95": [difference([s["ok"]], [x["ok"]])["ci95"] for s, x in zip(sim, real)],
                "real_passes": [100 * x["ok"].mean() for x in real],
                "sim_passes": [100 * s["ok"].mean() for s in sim],
                **{
                    f"{side}_{key}": 100 * np.mean([p[f"ok_{key}"].mean() for p in ps])
                    for side, ps in (("real", real), ("sim", sim))
                    for key in ("ttft", "tpot")
                },
            }
        )
    return _report(data, headline, note, pass_rows, rate_rows, model_rows, plotted, plot_path)


def _pass_row(rate: float, k: int, s: dict, x: dict, run_: dict) -> dict:
    """One pass: attainments, the difference and its interval, and the per-request errors of the simulated
    times (simulated minus measured, same request: median = bias, median and p90 of |error|); how many cores
    other processes kept busy meanwhile (bench serve's meter), which is what disturbs a pass."""
    d = difference([s["ok"]], [x["ok"]])
    row = {
        "rate": rate,
        "pass": k + 1,
        "requests": len(x["ok"]),
        "others' cores": run_.get("cores_others", float("nan")),
        "real %": 100 * x["ok"].mean(),
        "sim %": 100 * s["ok"].mean(),
        "sim - real": d["diff"],
        "95% CI": _ci(d),
        "sim s.d. over shuffles": s["spread"],
    }
    for name in ("ttft", "tpot"):
        err = request_errors(s[name], x[name])
        row.update(
            {
                f"{name.upper()} bias ms": err["bias_ms"],
                f"{name.upper()} |err| p50/p90 ms": f"{err['mae_ms']:.1f}/{err['p90_abs_ms']:.1f}",
                f"{name.upper()} p90 sim/real ms": f"{_p90_ms(s[name + '_all'].ravel()):.0f}/{_p90_ms(x[name]):.0f}",
            }
        )
    row["prefill batch sim/real"] = f"{s['batch']:.2f}/{x['batch']:.2f}"
    return row


def _ci(d: dict) -> str:
    return f"[{d['ci95'][0]:+.1f}, {d['ci95'][1]:+.1f}]"


def _verdict(d: dict) -> str:
    low, high = d["ci95"]
    if -_TARGET_POINTS <= low and high <= _TARGET_POINTS:
        return "yes (CI inside)"
    if abs(d["diff"]) <= _TARGET_POINTS:
        return "yes (CI wider)"
    return "no" if low > _TARGET_POINTS or high < -_TARGET_POINTS else "no (CI spans 2)"


def _fmt(rows: list[dict]) -> str:
    return table(
        [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if not k.startswith("_")} for r in rows]
    )


def _report(data, headline, note, pass_rows, rate_rows, model_rows, plotted, plot_path) -> dict:
    slo = f"TTFT {data['ttft_slo'] * 1e3:.0f} ms, TPOT {data['tpot_slo'] * 1e3:.0f} ms"
    print(
        f"\nSimulator vs real bench serve runs ({', '.join(data['sources'])}; {slo}; headline model: {headline}; {note})"
    )
    print("per pass (TTFT/TPOT errors: simulated minus measured time of the same request; bias = median):")
    print(_fmt(pass_rows))
    print("sim - real (points) by latency model, all passes of a rate together:")
    print(_fmt(model_rows))
    print(
        "per rate, headline model (real max - min: the real system against itself on the same trace, its most "
        "different passes):"
    )
    print(_fmt(rate_rows))
    worst = max(rate_rows, key=lambda r: abs(r["sim - real"]))
    names = [k for k in model_rows[0] if k != "rate"]
    out = {
        "sim_vs_real_attainment_max_diff_points": abs(worst["sim - real"]),
        "sim_vs_real_model": headline,
        "sim_vs_real_slo": slo,
        "sim_vs_real_rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rate_rows],
        "sim_vs_real_pass_rows": pass_rows,
        "sim_vs_real_diff_by_model": model_rows,
        "sim_vs_real_max_diff_points_by_model": {n: max(abs(r[n]) for r in model_rows) for n in names},
        "sim_vs_real_requests_per_rate": min(r["requests"] for r in rate_rows),
        # one pass alone (a rate's passes together average their errors out)
        "sim_vs_real_max_pass_diff_points": max(abs(r["sim - real"]) for r in pass_rows),
        "sim_vs_real_ci95_max_abs_points": max(max(abs(x) for x in r["_d"]["ci95"]) for r in rate_rows),
        "sim_vs_real_se_max_points": max(r["_d"]["se"] for r in rate_rows),
        "sim_vs_real_status": f"measured against {len(data['sources'])} file(s), {len(rate_rows)} rates; {note}",
    }
    floors = [r["real max - min"] for r in rate_rows if "real max - min" in r]
    if floors:
        out["sim_vs_real_real_vs_real_max_diff_points"] = max(floors)
    inside = all(r["within 2"] == "yes (CI inside)" for r in rate_rows)
    out["sim_vs_real_target"] = (
        "within 2 points at every rate, 95 % intervals inside +-2"
        if inside
        else "within 2 points at every rate (point estimates; an interval reaches past 2)"
        if all(r["within 2"].startswith("yes") for r in rate_rows)
        else "not within 2 points at every rate"
    )
    print(
        f"sim_vs_real: max |sim - real| {out['sim_vs_real_attainment_max_diff_points']:.1f} points (rate {worst['rate']}, "
        f"95 % CI {worst['95% CI']}); widest 95 % bound {out['sim_vs_real_ci95_max_abs_points']:.1f}; one pass alone "
        f"up to {out['sim_vs_real_max_pass_diff_points']:.1f}; "
        + (f"real vs real on the same trace up to {max(floors):.1f} points; " if floors else "")
        + out["sim_vs_real_target"]
    )
    if plot_path is not None:
        plot(
            plot_path,
            plotted,
            f"simulator vs real, {data['model']}, {slo}, {out['sim_vs_real_requests_per_rate']} requests per rate",
        )
        out["sim_vs_real_plot"] = str(plot_path)
        print(f"plot: {plot_path}")
    return out
