"""Role `prefill`: one DistServe prefill instance (FCFS queue, batches to L_m, holds KV until pulled)."""

from __future__ import annotations

import argparse
import asyncio

from aiollm.actors.node import Node
from aiollm.deploy.roles.common import actor_arg, load_model, model_args
from aiollm.log import get_logger
from aiollm.serving.distserve.controller import register_with
from aiollm.serving.distserve.prefill import PrefillConfig, PrefillInstance


def _log():
    """Bound at call time, after the process configured logging (a module-level logger would not be)."""
    return get_logger("roles.prefill")


def add_arguments(parser) -> None:
    actor_arg(parser, "prefill")
    model_args(parser)
    parser.add_argument(
        "--controller",
        default="",
        help="join this running controller (tcp://host:port/controller) under the --actor name, "
        "e.g. when restarting a lost instance; empty: the controller is given this instance",
    )
    parser.add_argument("--step-log", default="", help="record each batch/step's timing here (JSON lines)")
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV buffer of prefilled sequences, in blocks")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        help="L_m: prompt tokens per prefill batch (default: the compute-bound length from this "
        "machine's profile, `python -m aiollm.plan profile`; 512 without one)",
    )
    parser.add_argument("--lease", type=float, default=60.0, help="seconds a prefilled KV waits for its pull")


def compute_bound_length(model: str) -> int:
    """L_m measured on this machine (the local latency profile), or 512 when there is none for `model`."""
    from aiollm.deploy.roles.common import served_name
    from aiollm.planner.profiles import load_local

    try:
        profile = load_local().get(served_name(model))
    except FileNotFoundError:
        profile = None
    if profile is None:
        _log().info("no local latency profile: L_m = 512", model=model)
        return 512
    length = profile.compute_bound_length()
    _log().info("L_m from the local latency profile", model=model, tokens=length)
    return length


async def start(node: Node, args: argparse.Namespace) -> dict[str, str]:
    config = PrefillConfig(
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        kv_dtype=args.kv_dtype,
        max_batch_tokens=args.max_batch_tokens or compute_bound_length(args.model),
        lease_s=args.lease,
        step_log=args.step_log,
    )
    model = await asyncio.to_thread(load_model, args)
    ref = await node.spawn(PrefillInstance(model, config), args.actor)
    if args.controller:
        await register_with(node, args.controller, args.actor, "prefill", ref)
    return {args.actor: ref.url}
