"""Placement: the memory constraint, a tiny case worked out by hand, and clear errors."""

import numpy as np
import pytest

from aiollm.planner.goodput import SLO, InfeasibleSLO, goodput
from aiollm.planner.hardware import ClusterSpec, GPUSpec, get_gpu
from aiollm.planner.latency import LatencyModel, StackLatency
from aiollm.planner.models import ModelSpec, get_model
from aiollm.planner.placement import PlacementConfig, Planner
from aiollm.planner.profiles import derive
from aiollm.planner.simulator import InstanceSpec, SimConfig
from aiollm.planner.workload import LengthSample, Workload

# A 1 GB model on 10 GB GPUs: memory never binds in the hand-worked case.
TINY = ModelSpec("tiny", 4, 512, 8, 8, 1024, 1000, 2048, gated_mlp=False, tied_embeddings=True)
GPU = GPUSpec("toy", 1e15, 1e12, 10e9, 100e9)
# tp=1: prefill 1 ms/token, decode step 10 ms + 1 ms per sequence; tp=2: 0.6 ms/token, 8 ms + 0.8 ms/seq.
TOY = LatencyModel(
    "tiny",
    "toy",
    "hand-made",
    {
        1: StackLatency((0.0, 0.001, 0.0), (0.010, 0.001, 0.0)),
        2: StackLatency((0.0, 0.0006, 0.0), (0.008, 0.0008, 0.0)),
    },
)


def constant_workload(n=200):
    lengths = LengthSample("const", np.full(n, 100), np.full(n, 11))
    return Workload.build(lengths, n, process="constant")


def test_phase_goodputs_match_hand_computation():
    """Prefill tp=1: one 100-token prompt takes 0.1 s, so ~10 req/s. Decode tp=1: a request stays 10 steps;
    TPOT <= 20 ms allows a batch of 10 (10 ms + 10 x 1 ms), 10 sequences per 0.2 s = 50 req/s."""
    slo = SLO(ttft=0.2, tpot=0.02, attainment=0.9)
    w = constant_workload()
    pre = SimConfig(TOY, "prefill-only", InstanceSpec(1), InstanceSpec(1), 10**6, 10**6, 1)
    dec = SimConfig(TOY, "decode-only", InstanceSpec(1), InstanceSpec(1), 10**6, 10**6, 1)
    assert goodput(pre, w, slo, "prefill", rel_tol=0.01) == pytest.approx(10.0, rel=0.05)
    assert goodput(dec, w, slo, "decode", rel_tol=0.01) == pytest.approx(50.0, rel=0.12)


def test_high_affinity_picks_the_hand_worked_best():
    """2 nodes x 2 GPUs, pp=1. Per GPU: prefill tp=1 10, tp=2 16.7/2; decode tp=1 50, tp=2 ~75/2.
    Best use of 4 GPUs: 3 prefill tp=1 (30 req/s) + 1 decode tp=1 (50 req/s) -> 30 req/s, 7.5 per GPU;
    every other mix is lower (e.g. tp=2 prefill + 2 tp=1 decode: 16.7 req/s)."""
    cluster = ClusterSpec(2, 2, GPU, 100e9)
    cfg = PlacementConfig(TINY, cluster, TOY, SLO(0.2, 0.02, 0.9), "high", max_pp=1, rel_tol=0.02, verify=False)
    plan = Planner(cfg, constant_workload()).plan()
    assert (plan.prefill.tp, plan.prefill.pp, plan.prefill.count) == (1, 1, 3)
    assert (plan.decode.tp, plan.decode.pp, plan.decode.count) == (1, 1, 1)
    assert plan.system_goodput == pytest.approx(30.0, rel=0.06)
    assert plan.gpus_used == 4


def test_target_rate_sizes_replicas_and_flags_what_does_not_fit():
    cluster = ClusterSpec(2, 2, GPU, 100e9)
    base = dict(
        model=TINY,
        cluster=cluster,
        latency=TOY,
        slo=SLO(0.2, 0.02, 0.9),
        affinity="high",
        max_pp=1,
        rel_tol=0.02,
        verify=False,
    )
    plan = Planner(PlacementConfig(**base, rate=15.0), constant_workload()).plan()
    assert (
        plan.fits
        and plan.prefill.count * plan.prefill.goodput >= 15.0
        and plan.decode.count * plan.decode.goodput >= 15.0
    )
    plan = Planner(PlacementConfig(**base, rate=100.0), constant_workload()).plan()
    assert not plan.fits and plan.gpus_used > 4


def test_memory_constraint_excludes_instances_that_cannot_hold_the_weights():
    model = get_model("opt-66b")  # 131 GB of fp16 weights
    cfg = PlacementConfig(
        model, ClusterSpec(1, 8, get_gpu("A100-80G"), 3e9), derive(model, get_gpu("A100-80G")), SLO(0.4, 0.1)
    )
    planner = Planner(cfg, constant_workload())
    configs = planner.instance_configs(8, 8)
    assert (1, 1) not in configs and planner.kv_tokens(1, 1) == 0
    assert (2, 1) in configs
    for tp, pp in configs:
        assert tp * pp * 80e9 * 0.9 - model.param_bytes >= planner.kv_tokens(tp, pp) * model.kv_bytes_per_token


def test_model_too_big_for_the_cluster_is_a_clear_error():
    model = get_model("opt-175b")
    cfg = PlacementConfig(
        model, ClusterSpec(1, 4, get_gpu("A100-80G"), 3e9), derive(model, get_gpu("A100-80G")), SLO(0.4, 0.1)
    )
    with pytest.raises(ValueError, match="needs at least 5 A100-80G GPUs"):
        Planner(cfg, constant_workload()).plan()


def test_impossible_slo_is_a_clear_error():
    cfg = PlacementConfig(
        TINY, ClusterSpec(1, 2, GPU, 100e9), TOY, SLO(0.01, 0.02, 0.9), "high", max_pp=1, verify=False
    )
    with pytest.raises(InfeasibleSLO, match="prefill"):
        Planner(cfg, constant_workload(60)).plan()


@pytest.mark.parametrize(
    "bad", [dict(ttft=0, tpot=0.1), dict(ttft=0.1, tpot=0.1, attainment=1.5), dict(ttft=0.1, tpot=0.1, mode="p99")]
)
def test_bad_slo_values(bad):
    with pytest.raises(ValueError, match="SLO"):
        SLO(**bad)
