"""The planner bench's sim-vs-real check: overheads recovered from an idle run, a replayed trace matched."""
import json

import numpy as np
import pytest

import bench.planner as bp
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
