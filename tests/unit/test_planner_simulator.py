"""The simulator against hand-computed TTFT/TPOT on deterministic toy workloads."""

import math
import time
from dataclasses import replace

import numpy as np
import pytest

from aiollm.planner.latency import LatencyModel, StackLatency
from aiollm.planner.simulator import InstanceSpec, SimConfig, simulate
from aiollm.planner.workload import LengthSample, Workload

# Prefill: 1 ms per token; decode: 10 ms per step (+ f per context token where a test sets it).
TOY = LatencyModel("toy", "toy", "test", {1: StackLatency((0.0, 0.001, 0.0), (0.01, 0.0, 0.0))})


def workload(prompts, outputs, times):
    return Workload(LengthSample("toy", np.array(prompts), np.array(outputs)), np.array(times, dtype=float))


def config(mode, latency=TOY, prefill=InstanceSpec(1), kv=10**6, bandwidth=math.inf, l_m=1000, kv_bytes=1):
    return SimConfig(
        latency, mode, prefill, InstanceSpec(1), kv, kv, kv_bytes, link_bandwidth=bandwidth, max_batch_tokens=l_m
    )


def test_disaggregated_two_requests_by_hand():
    # r0 prefills 0-0.1 and decodes 10 steps 0.1-0.2; r1 queues behind it, prefills 0.1-0.2 and decodes 0.2-0.3.
    res = simulate(config("disaggregated"), workload([100, 100], [11, 11], [0.0, 0.05]), 1.0)
    assert res.ttft == pytest.approx([0.1, 0.15])
    assert res.tpot == pytest.approx([0.01, 0.01])
    assert res.finish == pytest.approx([0.2, 0.3])


def test_kv_transfer_delays_decode():
    # 100 prompt tokens x 1000 bytes at 1 MB/s = 0.1 s between first token and joining the decode batch.
    res = simulate(config("disaggregated", bandwidth=1e6, kv_bytes=1000), workload([100], [11], [0.0]), 1.0)
    assert res.ttft == pytest.approx([0.1])
    assert res.finish == pytest.approx([0.1 + 0.1 + 0.1])
    assert res.tpot == pytest.approx([0.02])


def test_fixed_overheads_delay_first_token_and_pull():
    # 0.05 s from arrival to the prefill queue (prefill 0.1 s), then a 0.03 s pull set-up + 100 tokens at 1 ms.
    cfg = replace(config("disaggregated", bandwidth=1e6, kv_bytes=1000), request_overhead=0.05, pull_overhead=0.03)
    res = simulate(cfg, workload([100], [11], [0.0]), 1.0)
    assert res.ttft == pytest.approx([0.15])
    assert res.finish == pytest.approx([0.15 + 0.03 + 0.1 + 0.1])
    with pytest.raises(ValueError, match="overhead"):
        replace(cfg, pull_overhead=-1.0)


def test_colocated_prefill_stalls_running_decodes():
    # r1's prefill (0.1-0.2) pauses r0's decoding, so r0 needs 0.1-0.3 for its 10 tokens.
    res = simulate(config("colocated"), workload([100, 100], [11, 11], [0.0, 0.05]), 1.0)
    assert res.ttft == pytest.approx([0.1, 0.15])
    assert res.tpot == pytest.approx([0.02, 0.01])


def test_prefill_batches_to_l_m_and_pipelines_stages():
    # L_m = 100 keeps each prompt alone; with pp=2 the second batch enters stage 1 at 0.05.
    w = workload([100, 100], [2, 2], [0.0, 0.0])
    res = simulate(config("prefill-only", prefill=InstanceSpec(1, 2), l_m=100), w, 1.0)
    assert res.ttft == pytest.approx([0.1, 0.15])
    # r1 and r2 queue behind r0 (0-0.1); with L_m = 200 they share one 0.2 s batch, with L_m = 100 they do not.
    w = workload([100, 100, 100], [2, 2, 2], [0.0, 0.01, 0.01])
    assert simulate(config("prefill-only", l_m=200), w, 1.0).ttft == pytest.approx([0.1, 0.29, 0.29])
    assert simulate(config("prefill-only", l_m=100), w, 1.0).ttft == pytest.approx([0.1, 0.19, 0.29])


def test_decode_memory_limit_makes_the_second_request_wait():
    # 112 KV tokens hold one 100+11 request at a time: r1 starts when r0 ends at 0.1.
    res = simulate(config("decode-only", kv=112), workload([100, 100], [11, 11], [0.0, 0.0]), 1.0)
    assert res.finish == pytest.approx([0.1, 0.2])
    assert res.tpot == pytest.approx([0.01, 0.02])


def test_step_time_grows_with_context_in_closed_form():
    lat = LatencyModel("toy", "toy", "test", {1: StackLatency((0.0, 0.001, 0.0), (0.01, 0.0, 0.001))})
    # prompt 10, 3 decode steps read 11, 12, 13 context tokens: 3 * 0.01 + 0.001 * (11 + 12 + 13)
    res = simulate(config("decode-only", latency=lat), workload([10], [4], [0.0]), 1.0)
    assert res.finish == pytest.approx([0.066])
    # r1 arrives at 0.005 and joins at the first step boundary (0.021); the shared step reads 12 + 11 tokens.
    res = simulate(config("decode-only", latency=lat), workload([10, 10], [4, 2], [0.0, 0.005]), 1.0)
    assert res.finish[1] == pytest.approx(0.021 + 0.01 + 0.001 * (12 + 11))
    assert res.finish[0] == pytest.approx(0.054 + 0.01 + 0.001 * 13)


