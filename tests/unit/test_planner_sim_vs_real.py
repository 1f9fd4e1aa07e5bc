"""The planner bench's sim-vs-real check: overheads recovered from an idle run, a replayed trace matched, the
same-run model fitted from logged steps, the paired noise."""

import json

import numpy as np
import pytest

import aiollm.calibrate.sim_vs_real as bp
from aiollm.calibrate.same_run import consensus, hops, same_run_model, slowdowns, visible_steps
from aiollm.calibrate.sim_vs_real_stats import difference
from aiollm.planner.latency import LatencyModel, StackLatency, piecewise

# Prefill 10 ms + 1 ms/token; decode 50 ms/step up to batch 2, then 30 ms more per sequence (a table).
LATENCY = LatencyModel(
    "smollm2",
    "cpu",
    "test",
    {1: StackLatency((0.01, 0.001, 0.0), (0.05, 0.0, 0.0), decode_table=piecewise([1, 2, 4], [0.05, 0.05, 0.11]))},
)


def _serve_json(path, runs, ttft_slo=1.0, tpot_slo=0.1):
    path.write_text(
        json.dumps(
            {
                "model": "smollm2",
                "ttft_slo": ttft_slo,
                "tpot_slo": tpot_slo,
                "kv_tokens": 32768,
                "max_batch_tokens": 512,
                "runs": runs,
            }
        )
    )
    return path


def test_overheads_recovered_from_an_idle_run(tmp_path):
    prompts, outputs = [50, 100, 200, 400], [16, 16, 8, 16]
    # 40 ms before prefill; the pull takes 20 ms + 0.1 ms per prompt token before decode steps of 50 ms.
    ttft = [0.04 + 0.01 + 0.001 * p for p in prompts]
    tpot = [(0.02 + 1e-4 * p + 0.05 * (n - 1)) / (n - 1) for p, n in zip(prompts, outputs)]
    path = _serve_json(
        tmp_path / "calib.json",
        [
            {
                "setup": "disaggregated",
                "rate": 0.1,
                "attainment": 1.0,
                "prompt_lens": prompts,
                "output_lens": outputs,
                "arrivals": [0, 10, 20, 30],
                "ttft": ttft,
                "tpot": tpot,
            }
        ],
    )
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
    for rate in (1.0, 2.0, 2.0):  # rate 2 served twice (the same trace): real vs real is 0 here
        run = {
            "setup": "disaggregated",
            "rate": rate,
            "prompt_lens": prompts.tolist(),
            "output_lens": outputs.tolist(),
            "arrivals": (arrivals / rate).tolist(),
        }
        attainment, result = bp._simulate_run(data, run, LATENCY, {})
        runs.append({**run, "attainment": attainment, "ttft": result.ttft.tolist(), "tpot": result.tpot.tolist()})
    assert 0 < runs[1]["attainment"] < runs[0]["attainment"]  # the rates straddle the knee
    first = _serve_json(tmp_path / "low.json", runs[:1], 0.5, 0.08)
    second = _serve_json(tmp_path / "high.json", runs[1:], 0.5, 0.08)
    out = bp.sim_vs_real([first, second], tmp_path / "missing.json", tmp_path / "plot.png")
    assert out["sim_vs_real_attainment_max_diff_points"] == pytest.approx(0.0)
    assert out["sim_vs_real_real_vs_real_max_diff_points"] == pytest.approx(0.0)
    assert "no fixed overheads" in out["sim_vs_real_status"]
    assert out["sim_vs_real_requests_per_rate"] == 60 and [r["passes"] for r in out["sim_vs_real_rows"]] == [1, 2]
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_files_with_other_slos_are_not_merged(tmp_path):
    run = {
        "setup": "disaggregated",
        "rate": 1.0,
        "attainment": 1.0,
        "prompt_lens": [10],
        "output_lens": [2],
        "arrivals": [0.0],
    }
    with pytest.raises(ValueError, match="ttft_slo"):
        bp.merge_serve_results(
            [_serve_json(tmp_path / "a.json", [run], 1.0), _serve_json(tmp_path / "b.json", [run], 2.0)]
        )


