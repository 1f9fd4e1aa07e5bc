"""measure_overlap's rebalancing (aiollm.calibrate.fastdecode_probes), on a stand-in for probe_step whose CPU
figures follow the context: the loss is read where the measured sides meet, not where the model expected them to."""

from types import SimpleNamespace

import pytest

from aiollm.calibrate import fastdecode_probes
from aiollm.planner.fastdecode import AskCost

LAYERS = 10
COSTS = {4: AskCost(s=0.0001, r=0.0002, wait=0.0)}
FIXED = LAYERS * 2 * COSTS[4].r  # the R-worker's CPU for its 20 asks


@pytest.fixture
def probes(monkeypatch):
    """probe_step stand-in: S-worker 50 ms of CPU whatever the context, the R-worker its asks plus 0.1 ms per
    context entry, the step the larger side plus 20 % of the lesser where they are within 15 % (a poor overlap)."""
    seen = []

    async def fake_probe_step(driver, model, r_workers, context_lens, steps, pipeline, name):
        context = context_lens[0]
        seen.append(context)
        s_cpu, r_cpu = 0.050, FIXED + 1e-4 * context
        balanced = max(s_cpu, r_cpu) / min(s_cpu, r_cpu) <= 1.15
        step = max(s_cpu, r_cpu) + (0.2 * min(s_cpu, r_cpu) if balanced else 0.0)
        return step, s_cpu, [r_cpu], float(sum(context_lens))

    monkeypatch.setattr(fastdecode_probes, "probe_step", fake_probe_step)
    return seen


MODEL = SimpleNamespace(config=SimpleNamespace(n_layers=LAYERS))


async def _overlap(context: int, longest: int):
    return await fastdecode_probes.measure_overlap(None, MODEL, ["r0"], 8, context, COSTS, cores=2.0, longest=longest)


async def test_an_unbalanced_probe_is_followed_by_one_where_the_measured_sides_meet(probes):
    overlap = await _overlap(1000, longest=2000)  # R 104 ms against S 50 ms: R-bound, no loss visible
    # the sides meet where FIXED + 1e-4 * c = 50 ms: c = 1000 * (0.050 - FIXED) / (0.104 - FIXED) = 460
    assert probes == [1000, 460]
    assert overlap.context == 460 and overlap.loss == pytest.approx(0.2)


async def test_a_balanced_probe_is_kept_and_rebalancing_is_optional(probes):
    assert (await _overlap(460, longest=2000)).context == 460
    assert probes == [460]
    overlap = await _overlap(1000, longest=0)
    assert probes == [460, 1000] and overlap.context == 1000 and overlap.loss == 0.0


async def test_the_second_probe_stays_within_the_contexts_allowed(probes):
    overlap = await _overlap(100, longest=300)  # S-bound: the sides would meet at 460, past `longest`
    assert probes == [100, 300]
    assert overlap.context == 300  # the better balanced of the two (R 34 ms against S 50)
