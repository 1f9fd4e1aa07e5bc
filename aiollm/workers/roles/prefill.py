"""Role `prefill`: one DistServe prefill instance (FCFS queue, batches to L_m, holds KV until pulled)."""
from __future__ import annotations

import argparse
import asyncio

from aiollm.actors.node import Node
from aiollm.workers.prefill import PrefillConfig, PrefillInstance
from aiollm.workers.roles.common import actor_arg, load_model, model_args


def add_arguments(parser) -> None:
    actor_arg(parser, "prefill")
    model_args(parser)
    parser.add_argument("--kv-blocks", type=int, default=1024, help="KV buffer of prefilled sequences, in blocks")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="L_m: prompt tokens per prefill batch")
    parser.add_argument("--lease", type=float, default=60.0, help="seconds a prefilled KV waits for its pull")


async def start(node: Node, args: argparse.Namespace) -> dict[str, str]:
    config = PrefillConfig(kv_blocks=args.kv_blocks, block_size=args.block_size, kv_dtype=args.kv_dtype,
                           max_batch_tokens=args.max_batch_tokens, lease_s=args.lease)
    model = await asyncio.to_thread(load_model, args)
    ref = await node.spawn(PrefillInstance(model, config), args.actor)
    return {args.actor: ref.url}
