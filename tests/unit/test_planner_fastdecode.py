"""FastDecode sizing: P = B*S*R / (2*T(B)) and the choice of B."""
import json

import pytest

from aiollm.planner.fastdecode import interpolate, read_t_of_b, size

CURVE = {1: 0.010, 16: 0.012, 64: 0.020, 256: 0.060, 512: 0.120}


def test_workers_from_the_formula():
    s = size(CURVE, r_per_token=2e-6, seq_len=1024)
    # throughput B/T: 100, 1333, 3200, 4267, 4267 -> 90 % of the best first reached at B = 256
    assert s.batch == 256
    assert s.workers_exact == pytest.approx(256 * 1024 * 2e-6 / (2 * 0.060))
    assert s.workers == 5  # ceil(4.37)
    assert "B*S*R / (2*T(B))" in s.explain()


def test_latency_target_picks_the_largest_batch_within_it():
    s = size(CURVE, r_per_token=2e-6, seq_len=1024, latency_target=0.030)
    assert interpolate(CURVE, s.batch) <= 0.030 < interpolate(CURVE, s.batch + 1)
    with pytest.raises(ValueError, match="below T\\(1\\)"):
        size(CURVE, 2e-6, 1024, latency_target=0.005)


def test_reads_bench_model_json_in_its_shapes(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"t_of_b": {"1": 0.01, "8": 0.02}}))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"t_of_b": [[1, 0.01], [8, 0.02]]}))
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"t_of_b_bf16": [{"batch": 1, "seconds": 0.01}, {"batch": 8, "seconds": 0.02}]}))
    assert read_t_of_b(a) == read_t_of_b(b) == read_t_of_b(rows, "t_of_b_bf16") == {1: 0.01, 8: 0.02}
    c = tmp_path / "c.json"
    c.write_text("{}")
    with pytest.raises(ValueError, match="t_of_b"):
        read_t_of_b(c)


def test_bad_inputs():
    with pytest.raises(ValueError):
        size({}, 1e-6, 10)
    with pytest.raises(ValueError):
        size(CURVE, 0.0, 10)
