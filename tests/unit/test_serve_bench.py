"""The serving benchmark's pure parts: percentiles, attainment, DistServe goodput (interpolated rate)."""
import pytest

from bench.serve_load import RequestResult, max_rate_at, summarise


def test_summarise_counts_only_requests_meeting_both_slos():
    results = [RequestResult(True, ttft=0.1, tpot=0.05, e2e=1.0, output_tokens=10),
               RequestResult(True, ttft=0.5, tpot=0.05, e2e=1.0, output_tokens=10),  # TTFT too slow
               RequestResult(True, ttft=0.1, tpot=0.30, e2e=1.0, output_tokens=10),  # TPOT too slow
               RequestResult(False, error="boom")]
    out = summarise(results, duration=2.0, ttft_slo=0.2, tpot_slo=0.1)
    assert out["attainment"] == 0.25 and out["attainment_ttft"] == 0.5 and out["attainment_tpot"] == 0.5
    assert out["failed"] == 1 and out["goodput_rps"] == 0.5 and out["output_tokens_per_s"] == 15.0
    assert out["ttft_p50_ms"] == pytest.approx(100.0)


@pytest.mark.parametrize("rates, attainment, expected", [
    ([1, 2, 4], [1.0, 0.95, 0.5], 2 + 2 * 0.05 / 0.45),  # interpolated between 2 and 4
    ([1, 2, 4], [1.0, 1.0, 0.95], 4),  # meets it everywhere: the highest rate tried
    ([1, 2, 4], [0.5, 0.95, 1.0], 0.0),  # misses at the lowest rate
    ([4, 1, 2], [0.5, 1.0, 0.9], 2 + 2 * 0.0 / 0.4),  # unsorted input; exactly at the target
])
def test_max_rate_at(rates, attainment, expected):
    assert max_rate_at(rates, attainment, 0.9) == pytest.approx(expected)
