"""FastDecode sizing: P = B*S*R / (2*T(B)), the choice of B, and the step model with communication and
core sharing."""

import json

import pytest

from aiollm.planner.fastdecode import (
    AskCost,
    Overlap,
    TimeShared,
    balanced_context,
    balanced_seq_len,
    effective_cores,
    interpolate,
    interpolate_cost,
    overlap_loss,
    predict_step,
    read_t_of_b,
    schedule_gain,
    size,
)

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


TRIP = {8: AskCost.even(0.0007), 128: AskCost(0.0010, 0.0008, 0.0007)}


def test_step_is_the_largest_bound_with_communication_and_shared_cores():
    # B=256 pipelined on 2 R-workers: halves of 128, 64 rows per ask, 30 layers x 2 halves x 2 workers = 120 asks
    p = predict_step(CURVE, 2e-6, TRIP, n_layers=30, batch=256, kv_tokens=131072, workers=2, pipelined=True, cores=2)
    ask = interpolate_cost(TRIP, 64)
    assert ask.s == pytest.approx(interpolate({8: 0.00035, 128: 0.0010}, 64))
    s_part, attention = 2 * interpolate(CURVE, 128), 2e-6 * 131072
    # pipelined, the S-worker's timeline holds its CPU and the waits measured where it binds
    s_worker, r_each = s_part + 120 * (ask.s + ask.wait), attention / 2 + 60 * ask.r
    assert p.communication == pytest.approx(120 * ask.total)
    assert p.s_worker == pytest.approx(s_worker) and p.r_worker == pytest.approx(r_each)
    assert p.all_over_cores == pytest.approx((s_worker + 2 * r_each) / 2)
    assert p.step == max(p.s_worker, p.r_worker, p.chain, p.all_over_cores) == p.all_over_cores
    # a core for every process: the shared-core bound stops binding
    free = predict_step(CURVE, 2e-6, TRIP, 30, 256, 131072, 2, True, cores=16)
    assert free.step < p.step and free.step == max(free.s_worker, free.r_worker, free.chain) > free.all_over_cores
    # without the pipeline the step is one chain: the S-side work, per layer the R-side overhead and the wait, and
    # all the attention / P (the two R-workers side by side)
    serial = predict_step(CURVE, 2e-6, TRIP, 30, 256, 131072, 2, False, cores=16)
    c = TRIP[128]
    assert serial.chain == pytest.approx(CURVE[256] + 30 * (2 * c.s + c.r + c.wait) + attention / 2)
    # ...and on one core the two R-workers' work cannot run side by side
    one_core = predict_step(CURVE, 2e-6, TRIP, 30, 256, 131072, 2, False, cores=1)
    assert one_core.chain == pytest.approx(CURVE[256] + 30 * (2 * c.s + 2 * c.r + c.wait) + attention)
    # 1.5 effective cores are two slower cores: the two R-workers still attend side by side in the chain (their
    # slow-down is in R in situ), while all the work over the cores is divided by 1.5
    slower = predict_step(CURVE, 2e-6, TRIP, 30, 256, 131072, 2, False, cores=1.5)
    assert slower.chain == pytest.approx(serial.chain)
    assert slower.all_over_cores == pytest.approx((slower.s_worker + 2 * slower.r_worker) / 1.5)
    # the S-worker's CPU per KV entry the R-workers stream adds to its own work
    streamed = predict_step(CURVE, 2e-6, TRIP, 30, 256, 131072, 2, True, cores=16, s_per_token=1e-9)
    assert streamed.s_worker == pytest.approx(free.s_worker + 131072e-9)
    # R measured in situ per load: interpolated at the KV each R-worker holds, flat past the measured loads
    loaded = predict_step(CURVE, {32768: 2e-6, 65536: 3e-6}, TRIP, 30, 256, 131072, 2, True, cores=16)
    heavier = predict_step(CURVE, {32768: 2e-6, 65536: 3e-6}, TRIP, 30, 256, 262144, 2, True, cores=16)
    assert loaded.r_worker == pytest.approx(3e-6 * 65536 + 60 * ask.r)
    assert heavier.r_worker == pytest.approx(3e-6 * 131072 + 60 * ask.r)
    with pytest.raises(ValueError):
        predict_step(CURVE, 2e-6, {}, 30, 256, 1, 2, True, 2)


