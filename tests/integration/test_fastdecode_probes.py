"""The FastDecode sizing's probes (aiollm.calibrate.fastdecode_probes) against real R-worker processes on a tiny
random Llama: each reads what its docstring says from real decode steps, gives every sequence back, and refuses
bad arguments. The figures are timings, so the tests check their kind and bounds, not their values."""

import asyncio
import math

import pytest

from aiollm.calibrate.fastdecode_probes import long_step_terms, measure_overlap, probe_step, step_costs
from aiollm.deploy.graph import Graph
from aiollm.planner.fastdecode import AskCost, Overlap, interpolate_cost
from aiollm.serving.fastdecode.messages import GetRLoad
from aiollm.testing.fastdecode_cluster import start_r_workers

CONTEXTS = [5, 9, 30, 17, 40, 3]


async def _nothing_held(graph: Graph, urls: list[str]) -> bool:
    """Whether every R-worker has given back all it held (the probes' S-workers release with a tell)."""
    for _ in range(100):
        loads = await asyncio.gather(*(graph.ref(u).ask(GetRLoad()) for u in urls))
        if all(load.sequences == 0 and load.blocks_used == 0 for load in loads):
            return True
        await asyncio.sleep(0.05)
    return False


def _is_cost(cost: AskCost) -> bool:
    return all(math.isfinite(x) and x >= 0 for x in (cost.s, cost.r, cost.wait))


@pytest.mark.slow
async def test_probes_read_real_steps_and_give_every_sequence_back(tiny_fd):
    model, directory = tiny_fd
    layers = model.config.n_layers
    async with Graph() as graph:
        urls = await start_r_workers(graph, directory, 2, "8MiB", kv_dtype="fp16")
        steps = 3
        for pipeline in (False, True):
            step, s_cpu, r_cpus, held = await probe_step(
                graph.driver, model, urls, CONTEXTS, steps, pipeline, name=f"probe-{pipeline}"
            )
            assert step > 0 and s_cpu > 0
            assert len(r_cpus) == 2 and all(r > 0 for r in r_cpus)
            # the KV entries a timed step attends over: every context plus the tokens decoded so far
            assert sum(CONTEXTS) < held <= sum(CONTEXTS) + len(CONTEXTS) * (steps + 3)
            assert await _nothing_held(graph, urls)

        costs = await step_costs(graph.driver, model, urls, [1, 2], {4: 0.001}, 1e-7, steps=2)
        assert set(costs) == {1, 2} and all(_is_cost(c) for c in costs.values())
        piped = await step_costs(graph.driver, model, urls, [1], {4: 0.001}, 1e-7, steps=2, pipeline=True)
        assert set(piped) == {1} and _is_cost(piped[1])
        assert await _nothing_held(graph, urls)

        # with `floor` the kernel alone bounds R in situ from below; the S-worker's CPU per entry is never negative
        floor = 1.0  # a second per entry: no real probe reads more
        r_situ, s_per_entry = await long_step_terms(graph.driver, model, urls, 4, 32, {4: 0.001}, costs, floor)
        assert r_situ == floor and s_per_entry >= 0
        r_situ, s_per_entry = await long_step_terms(
            graph.driver, model, urls, 4, 32, {4: 0.001}, costs, 1e-9, floor=False, repeats=2
        )
        assert math.isfinite(r_situ) and r_situ > 0 and s_per_entry >= 0

        overlap = await measure_overlap(graph.driver, model, urls[:1], 4, 24, piped, cores=2.0, steps=3)
        assert isinstance(overlap, Overlap)
        assert 0 <= overlap.loss <= 1 and (overlap.batch, overlap.context, overlap.workers) == (4, 24, 1)
        assert overlap.step > 0 and overlap.s_cpu > 0 and overlap.r_cpu > 0
        # one R-worker, 4 sequences: two mini-batches of 2 rows, the waits per ask scaled from the 1-row cost
        assert overlap.waits == pytest.approx(layers * 2 * interpolate_cost(piped, 2).wait)
        assert await _nothing_held(graph, urls)

        with pytest.raises(ValueError, match="repeats must be >= 1"):
            await long_step_terms(graph.driver, model, urls, 4, 32, {4: 0.001}, costs, 1e-9, repeats=0)


def test_t_of_b_and_r_are_measured_on_the_roles_threads(tiny_fd, monkeypatch):
    """The S-part on the S-worker role's torch threads and R on the R-worker role's attention threads (1 each by
    default), whatever this process uses otherwise: on torch's default the sizing would price a 2-thread S-part."""
    import torch

    from aiollm.calibrate import fastdecode_probes
    from aiollm.kv.pool import KVPool

    model, _ = tiny_fd
    monkeypatch.setattr(fastdecode_probes, "_load_model", lambda name: (torch, model))
    seen = {"s": set(), "r": set()}
    logits = model.logits
    monkeypatch.setattr(model, "logits", lambda h: (seen["s"].add(torch.get_num_threads()), logits(h))[1])
    attend = KVPool.attend
    monkeypatch.setattr(
        KVPool,
        "attend",
        lambda self, *a, n_threads=None, **k: (seen["r"].add(n_threads), attend(self, *a, n_threads=n_threads, **k))[1],
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        curve = fastdecode_probes.measure_t_of_b("tiny", [1, 4], repeats=2)
        assert set(curve) == {1, 4} and all(t > 0 for t in curve.values())
        assert torch.get_num_threads() == 2  # given back
        assert fastdecode_probes.measure_r("tiny", 40, batch=2, repeats=1) > 0
    finally:
        torch.set_num_threads(before)
    assert seen == {"s": {fastdecode_probes.S_THREADS}, "r": {fastdecode_probes.R_THREADS}}
