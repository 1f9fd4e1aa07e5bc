"""Role `decode`: one DistServe decode instance (continuous batching, pulls KV from prefill instances).

Colocated by default (KV and attention in this process); with `--r-workers` offloaded: the S-part here, each
sequence's KV and attention on one of those FastDecode R-workers, which pull it straight from the prefill
instance (aiollm.serving.fastdecode.offloaded_executor).
"""

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
    r_worker_urls,
    spec_flag,
)
from aiollm.deploy.roles.common import load_model
from aiollm.deploy.spec import ClusterSpec
from aiollm.serving.distserve.controller import register_with
from aiollm.serving.distserve.decode import DecodeConfig, DecodeInstance
from aiollm.serving.fastdecode.offloaded_executor import OffloadedConfig, OffloadedExecutor


def add_arguments(parser) -> None:
    add_actor(parser, "decode")
    add_model_flags(parser, "decode")
    add_prefix_cache_flag(parser)
    add_join(parser)
    add_step_log(parser)
    spec_flag(parser, "--kv-blocks", "decode.kv_blocks", "KV pool of decoding sequences, in blocks (colocated)")
    spec_flag(parser, "--max-running", "decode.max_running", "most sequences per decode step")
    parser.add_argument(
        "--r-workers",
        type=r_worker_urls,
        default=(),
        metavar="URLS",
        help="offload attention to these R-workers: tcp://127.0.0.1:7001[/r-worker],... (their block size and KV "
        "dtype must match); empty: colocated",
    )
    spec_flag(
        parser,
        "--pipeline-min-batch",
        "decode.pipeline_min_batch",
        "offloaded: two overlapping mini-batches from this batch size on",
    )


def decode_config(spec: ClusterSpec, step_log: str = "") -> DecodeConfig:
    d = spec.decode
    return DecodeConfig(
        kv_blocks=d.kv_blocks,
        block_size=spec.kv.block_size,
        kv_dtype=spec.kv.dtype,
        max_running=d.max_running,
        attn_threads=d.threads,
        step_log=step_log,
        prefix_cache=spec.kv.prefix_cache,
        turns=spec.turns,
    )


async def start(node: Node, spec: ClusterSpec, wiring: Wiring) -> dict[str, str]:
    actor = wiring.actor or "decode"
    model = await asyncio.to_thread(load_model, spec, spec.decode.threads)
    executor = None
    if wiring.r_workers:
        offload = OffloadedConfig(pipeline_min_batch=spec.decode.pipeline_min_batch)
        executor = await OffloadedExecutor.connect(
            node, list(wiring.r_workers), model, spec.kv.block_size, spec.kv.dtype, offload
        )
    ref = await node.spawn(DecodeInstance(model, decode_config(spec, wiring.step_log), executor), actor)
    if wiring.controller:
        await register_with(node, wiring.controller, actor, "decode", ref)
    return {actor: ref.url}