def test_dedicated_placement_bounds_each_side_by_its_own_cores():
    # FastDecode's placement: the S-worker on 1 core, 2 R-workers sharing 1 core of their own
    p = predict_step(CURVE, 2e-6, TRIP, 30, 256, 131072, 2, True, cores=2, r_cores=1)
    ask = interpolate_cost(TRIP, 64)
    assert p.r_worker == pytest.approx(2e-6 * 131072 + 2 * 60 * ask.r)
    assert p.s_worker == pytest.approx(2 * interpolate(CURVE, 128) + 120 * (ask.s + ask.wait))
    with pytest.raises(ValueError, match="r_cores"):
        predict_step(CURVE, 2e-6, TRIP, 30, 256, 1, 2, True, cores=2, r_cores=2)


def test_schedule_gain_needs_a_step_convex_in_w():
    # linear in W (a step is the sum of its work): holding W at the mean gains nothing
    assert schedule_gain(lambda w: 0.1 + 1e-6 * w, 128, 16, 544) == pytest.approx(1.0)
    # FastDecode's max(S-part, R-part) balanced at the life's mean W: the textbook ~25 %, less the discretisation
    knee = 128 * (16 + 544) / 2 * 1e-6

    def step(w: float) -> float:
        return max(knee, 1e-6 * w)

    assert 1.2 < schedule_gain(step, 128, 16, 544) <= 1.25
    # ...and the S that balances is the one whose mean W sits at the knee
    assert balanced_seq_len(step, 128, 16, 1024) == pytest.approx(544, abs=16)
    # a balance beyond the longest S allowed: the gain is flat at 1, and the longest S is the nearest to it
    assert balanced_seq_len(step, 128, 16, 272) == 272
    with pytest.raises(ValueError):
        schedule_gain(step, 128, 600, 544)


def test_sizing_with_communication_and_few_cores_takes_fewer_workers_than_the_formula():
    classic = size(CURVE, r_per_token=2e-6, seq_len=1024)
    few = size(CURVE, 2e-6, 1024, round_trip={1: TRIP}, n_layers=30, cores=2)
    # near-free communication on dedicated cores: back to about the formula's P
    ideal = size(
        CURVE, 2e-6, 1024, round_trip={1: {8: AskCost.even(1e-6), 128: AskCost.even(2e-6)}}, n_layers=30, cores=64
    )
    # with the step model B is the batch with the most predicted tokens/s (at its best P), not the S-part's knee
    assert classic.batch == 256 and few.batch == ideal.batch == 512

    def best_rate(b: int, trip: dict, cores: float) -> float:
        return max(b / predict_step(CURVE, 2e-6, trip, 30, b, b * 512, p, True, cores).step for p in range(1, 67))

    assert best_rate(512, TRIP, 2) > 1.05 * best_rate(256, TRIP, 2) > 1.05 * best_rate(64, TRIP, 2)
    assert few.tokens_per_s == pytest.approx(best_rate(512, TRIP, 2), rel=0.05)
    assert "predicted tokens/s at the best P and mode per measured batch" in few.explain()
    assert few.workers < ideal.workers and ideal.workers >= 512 * 1024 * 2e-6 / (2 * CURVE[512]) - 1
    assert few.predicted_step > ideal.predicted_step > 0
    # a latency target keeps its B: the largest whose T(B) meets it (T(112) = 0.02 + 48/192 * 0.04 = 0.030)
    assert size(CURVE, 2e-6, 1024, 0.030, round_trip={1: TRIP}, n_layers=30, cores=2).batch == 112
    assert "C(8)=0.70 ms" in few.explain() and "all work / cores" in few.explain()
    # a slower round trip measured with 2 R-workers (processes competing for cores) prices P >= 2 with it
    dearer = size(
        CURVE,
        2e-6,
        1024,
        round_trip={1: TRIP, 2: {8: AskCost.even(0.005), 128: AskCost.even(0.01)}},
        n_layers=30,
        cores=2,
    )
    assert dearer.workers == 1 and "with 2 R-worker(s): C(8)=5.00 ms" in dearer.explain()
    with pytest.raises(ValueError, match="n_layers"):
        size(CURVE, 2e-6, 1024, round_trip={1: TRIP})


