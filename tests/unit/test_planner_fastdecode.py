"""FastDecode sizing: P = B*S*R / (2*T(B)), the choice of B, and the step model with communication and
core sharing."""
import json

import pytest

from aiollm.planner.fastdecode import interpolate, predict_step, read_t_of_b, size

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


TRIP = {8: 0.0007, 128: 0.0025}


def test_step_is_the_largest_bound_with_communication_and_shared_cores():
    # B=256 pipelined on 2 R-workers: halves of 128, 64 rows per ask, 30 layers x 2 halves x 2 workers = 120 asks
    p = predict_step(CURVE, 2e-6, TRIP, n_layers=30, batch=256, kv_tokens=131072, workers=2, pipelined=True,
                     cores=2)
    trip = interpolate(TRIP, 64)
    s_part, attention, comm = 2 * interpolate(CURVE, 128), 2e-6 * 131072, 120 * trip
    assert p.round_trip == pytest.approx(trip) and p.communication == pytest.approx(comm)
    assert p.all_over_cores == pytest.approx((s_part + attention + comm) / 2)
    assert p.s_worker == pytest.approx(s_part + comm / 2)
    assert p.step == max(p.s_worker, p.r_worker, p.chain, p.all_over_cores) == p.all_over_cores
    # dedicated cores for every process: the shared-core bound stops binding, the S-worker's own work does
    free = predict_step(CURVE, 2e-6, TRIP, 30, 256, 131072, 2, True, cores=16)
    assert free.step < p.step and free.all_over_cores == pytest.approx((s_part + attention + comm) / 3)
    # without the pipeline the step is one chain: the S-part, a round trip per layer, and all the attention / P
    serial = predict_step(CURVE, 2e-6, TRIP, 30, 256, 131072, 2, False, cores=16)
    assert serial.chain == pytest.approx(CURVE[256] + 30 * interpolate(TRIP, 128) + attention / 2)
    # ...and on one core the two R-workers' attention cannot run side by side
    one_core = predict_step(CURVE, 2e-6, TRIP, 30, 256, 131072, 2, False, cores=1)
    assert one_core.chain == pytest.approx(CURVE[256] + 30 * interpolate(TRIP, 128) + attention)
    with pytest.raises(ValueError):
        predict_step(CURVE, 2e-6, {}, 30, 256, 1, 2, True, 2)


def test_sizing_with_communication_and_few_cores_takes_fewer_workers_than_the_formula():
    classic = size(CURVE, r_per_token=2e-6, seq_len=1024)
    few = size(CURVE, 2e-6, 1024, round_trip={1: TRIP}, n_layers=30, cores=2)
    # near-free communication on dedicated cores: back to about the formula's P
    ideal = size(CURVE, 2e-6, 1024, round_trip={1: {8: 1e-6, 128: 2e-6}}, n_layers=30, cores=64)
    assert few.batch == classic.batch == ideal.batch == 256
    assert few.workers < ideal.workers and ideal.workers >= classic.workers - 1
    assert few.predicted_step > ideal.predicted_step > 0
    assert "C(8)=0.70 ms" in few.explain() and "all work / cores" in few.explain()
    # a slower round trip measured with 2 R-workers (processes competing for cores) prices P >= 2 with it
    dearer = size(CURVE, 2e-6, 1024, round_trip={1: TRIP, 2: {8: 0.005, 128: 0.01}}, n_layers=30, cores=2)
    assert dearer.workers == 1 and "with 2 R-worker(s): C(8)=5.00 ms" in dearer.explain()
    with pytest.raises(ValueError, match="n_layers"):
        size(CURVE, 2e-6, 1024, round_trip={1: TRIP})
