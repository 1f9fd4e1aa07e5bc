"""The planner bench's sim-vs-real check: overheads recovered from an idle run, a replayed trace matched, the
same-run model fitted from logged steps, the paired noise."""
import json

import numpy as np
import pytest

import bench.sim_vs_real as bp
from aiollm.planner.latency import LatencyModel, StackLatency, piecewise

# Prefill 10 ms + 1 ms/token; decode 50 ms/step up to batch 2, then 30 ms more per sequence (a table).
LATENCY = LatencyModel("smollm2", "cpu", "test", {1: StackLatency(
    (0.01, 0.001, 0.0), (0.05, 0.0, 0.0), decode_table=piecewise([1, 2, 4], [0.05, 0.05, 0.11]))})


def _serve_json(path, runs, ttft_slo=1.0, tpot_slo=0.1):
    path.write_text(json.dumps({"model": "smollm2", "ttft_slo": ttft_slo, "tpot_slo": tpot_slo, "kv_tokens": 32768,
                                "max_batch_tokens": 512, "runs": runs}))
    return path


def test_overheads_recovered_from_an_idle_run(tmp_path):
    prompts, outputs = [50, 100, 200, 400], [16, 16, 8, 16]
    # 40 ms before prefill; the pull takes 20 ms + 0.1 ms per prompt token before decode steps of 50 ms.
    ttft = [0.04 + 0.01 + 0.001 * p for p in prompts]
    tpot = [(0.02 + 1e-4 * p + 0.05 * (n - 1)) / (n - 1) for p, n in zip(prompts, outputs)]
    path = _serve_json(tmp_path / "calib.json", [{"setup": "disaggregated", "rate": 0.1, "attainment": 1.0,
                                                  "prompt_lens": prompts, "output_lens": outputs,
                                                  "arrivals": [0, 10, 20, 30], "ttft": ttft, "tpot": tpot}])
    got = bp.deployment_overheads(path, LATENCY)
    assert got["request_overhead_s"] == pytest.approx(0.04)
    assert got["pull_overhead_s"] == pytest.approx(0.02)
    assert got["pull_s_per_prompt_token"] == pytest.approx(1e-4)


def test_a_trace_the_simulator_produced_compares_at_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(bp, "load_local", lambda: {"smollm2": LATENCY})
    rng = np.random.default_rng(0)
    prompts, outputs = rng.integers(20, 300, 60), rng.integers(2, 17, 60)
    arrivals = np.sort(rng.uniform(0, 30, 60))
    runs, data = [], {"ttft_slo": 0.5, "tpot_slo": 0.08, "kv_tokens": 32768, "max_batch_tokens": 512}
    for rate in (1.0, 2.0):
        run = {"setup": "disaggregated", "rate": rate, "prompt_lens": prompts.tolist(), "output_lens": outputs.tolist(),
               "arrivals": (arrivals / rate).tolist()}
        attainment, _ = bp._simulate_run(data, run, LATENCY, {})
        runs.append({**run, "attainment": attainment})
    assert 0 < runs[1]["attainment"] < runs[0]["attainment"]  # the rates straddle the knee
    path = _serve_json(tmp_path / "real.json", runs, 0.5, 0.08)
    out = bp.sim_vs_real(path, tmp_path / "missing.json")
    assert out["sim_vs_real_attainment_max_diff_points"] == pytest.approx(0.0)
    assert "no fixed overheads" in out["sim_vs_real_status"]
    assert out["sim_vs_real_requests_per_rate"] == 60


def test_same_run_model_recovers_logged_steps_and_hops():
    rng = np.random.default_rng(1)
    lengths = rng.integers(20, 400, 40)
    batches = rng.integers(1, 6, 200)
    context = batches * rng.integers(50, 300, 200)
    steps = {"prefill": [[int(t), int(t) ** 2, 0.01 + 0.001 * t + 1e-7 * t * t] for t in lengths],
             "decode": [[int(b), int(c), 0.05 + 0.01 * b + 1e-5 * c] for b, c in zip(batches, context)],
             "pull": [[int(t), 0.02 + 1e-4 * t] for t in lengths],
             "hop_in": [0.03] * 39 + [None], "hop_out": [0.01] * 40, "held": [False] * 30 + [True] * 10}
    steps["hop_in"][30:39] = [2.0] * 9  # held back by the controller: queueing, not overhead
    latency, overheads = bp.same_run_model(steps)
    assert latency.prefill_time([300]) == pytest.approx(0.01 + 0.3 + 0.009, rel=1e-6)
    assert latency.decode_time(3, 600) == pytest.approx(0.05 + 0.03 + 0.006, rel=1e-6)
    assert overheads["request_overhead_s"] == pytest.approx(0.04)
    assert overheads["pull_overhead_s"] == pytest.approx(0.02) and overheads["pull_s_per_prompt_token"] == pytest.approx(1e-4)
    assert overheads["matched_requests"] == 30  # the held-back ones are queueing, not overhead
    assert overheads["request_overheads_s"] == [pytest.approx(0.04)] * 30


def test_paired_noise_counts_disagreements():
    real = np.array([True] * 50 + [False] * 50)
    same = bp.paired_noise(real.copy(), real)
    assert same["disagree"] == 0 and same["paired_se_points"] == 0.0 and same["binomial_se_points"] == pytest.approx(5.0)
    sim = real.copy()
    sim[:4] = False  # 4 requests only the real run counts: sim 4 points lower, s.e. sqrt(4 - 16/100)/100
    got = bp.paired_noise(sim, real)
    assert got["disagree"] == 4 and got["paired_se_points"] == pytest.approx(np.sqrt(4 - 0.16))