def test_sizing_weighs_the_time_shared_mode():
    pipelined = size(CURVE, 2e-6, 1024, round_trip={1: TRIP}, n_layers=30, cores=2)
    assert pipelined.mode == "pipelined" and "time-shared" not in pipelined.explain()
    # the S-part on every core at a quarter of the one-thread T(B), cheap unpipelined asks: the time-shared step
    # (S-part, then attention) beats the pipelined one, and is the one reported at the chosen P
    fast = TimeShared({b: t / 4 for b, t in CURVE.items()}, {1: {8: AskCost.even(1e-5), 128: AskCost.even(2e-5)}})
    shared = size(CURVE, 2e-6, 1024, round_trip={1: TRIP}, n_layers=30, cores=2, time_shared=fast)
    expected = predict_step(
        fast.t_of_b, 2e-6, fast.round_trip[1], 30, shared.batch, shared.batch * 512, shared.workers, False, 2
    )
    assert shared.mode == "time-shared" and shared.predicted_step == pytest.approx(expected.step)
    assert shared.predicted_step < pipelined.predicted_step
    assert " time-shared:" in shared.explain() and "time-shared, the faster mode there" in shared.explain()
    # the S-part no faster on every core and dear unpipelined asks: the pipeline stays
    slow = TimeShared(dict(CURVE), {1: {8: AskCost.even(0.005), 128: AskCost.even(0.01)}})
    kept = size(CURVE, 2e-6, 1024, round_trip={1: TRIP}, n_layers=30, cores=2, time_shared=slow)
    assert kept.mode == "pipelined" and kept.predicted_step == pytest.approx(pipelined.predicted_step)


def test_overlap_loss_is_the_idle_beyond_the_bounds_per_lesser_side():
    # S-worker 100 ms CPU + 10 ms waits, one R-worker 80 ms, 2 cores: the bounds say 110 ms; measured 134 ms
    assert overlap_loss(0.134, 0.100, [0.080], cores=2, waits=0.010) == pytest.approx(0.024 / 0.080)
    # two R-workers on 2 cores: all the work over the cores (0.1 + 0.01 + 0.16) / 2 = 135 ms binds
    assert overlap_loss(0.150, 0.100, [0.080, 0.080], cores=2, waits=0.010) == pytest.approx(0.015 / 0.080)
    # a step at or under its bounds (noise) overlaps perfectly; no worse than no overlap at all
    assert overlap_loss(0.105, 0.100, [0.080], 2, 0.010) == 0.0
    assert overlap_loss(0.500, 0.100, [0.080], 2, 0.010) == 1.0
    with pytest.raises(ValueError):
        overlap_loss(0.1, 0.0, [0.08], 2, 0.0)