def test_same_run_model_recovers_logged_steps_and_hops():
    rng = np.random.default_rng(1)
    lengths = rng.integers(20, 400, 40)
    batches = rng.integers(1, 6, 200)
    context = batches * rng.integers(50, 300, 200)
    steps = {
        "prefill": [[int(t), int(t) ** 2, 0.01 + 0.001 * t + 1e-7 * t * t] for t in lengths],
        "decode": [[int(b), int(c), 0.05 + 0.01 * b + 1e-5 * c] for b, c in zip(batches, context)],
        "pull": [[int(t), 0.02 + 1e-4 * t] for t in lengths],
        "hop_in": [0.03] * 39 + [None],
        "hop_out": [0.01] * 40,
        "held": [False] * 30 + [True] * 10,
    }
    steps["hop_in"][30:39] = [2.0] * 9  # held back by the controller: queueing, not overhead
    latency, overheads = same_run_model(steps)
    assert latency.prefill_time([300]) == pytest.approx(0.01 + 0.3 + 0.009, rel=1e-6)
    assert latency.decode_time(3, 600) == pytest.approx(0.05 + 0.03 + 0.006, rel=1e-6)
    assert overheads["request_overhead_s"] == pytest.approx(0.03)
    assert overheads["pull_overhead_s"] == pytest.approx(0.02) and overheads[
        "pull_s_per_prompt_token"
    ] == pytest.approx(1e-4)
    assert overheads["matched_requests"] == 30  # the held-back ones are queueing, not overhead
    assert overheads["request_overheads_s"] == [pytest.approx(0.03)] * 30
    assert overheads["first_token_delays_s"] == [pytest.approx(0.01)] * 30
    assert overheads["clock_offset_s"] == 0.0 and "decode_slowdown" not in overheads  # no step times logged


def test_hops_undo_the_send_clock_offset():
    # true ways in 2-10 ms and out 2-100 ms, the sends' clock 30 ms early: measured in +30 ms, out -30 ms
    way_in, way_out = np.linspace(0.002, 0.010, 9), np.linspace(0.002, 0.100, 9)
    steps = {"hop_in": list(way_in + 0.03), "hop_out": list(way_out - 0.03)}
    got_in, got_out, offset = hops(steps)
    assert offset == pytest.approx(0.03)
    assert got_in == pytest.approx(way_in) and got_out == pytest.approx(way_out)


def test_first_visible_token_counted_from_decode_steps():
    # Both prefilled by 0.1. r0's text arrives 5 ms later: the prefill's token. r1 is pulled by 0.104, after a
    # step began at 0.103; its text arrives at 0.207, after the next step (0.153-0.203): the first decode token.
    steps = {
        "hop_in": [0.001, 0.001],
        "hop_out": [0.005, 0.107],
        "decode_at": [[0.103, 0.153], [0.153, 0.203]],
        "pull_at": [[0.101, 0.103, 10], [0.101, 0.104, 12]],
    }
    run = {"arrivals": [0.0, 0.0], "ttft": [0.105, 0.207], "prompt_lens": [10, 12], "steps": steps}
    assert visible_steps(run) == [0, 1]
    assert visible_steps({**run, "steps": {k: v for k, v in steps.items() if k != "decode_at"}}) is None
    assert consensus([[0, 1, None], [0, 0, 1], [0, 0, 1]], 0) == [0, 0, 1]  # the other passes decide
    assert consensus([[0, 1, None], [1, 1, 1]], 1) == [0, 1, 1]  # only its own where no other pass has one


def test_slowdowns_from_step_times():
    # decode steps of a 50 ms model: 50 ms in the first half second, 100 ms in the second, none in the third;
    # prefill batches of a 10 ms model taking 20 ms, only in the first half second
    stack = StackLatency((0.01, 0.0, 0.0), (0.05, 0.0, 0.0))
    steps = {
        "decode": [[1, 10, 0.05]] * 5 + [[1, 10, 0.1]] * 3,
        "prefill": [[10, 100, 0.02]] * 2,
        "decode_at": [[0.05 * i, 0.05 * i + 0.05] for i in range(5)] + [[0.6, 0.7], [0.7, 0.8], [0.8, 1.3]],
        "prefill_at": [[0.0, 0.02], [0.3, 0.32]],
    }
    prefill, decode = slowdowns(steps, stack)
    assert decode == pytest.approx([1.0, 2.0, 2.0])  # the empty third period takes its neighbour's
    assert prefill == pytest.approx([2.0, 2.0, 2.0])


def test_difference_interval_takes_the_larger_standard_error():
    # 200 requests per pass, two passes: sim 1 for all; real fails the first 20 of each pass (clustered in
    # time, so the batch-means s.e. over 20 blocks exceeds the per-request one)
    real = np.ones(200)
    real[:20] = 0
    d = difference([np.ones(200)] * 2, [real] * 2)
    assert d["diff"] == pytest.approx(10.0)
    assert d["paired_se"] == pytest.approx(np.sqrt(0.09 / 400) * 100)
    assert d["batch_se"] > d["paired_se"] and d["se"] == d["batch_se"]
    assert d["ci95"] == pytest.approx((10 - 1.96 * d["se"], 10 + 1.96 * d["se"]))
