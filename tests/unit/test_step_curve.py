"""The step curve the schedule trace places S by (aiollm.planner.fastdecode.fit_step_curve and
aiollm.calibrate.fastdecode_probes.step_curve): the fit recovers a known bent line from its points, the S it
balances moves past a rounded corner, and the probes visit the contexts from the middle outwards."""

from types import SimpleNamespace

import numpy as np
import pytest

from aiollm.calibrate import fastdecode_probes
from aiollm.planner.fastdecode import StepCurve, balanced_seq_len, fit_step_curve, schedule_gain

# a step shaped like a small CPU host's at B=128: ~190 ms while the S-part binds, ~0.9 us per entry once the R-part does
SHARP = StepCurve(base=0.190, slope_before=40e-9, slope_after=900e-9, knee=120_000)
CONTEXTS = [160, 480, 800, 1120, 1440, 1760, 2080, 2400]


def _points(curve: StepCurve, noise: float = 0.0) -> list[tuple[float, float]]:
    rng = np.random.default_rng(0)
    return [(128.0 * c, curve(128.0 * c) * (1 + noise * rng.standard_normal())) for c in CONTEXTS]


def test_the_curve_is_two_lines_joined_at_the_knee():
    assert SHARP(0) == pytest.approx(0.190)
    assert SHARP(120_000) == pytest.approx(0.190 + 40e-9 * 120_000)
    assert SHARP(220_000) == pytest.approx(SHARP(120_000) + 900e-9 * 100_000)
    rounded = StepCurve(0.190, 40e-9, 900e-9, 120_000, width=20_000)
    # the rounding costs most at the knee (slope change x width x ln 2) and fades on both sides
    assert rounded(120_000) - SHARP(120_000) == pytest.approx(860e-9 * 20_000 * np.log(2))
    assert rounded(300_000) == pytest.approx(SHARP(300_000), rel=1e-4)
    assert rounded(0) == pytest.approx(SHARP(0), rel=1e-3)


@pytest.mark.parametrize("width", [0.0, 15_000.0])
def test_the_fit_recovers_a_known_curve(width):
    truth = StepCurve(0.190, 40e-9, 900e-9, 120_000, width)
    fit = fit_step_curve(_points(truth))
    assert fit.knee == pytest.approx(120_000, rel=0.03)
    assert fit.slope_after == pytest.approx(900e-9, rel=0.03)
    assert fit.base == pytest.approx(0.190, rel=0.01)
    # points 41 K entries apart do not see a corner's rounding much narrower than that
    assert fit.width == pytest.approx(width, abs=6_000)
    assert fit.residual < 2e-4


def test_a_noisy_fit_still_places_s_near_the_truth():
    truth = StepCurve(0.190, 40e-9, 900e-9, 120_000, 15_000)
    fit = fit_step_curve(_points(truth, noise=0.01))
    best = balanced_seq_len(truth, 128, 16, 2560)
    chosen = balanced_seq_len(fit, 128, 16, 2560)
    # whatever S the noisy fit picks gains within 1 % of the best on the true curve
    assert schedule_gain(truth, 128, 16, chosen) > schedule_gain(truth, 128, 16, best) - 0.01
    assert 0 < fit.residual < 0.01 * 0.2  # eight points, five coefficients: the fit takes up some of the noise


def test_a_rounded_corner_moves_the_balanced_s_past_it():
    # sharp: the life's mean W at the knee (S ~ 2 * knee / B); rounded, holding W at the knee would pay the rounding
    sharp = balanced_seq_len(SHARP, 128, 16, 4096)
    assert sharp == pytest.approx(2 * 120_000 / 128, abs=48)
    rounded = balanced_seq_len(StepCurve(0.190, 40e-9, 900e-9, 120_000, 30_000), 128, 16, 4096)
    assert rounded > sharp + 200


def test_the_fit_needs_five_valid_points():
    with pytest.raises(ValueError, match="at least 5"):
        fit_step_curve(_points(SHARP)[:4])
    with pytest.raises(ValueError, match="steps > 0"):
        fit_step_curve([(0.0, 0.1), (1.0, 0.1), (2.0, 0.0), (3.0, 0.2), (4.0, 0.3)])


async def test_the_probes_go_from_the_middle_outwards_and_back_keeping_the_fastest(monkeypatch):
    seen = []

    async def fake_probe_step(driver, model, r_workers, context_lens, steps, pipeline, name):
        assert pipeline
        c = context_lens[0]
        seen.append(c)
        w = float(sum(context_lens))
        # the first pass is disturbed at 800 (a slow phase), the second at 2080
        slow = 1.5 if (c == 800 and len(seen) <= len(CONTEXTS)) or (c == 2080 and len(seen) > len(CONTEXTS)) else 1
        return SHARP(w) * slow, 0.0, [0.0], w

    monkeypatch.setattr(fastdecode_probes, "probe_step", fake_probe_step)
    model = SimpleNamespace(config=SimpleNamespace(n_layers=30))
    points = await fastdecode_probes.step_curve(None, model, ["r0"], 128, CONTEXTS)
    assert set(seen[:2]) == {1120, 1440} and set(seen[6:8]) == {160, 2400}
    assert seen[8:] == seen[:8][::-1]
    assert points == sorted((128.0 * c, SHARP(128.0 * c)) for c in CONTEXTS)
    with pytest.raises(ValueError, match="passes"):
        await fastdecode_probes.step_curve(None, model, ["r0"], 128, CONTEXTS, passes=0)
