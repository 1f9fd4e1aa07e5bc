"""The latency model: least-squares fits reproduce their points, DistServe's profile converts and scales."""

import json
from pathlib import Path

import numpy as np
import pytest

import aiollm.planner
from aiollm.planner.hardware import get_gpu
from aiollm.planner.latency import (
    DEFAULT_TP_SERIAL,
    LatencyModel,
    StackLatency,
    fit_decode,
    fit_prefill,
    fit_tp_scaling,
    piecewise,
)
from aiollm.planner.models import get_model
from aiollm.planner.profiles import (
    LOCAL_FORMAT,
    derive,
    distserve_dir,
    latency_model,
    load_distserve,
    load_local,
)


def test_prefill_fit_reproduces_its_points():
    rng = np.random.default_rng(0)
    batches = [rng.integers(1, 2048, rng.integers(1, 6)) for _ in range(12)]
    t = np.array([b.sum() for b in batches], dtype=float)
    t2 = np.array([(b.astype(float) ** 2).sum() for b in batches])
    times = 0.018 + 1.0e-4 * t + 7.0e-9 * t2
    a, b, c = fit_prefill(t, t2, times)
    assert (a, b, c) == pytest.approx((0.018, 1.0e-4, 7.0e-9), rel=1e-6)
    model = LatencyModel("m", "hw", "test", {1: StackLatency((a, b, c), (0.02, 1e-4, 6e-7))})
    for batch, expected in zip(batches, times):
        assert model.prefill_time(batch) == pytest.approx(expected, rel=1e-9)


def test_decode_fit_reproduces_noisy_points_within_noise():
    rng = np.random.default_rng(1)
    bs = rng.integers(1, 256, 40).astype(float)
    ctx = bs * rng.integers(16, 2048, 40)
    times = (0.02 + 4e-5 * bs + 6e-7 * ctx) * (1 + rng.normal(0, 0.01, 40))
    d, e, f = fit_decode(bs, ctx, times)
    predicted = d + e * bs + f * ctx
    assert np.max(np.abs(predicted / times - 1)) < 0.04
    assert min(d, e, f) >= 0


def test_fit_never_returns_negative_coefficients():
    # Points that an unconstrained fit would explain with a negative intercept.
    t = np.array([100.0, 200.0, 400.0, 800.0])
    times = np.array([0.009, 0.0195, 0.0405, 0.0825])
    a, b, c = fit_prefill(t, t**2, times)
    assert min(a, b, c) >= 0
    with pytest.raises(ValueError, match=">= 3"):
        fit_prefill([1, 2], [1, 4], [0.1, 0.2])


def test_piecewise_table_reproduces_its_points_and_overrides_the_line():
    # Decode steps of a CPU: a jump from batch 1 to 8 that one line through all points cannot follow.
    batch = [1, 2, 4, 8, 32, 32]
    base = [0.075, 0.090, 0.115, 0.180, 0.255, 0.265]
    table = piecewise(batch, base)
    assert [row[0] for row in table] == [1, 2, 4, 8]
    stack = StackLatency((0.05, 0.002, 0.0), (0.08, 0.003, 1e-6), decode_table=table)
    for b, expected in [(1, 0.075), (2, 0.090), (4, 0.115), (8, 0.180), (32, 0.260)]:  # 32: mean of two
        assert stack.decode_time(b, 0) == pytest.approx(expected)
    assert stack.decode_time(3, 1000) == pytest.approx(0.1025 + 1e-3)  # halfway, plus the fitted f term
    assert stack.decode_time(64, 0) > stack.decode_time(32, 0)  # the last segment extends
    assert stack.prefill_time(100, 0) == pytest.approx(0.25)  # no prefill table: the fitted line
    scaled = stack.scaled((1, 1, 1, 2, 2, 1))
    assert scaled.decode_time(4, 0) == pytest.approx(0.230)


def test_piecewise_treats_a_dip_as_noise():
    # 0.1 at x=2 is lifted to 0.2: flat from 1 to 2, then up to 0.3 at 3.
    assert np.ravel(piecewise([1, 2, 3], [0.2, 0.1, 0.3])) == pytest.approx([1, 0.2, 0.0, 2, 0.0, 0.1])
    with pytest.raises(ValueError, match="distinct"):
        piecewise([4, 4], [0.1, 0.2])


