"""Role `decode`: one DistServe decode instance (continuous batching, pulls KV from prefill instances).

Colocated by default (KV and attention in this process); with `--r-workers` offloaded: the S-part
here, each sequence's KV and attention on one of those FastDecode R-workers, which pull it straight
from the prefill instance (aiollm.serving.fastdecode.offloaded_executor).
"""

from __future__ import annotations

import argparse
import asyncio

from aiollm.actors.node import Node
from aiollm.deploy.roles.common import actor_arg, load_model, model_args
from aiollm.serving.distserve.controller import register_with
from aiollm.serving.distserve.decode import DecodeConfig, DecodeInstance
from aiollm.serving.fastdecode.offloaded_executor import OffloadedConfig, OffloadedExecutor
from aiollm.serving.fastdecode.s_worker import r_worker_urls


def add_arguments(parser) -> None:
    actor_arg(parser, "decode")
    model_args(parser)
    parser.add_argument(
        "--controller",
        default="",
        help="join this running controller (tcp://host:port/controller) under the --actor name, "
        "e.g. when restarting a lost instance; empty: the controller is given this instance",
    )
    parser.add_argument("--step-log", default="", help="record each batch/step's timing here (JSON lines)")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=2048,
        help="KV pool of decoding sequences, in blocks (colocated; offloaded: the R-workers' budgets)",
    )
    parser.add_argument("--max-running", type=int, default=128, help="most sequences per decode step")
    parser.add_argument(
        "--r-workers",
        default="",
        help="offload attention to these R-workers: tcp://127.0.0.1:7001[/r-worker],... "
        "(their --block-size and --kv-dtype must match); empty: colocated",
    )
    parser.add_argument(
        "--pipeline-min-batch",
        type=int,
        default=64,
        help="offloaded: split steps into two overlapping mini-batches from this batch on",
    )


async def start(node: Node, args: argparse.Namespace) -> dict[str, str]:
    config = DecodeConfig(
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        kv_dtype=args.kv_dtype,
        max_running=args.max_running,
        attn_threads=args.threads,
        step_log=args.step_log,
    )
    model = await asyncio.to_thread(load_model, args)
    executor = None
    if args.r_workers:
        offload = OffloadedConfig(pipeline_min_batch=args.pipeline_min_batch)
        executor = await OffloadedExecutor.connect(
            node, r_worker_urls(args.r_workers), model, args.block_size, args.kv_dtype, offload
        )
    ref = await node.spawn(DecodeInstance(model, config, executor), args.actor)
    if args.controller:
        await register_with(node, args.controller, args.actor, "decode", ref)
    return {args.actor: ref.url}