def test_pipelined_step_charges_the_overlap_loss_most_where_the_sides_balance():
    def at(kv: float, overlap: float = 0.0, pipelined: bool = True):
        return predict_step(CURVE, 2e-6, TRIP, 30, 256, kv, 1, pipelined, cores=2, overlap=overlap)

    # B=256 pipelined on one R-worker: the S-worker's CPU is fixed (no streamed-KV term), R grows with the KV
    s_cpu = at(0).s_cpu
    assert s_cpu == pytest.approx(2 * interpolate(CURVE, 128) + 60 * interpolate_cost(TRIP, 128).s)
    balanced = balanced_context(lambda c: at(256 * c), 4096)
    r_ask = 60 * interpolate_cost(TRIP, 128).r
    # the R-worker's work 2e-6 * 256 * c + its asks equals the S-worker's CPU at c = (s_cpu - r_ask) / 5.12e-4
    assert balanced == pytest.approx((s_cpu - r_ask) / (2e-6 * 256), abs=16)
    for kv, lesser in ((256 * balanced, min(s_cpu, at(256 * balanced).r_worker)), (256 * 16, at(256 * 16).r_worker)):
        plain, lossy = at(kv), at(kv, 0.3)
        assert lossy.idle == pytest.approx(0.3 * lesser)
        assert lossy.step == pytest.approx(max(plain.s_worker, plain.r_worker, plain.all_over_cores) + 0.3 * lesser)
        assert "overlap loss" in lossy.explain() and "overlap loss" not in plain.explain()
    # relative to the step, the loss is largest where the sides balance (0.3 of the CPU, 0.22 of a step that also
    # holds 42 ms of measured waits) and small where S dominates
    assert (
        at(256 * balanced, 0.3).idle / at(256 * balanced).step > 0.2 > 0.1 > at(256 * 16, 0.3).idle / at(256 * 16).step
    )
    # one mini-batch has nothing to overlap
    assert at(256 * balanced, 0.3, pipelined=False) == at(256 * balanced, pipelined=False)
    with pytest.raises(ValueError, match="overlap"):
        at(0, 1.5)


def test_overlap_measured_on_a_probe_reproduces_that_probe():
    # a synthetic probe: the model's own CPU for the probe's configuration, and a step 20 % of the lesser side above
    # its bounds; the loss fitted from it prices that configuration at exactly the measured step
    probe = predict_step(CURVE, 2e-6, TRIP, 30, 128, 128 * 600, 1, True, cores=2)
    asks = 30 * 2
    waits = asks * interpolate_cost(TRIP, 64).wait
    measured = max(probe.s_worker, probe.r_worker, probe.all_over_cores) + 0.2 * min(probe.s_cpu, probe.r_worker)
    loss = overlap_loss(measured, probe.s_cpu, [probe.r_worker], 2, waits)
    assert loss == pytest.approx(0.2)
    assert predict_step(CURVE, 2e-6, TRIP, 30, 128, 128 * 600, 1, True, 2, overlap=loss).step == pytest.approx(measured)


def test_sizing_prices_the_measured_overlap_loss():
    plain = size(CURVE, 2e-6, 1024, round_trip={1: TRIP}, n_layers=30, cores=2)
    probe = Overlap(0.25, 128, 640, 1, 0.2, 0.15, 0.14, 0.002)
    lossy = size(CURVE, 2e-6, 1024, round_trip={1: TRIP}, n_layers=30, cores=2, overlap={1: probe})
    expected = predict_step(CURVE, 2e-6, TRIP, 30, lossy.batch, lossy.batch * 512, lossy.workers, True, 2, overlap=0.25)
    assert lossy.predicted_step == pytest.approx(expected.step) and lossy.predicted_step > plain.predicted_step
    assert "overlap loss 0.250 of the lesser side" in lossy.explain() and "B=128 at context 640" in lossy.explain()


def test_effective_cores_is_the_median_of_paired_rounds():
    # round 1: two copies at once each take 1.25x the alone time -> 2 / 1.25 = 1.6 cores; round 2 disturbed (2x ->
    # 1.0); round 3 no slow-down (capped at 2): the median ignores the disturbed round
    alone = [0.2, 0.2, 0.3]
    together = [[0.25, 0.25], [0.4, 0.4], [0.28, 0.30]]
    assert effective_cores(2, alone, together) == pytest.approx(1.6)
    assert effective_cores(2, [0.2], [[0.2, 0.6]]) == pytest.approx(2 * 0.2 / 0.4)
    with pytest.raises(ValueError):
        effective_cores(2, [0.2], [[0.2]])
    with pytest.raises(ValueError):
        effective_cores(2, [0.2, 0.2], [[0.2, 0.2]])
