"""Role `decode`: one DistServe decode instance (continuous batching, pulls KV from prefill instances)."""
from __future__ import annotations

import argparse
import asyncio

from aiollm.actors.node import Node
from aiollm.workers.decode import DecodeConfig, DecodeInstance
from aiollm.workers.roles.common import actor_arg, load_model, model_args


def add_arguments(parser) -> None:
    actor_arg(parser, "decode")
    model_args(parser)
    parser.add_argument("--kv-blocks", type=int, default=2048, help="KV pool of decoding sequences, in blocks")
    parser.add_argument("--max-running", type=int, default=128, help="most sequences per decode step")


async def start(node: Node, args: argparse.Namespace) -> dict[str, str]:
    config = DecodeConfig(kv_blocks=args.kv_blocks, block_size=args.block_size, kv_dtype=args.kv_dtype,
                          max_running=args.max_running, attn_threads=args.threads)
    model = await asyncio.to_thread(load_model, args)
    ref = await node.spawn(DecodeInstance(model, config), args.actor)
    return {args.actor: ref.url}