def test_local_profile_interpolates_its_measured_points(tmp_path):
    points = [{"batch": 1, "length": n, "seconds": s} for n, s in [(32, 0.12), (128, 0.27), (512, 1.02)]]
    decode = [{"batch": b, "context": 127, "seconds": s} for b, s in [(1, 0.075), (8, 0.19), (32, 0.26)]]
    entry = {
        "prefill": [0.05, 0.0019, 1e-7],
        "decode": [0.08, 0.003, 1e-6],
        "prefill_points": points,
        "decode_points": decode,
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": LOCAL_FORMAT, "hardware": "cpu", "models": {"smollm2": entry}}))
    model = load_local(path)["smollm2"]
    assert "interpolated" in model.source
    for p in points:
        assert model.prefill_time([p["length"]]) == pytest.approx(p["seconds"])
    for p in decode:
        assert model.decode_time(p["batch"], p["batch"] * 128) == pytest.approx(p["seconds"])


def test_tp_scaling_interpolates_missing_degrees():
    stack = StackLatency((0.02, 1e-4, 1e-8), (0.02, 5e-5, 6e-7))
    model = LatencyModel("m", "hw", "test", {1: stack}, tp_serial=(0.5, 0.0, 0.0, 0.5, 0.0, 0.0))
    s4 = model.stack(4)
    assert s4.prefill[0] == pytest.approx(0.02 * (0.5 + 0.5 / 4))
    assert s4.prefill[1] == pytest.approx(1e-4 / 4)
    with pytest.raises(ValueError):
        model.stack(0)


def test_compute_bound_length_from_coefficients():
    model = LatencyModel("m", "hw", "test", {1: StackLatency((0.018, 1e-4, 0.0), (0.02, 0.0, 0.0))})
    # t / (a + b t) = 0.9 / b  <=>  t = 9 a / b = 1620
    assert model.compute_bound_length() == 1620


@pytest.fixture(scope="module")
def distserve():
    return load_distserve()


def test_distserve_profiles_ship_inside_the_package():
    shipped = {f.name for f in distserve_dir().iterdir()}
    assert {
        "LICENSE",
        "max_num_tokens.csv",
        "profiler-a100-80g.distserve.json",
        "profiler-a100-80g.vllm.json",
    } <= shipped
    assert distserve_dir().is_relative_to(Path(aiollm.planner.__file__).parent)


def test_distserve_profile_converts_units_and_order(distserve):
    opt13 = distserve["opt-13b"].stack(1)
    assert opt13.prefill[0] == pytest.approx(0.0181025, rel=1e-4)  # 18.10 ms
    # decoding_smallbs = [a, b*context, c*batch] in ms -> (d, e*batch, f*context) in s
    assert opt13.decode == pytest.approx((0.0199347, 3.8507e-5, 6.2694e-7), rel=1e-4)
    assert opt13.decode_coeffs(200) == opt13.decode_large
    assert distserve["opt-13b"].kv_capacity[(1, 1)] == 66144


def test_tp_serial_fractions_refit_from_distserve(distserve):
    assert fit_tp_scaling(list(distserve.values())) == pytest.approx(DEFAULT_TP_SERIAL, abs=0.02)


def test_derived_a100_profile_is_close_to_distserve_measured(distserve):
    derived = derive(get_model("opt-13b"), get_gpu("A100-80G"))
    for tp in (1, 2, 4):
        ours, theirs = derived.stack(tp), distserve["opt-13b"].stack(tp)
        assert ours.prefill[0] == pytest.approx(theirs.prefill[0], rel=0.15)
        assert ours.prefill[1] == pytest.approx(theirs.prefill[1], rel=0.2)
        assert ours.decode[0] == pytest.approx(theirs.decode[0], rel=0.15)
        assert ours.decode[2] == pytest.approx(theirs.decode[2], rel=0.2)


def test_profile_selection():
    assert latency_model("opt-175b", "A100-80G").source.startswith("derived")
    h200 = latency_model("llama-2-70b", "H200")
    h100 = latency_model("llama-2-70b", "H100-80G")
    assert h200.decode_time(32, 32 * 1000, 8) < h100.decode_time(32, 32 * 1000, 8)  # more bandwidth
    with pytest.raises(ValueError, match="A100-80G only"):
        latency_model("opt-13b", "H100-80G", "distserve")
    with pytest.raises(ValueError, match="unknown model"):
        latency_model("gpt-5", "A100-80G")
