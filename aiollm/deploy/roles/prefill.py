"""Role `prefill`: one DistServe prefill instance (FCFS queue, batches to L_m, holds KV until pulled)."""

from __future__ import annotations

import asyncio

from aiollm.actors.node import Node
from aiollm.deploy.roles import (
    Wiring,
    add_actor,
    add_join,
    add_model_flags,
    add_prefix_cache_flag,
    add_step_log,
    spec_flag,
)
from aiollm.deploy.roles.common import load_model, served_name
from aiollm.deploy.spec import ClusterSpec
from aiollm.log import get_logger
from aiollm.serving.distserve.controller import register_with
from aiollm.serving.distserve.prefill import PrefillConfig, PrefillInstance


def add_arguments(parser) -> None:
    add_actor(parser, "prefill")
    add_model_flags(parser, "prefill")
    add_prefix_cache_flag(parser)
    add_join(parser)
    add_step_log(parser)
    spec_flag(parser, "--kv-blocks", "prefill.kv_blocks", "KV buffer of prefilled sequences, in blocks")
    spec_flag(
        parser,
        "--max-batch-tokens",
        "prefill.max_batch_tokens",
        "L_m: prompt tokens per prefill batch; 0: the compute-bound length from this machine's profile "
        "(`python -m aiollm.plan profile`), 512 without one",
    )
    spec_flag(parser, "--lease", "prefill.lease_seconds", "seconds a prefilled KV waits for its pull")


def compute_bound_length(model: str) -> int:
    """L_m measured on this machine (the local latency profile), or 512 when there is none for `model`."""
    from aiollm.planner.profiles import load_local

    log = get_logger("roles.prefill")
    try:
        profile = load_local().get(served_name(model))
    except FileNotFoundError:
        profile = None
    if profile is None:
        log.info("no local latency profile: L_m = 512", model=model)
        return 512
    length = profile.compute_bound_length()
    log.info("L_m from the local latency profile", model=model, tokens=length)
    return length


def prefill_config(spec: ClusterSpec, step_log: str = "") -> PrefillConfig:
    p = spec.prefill
    return PrefillConfig(
        kv_blocks=p.kv_blocks,
        block_size=spec.kv.block_size,
        kv_dtype=spec.kv.dtype,
        max_batch_tokens=p.max_batch_tokens or compute_bound_length(spec.model.name),
        lease_s=p.lease_seconds,
        step_log=step_log,
        prefix_cache=spec.kv.prefix_cache,
        turns=spec.turns,
    )


async def start(node: Node, spec: ClusterSpec, wiring: Wiring) -> dict[str, str]:
    actor = wiring.actor or "prefill"
    config = prefill_config(spec, wiring.step_log)
    model = await asyncio.to_thread(load_model, spec, spec.prefill.threads)
    ref = await node.spawn(PrefillInstance(model, config), actor)
    if wiring.controller:
        await register_with(node, wiring.controller, actor, "prefill", ref)
    return {actor: ref.url}