def test_request_larger_than_the_instance_is_reported_failed():
    res = simulate(config("decode-only", kv=64), workload([100], [11], [0.0]), 1.0)
    assert math.isinf(res.finish[0])
    assert res.attainment(1.0, 1.0)["both"] == 0.0


def test_attainment_counts_both_slos():
    res = simulate(config("disaggregated"), workload([100, 100], [11, 11], [0.0, 0.05]), 1.0)
    assert res.attainment(0.12, 0.011) == {"ttft": 0.5, "tpot": 1.0, "both": 0.5}


def test_thousand_requests_simulate_fast():
    rng = np.random.default_rng(0)
    lat = LatencyModel("toy", "toy", "test", {1: StackLatency((0.015, 1e-4, 5e-9), (0.02, 1e-4, 6e-7))})
    w = Workload.build(LengthSample("r", rng.integers(10, 1500, 1000), rng.integers(2, 500, 1000)), 1000)
    start = time.perf_counter()
    res = simulate(
        SimConfig(lat, "disaggregated", InstanceSpec(1), InstanceSpec(1), 10**6, 60000, 800000, link_bandwidth=300e9),
        w,
        5.0,
    )
    assert time.perf_counter() - start < 2.0
    assert np.isfinite(res.finish).all()


def test_per_request_overheads_shift_each_arrival():
    latency = LatencyModel("toy", "cpu", "test", {1: StackLatency((0.1, 0.0, 0.0), (0.01, 0.0, 0.0))})
    workload = Workload(LengthSample("toy", np.array([10, 10]), np.array([2, 2])), np.array([0.0, 10.0]))
    base = {
        "latency": latency,
        "mode": "disaggregated",
        "prefill": InstanceSpec(1),
        "decode": InstanceSpec(1),
        "prefill_kv_tokens": 1000,
        "decode_kv_tokens": 1000,
        "kv_bytes_per_token": 1,
        "max_batch_tokens": 512,
    }
    result = simulate(SimConfig(**base, request_overheads=(0.05, 0.5)), workload, 1.0)
    assert result.ttft == pytest.approx([0.15, 0.6])  # each request's own overhead before its 0.1 s prefill
    with pytest.raises(ValueError, match="request_overhead"):
        SimConfig(**base, request_overheads=(-1.0,))


def test_controller_queue_limit_caps_prefill_batches():
    # Six 10-token prompts at t=0, 1 ms/token, L_m 1000. Without a limit: r0 alone (0-0.01), then r1-r5 in one
    # batch (0.01-0.06). With the controller's limit of 4 sent ahead: r4 and r5 wait at the controller, so the
    # second batch is r1-r3 (0.01-0.04); r0's first token frees a slot for r4, which misses that batch and runs
    # alone (0.04-0.05); r5 follows r1's first token (0.05-0.06).
    w = workload([10] * 6, [2] * 6, [0.0] * 6)
    free = simulate(config("disaggregated"), w, 1.0)
    assert free.ttft == pytest.approx([0.01] + [0.06] * 5)
    held = simulate(replace(config("disaggregated"), prefill_queue_limit=4), w, 1.0)
    assert held.ttft == pytest.approx([0.01, 0.04, 0.04, 0.04, 0.05, 0.06])
    assert held.prefilled == pytest.approx(held.ttft)  # first tokens seen at once: the batches themselves
    with pytest.raises(ValueError, match="prefill_queue_limit"):
        replace(config("disaggregated"), prefill_queue_limit=-1)


def test_first_visible_token_and_delivery_delay():
    # r0's first token is text: seen 5 ms after its prefill (0.1 s) ends. r1's first token is no text yet (a
    # detokeniser holds it): its client sees the first decode step's token, made at 0.21 (r1 prefills 0.1-0.2,
    # joins r0's batch at a step boundary), 5 ms later; TPOT counts from there, over its 10 later tokens.
    w = workload([100, 100], [11, 11], [0.0, 0.0])
    res = simulate(replace(config("disaggregated"), first_visible_steps=(0, 1), first_token_delays=(0.005,)), w, 1.0)
    assert res.ttft == pytest.approx([0.105, 0.215])
    assert res.prefilled == pytest.approx([0.1, 0.2])
    assert res.finish == pytest.approx([0.2, 0.3])
    assert res.tpot == pytest.approx([0.0095, 0.0085])
    with pytest.raises(ValueError, match="entries for 2 requests"):
        simulate(replace(config("disaggregated"), first_visible_steps=(1,)), w, 1.0)


def test_slowdown_periods_scale_step_times():
    # 10 decode steps of 10 ms, twice as slow in every second 50 ms period. r0 prefills 0-0.01, then steps end
    # at 0.02..0.05 (4), at 0.07, 0.09, 0.11 (the step crossing 0.1 still slow), then 0.12..0.14 (3): done 0.14.
    cfg = replace(config("disaggregated"), decode_slowdown=(1.0, 2.0), slowdown_period=0.05)
    res = simulate(cfg, workload([10], [11], [0.0]), 1.0)
    assert res.finish == pytest.approx([0.14])
    assert res.tpot == pytest.approx([0.013])
    slow_prefill = simulate(replace(config("disaggregated"), prefill_slowdown=(3.0,)), workload([10], [2], [0.0]), 1.0)
    assert slow_prefill.ttft == pytest.approx([0.03])
    with pytest.raises(ValueError, match="slowdown"):
        replace(cfg, decode_slowdown=(0.0,))
