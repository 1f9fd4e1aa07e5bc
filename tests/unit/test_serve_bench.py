"""The serving benchmark's pure parts: percentiles, attainment, DistServe goodput (interpolated rate)."""

import pytest

from aiollm.loadgen.cpu_meter import CoreMeter
from aiollm.loadgen.replay import (
    RequestResult,
    attainment,
    bootstrap_ratio,
    goodput_ratio,
    max_rate_at,
    p90_tpot,
    summarise,
)


def test_summarise_counts_only_requests_meeting_both_slos():
    results = [
        RequestResult(True, ttft=0.1, tpot=0.05, e2e=1.0, output_tokens=10),
        RequestResult(True, ttft=0.5, tpot=0.05, e2e=1.0, output_tokens=10),  # TTFT too slow
        RequestResult(True, ttft=0.1, tpot=0.30, e2e=1.0, output_tokens=10),  # TPOT too slow
        RequestResult(False, error="boom"),
    ]
    out = summarise(results, duration=2.0, ttft_slo=0.2, tpot_slo=0.1)
    assert out["attainment"] == 0.25 and out["attainment_ttft"] == 0.5 and out["attainment_tpot"] == 0.5
    assert out["failed"] == 1 and out["goodput_rps"] == 0.5 and out["output_tokens_per_s"] == 15.0
    assert out["ttft_p50_ms"] == pytest.approx(100.0)


@pytest.mark.parametrize(
    "rates, attainment, expected",
    [
        ([1, 2, 4], [1.0, 0.95, 0.5], 2 + 2 * 0.05 / 0.45),  # interpolated between 2 and 4
        ([1, 2, 4], [1.0, 1.0, 0.95], 4),  # meets it everywhere: the highest rate tried
        ([1, 2, 4], [0.5, 0.95, 1.0], 0.0),  # misses at the lowest rate
        ([4, 1, 2], [0.5, 1.0, 0.9], 2 + 2 * 0.0 / 0.4),  # unsorted input; exactly at the target
    ],
)
def test_max_rate_at(rates, attainment, expected):
    assert max_rate_at(rates, attainment, 0.9) == pytest.approx(expected)


def _ok(tpot: float, ttft: float = 0.1) -> RequestResult:
    return RequestResult(True, ttft=ttft, tpot=tpot, e2e=1.0, output_tokens=10)


def test_p90_tpot_is_the_slo_at_which_exactly_90_percent_meet_it():
    results = [_ok(t / 100) for t in range(1, 20)] + [RequestResult(False, error="boom")]
    slo = p90_tpot(results)
    assert slo == 0.18 and attainment(results, 1.0, slo) == 0.9
    assert p90_tpot([RequestResult(False)] * 3) == float("inf")


def test_ratio_by_rule_uses_colocated_p90_at_lowest_rate():
    # colocated: 90 % at 60 ms at rate 1, worse at 2; disaggregated: 50 ms at every rate up to 4
    colocated = {1.0: [_ok(0.05)] * 9 + [_ok(0.09)], 2.0: [_ok(0.05)] * 5 + [_ok(0.2)] * 5}
    disagg = {1.0: [_ok(0.05)] * 10, 2.0: [_ok(0.05)] * 10}
    ratio, slo, goodput = goodput_ratio({"colocated": colocated, "disaggregated": disagg}, 1.0, None)
    assert slo == 0.05  # p90 of colocated at rate 1
    assert goodput["colocated"] == pytest.approx(1.0) and goodput["disaggregated"] == 2.0 and ratio == 2.0
    ratio, _, _ = goodput_ratio({"colocated": colocated, "disaggregated": disagg}, 0.01, None)  # TTFT SLO missed
    assert ratio is None
    low, high = bootstrap_ratio({"colocated": colocated, "disaggregated": disagg}, 1.0, None, samples=50)
    assert 0.0 <= low <= 2.0 <= high + 1e-9


def test_core_meter_sees_a_busy_child_process():
    import subprocess
    import sys
    import time

    # busy for 0.5 s, then idle (alive, so /proc still has its times when the meter stops)
    busy_then_idle = "import time\nt=time.time()\nwhile time.time()-t<0.5: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", busy_then_idle])
    try:
        meter = CoreMeter([child.pid])
        meter.start(time.perf_counter())
        time.sleep(0.8)
        use = meter.stop(time.perf_counter())
    finally:
        child.kill()
        child.wait()
    assert use.ours > 0.2 and use.machine >= use.ours - 0.1 and use.others >= 0.0 and use.cores >= 1


def test_steps_between_slices_by_time_and_matches_requests_by_length(tmp_path):
    from aiollm.loadgen.step_logs import read_logs, steps_between
    from aiollm.serving.step_log import StepLog

    log = StepLog(tmp_path / "prefill0.jsonl")
    log.record("prefill", 5.0, 5.5, lengths=[10], recv=[4.9])  # before the run: not counted
    log.record("prefill", 100.2, 100.5, lengths=[30, 40], recv=[100.1, 100.15])
    log.close()
    other = StepLog(tmp_path / "decode0.jsonl")
    other.record("decode", 100.6, 100.65, batch=2, context=72)
    other.record("pull", 100.55, 100.58, tokens=40)
    other.close()
    steps = steps_between(read_logs(tmp_path), 100.0, 110.0, [40, 30, 50], [100.05, 100.0, 101.0], [0.6, 0.7, None])
    assert steps["prefill"] == [[70, 2500, pytest.approx(0.3)]]
    assert steps["decode"] == [[2, 72, pytest.approx(0.05)]] and steps["pull"] == [[40, pytest.approx(0.03)]]
    assert steps["hop_in"] == [pytest.approx(0.1), pytest.approx(0.1), None]
    assert steps["hop_out"] == [pytest.approx(0.15), pytest.approx(0.2), None]
    assert steps["held"] == [False, False, False]
    held = steps_between(read_logs(tmp_path), 100.0, 110.0, [40], [100.16], [0.5], queue_limit=2)
    assert held["held"] == [True]  # both requests of the batch were waiting at the instance when it was sent
