"""Role `s-worker`: FastDecode's S-worker, the model's dense layers batched over its R-workers' attention."""

from __future__ import annotations

import asyncio

from aiollm.actors.node import Node
from aiollm.deploy.roles import Wiring, add_model_flags, r_worker_urls, spec_flag
from aiollm.deploy.roles.common import load_model
from aiollm.deploy.spec import ClusterSpec
from aiollm.sched.sls import SLSConfig
from aiollm.serving.fastdecode.s_worker import SWorker, SWorkerConfig


def add_arguments(parser) -> None:
    add_model_flags(parser, "s_worker")
    parser.add_argument(
        "--r-workers",
        type=r_worker_urls,
        required=True,
        metavar="URLS",
        help="R-worker nodes or actors, comma-separated: tcp://127.0.0.1:7001[/r-worker],...",
    )
    spec_flag(parser, "--max-batch", "s_worker.max_batch", "B: most sequences decoding at once")
    spec_flag(
        parser,
        "--no-pipeline",
        "s_worker.pipeline",
        "one mini-batch per step (no S/R overlap)",
        action="store_const",
        const=False,
    )
    spec_flag(parser, "--pipeline-min-batch", "s_worker.pipeline_min_batch", "two mini-batches only from this batch")
    spec_flag(
        parser, "--sls-interval", "s_worker.sls_interval", "F: a micro-batch every F steps (the schedule); 0: off"
    )
    spec_flag(parser, "--sls-seq-len", "s_worker.sls_seq_len", "S the schedule plans for (prompt + completion)")
    spec_flag(parser, "--max-prefill-tokens", "s_worker.max_prefill_tokens", "prompt tokens per prefill batch")
    spec_flag(parser, "--staging-tokens", "s_worker.staging_tokens", "prompt KV waiting to be pulled, in tokens")


def s_worker_config(spec: ClusterSpec) -> SWorkerConfig:
    s = spec.s_worker
    schedule = (
        SLSConfig(batch_size=s.max_batch, seq_len=s.sls_seq_len, interval=s.sls_interval) if s.sls_interval else None
    )
    return SWorkerConfig(
        max_batch=s.max_batch,
        pipeline=s.pipeline,
        pipeline_min_batch=s.pipeline_min_batch,
        schedule=schedule,
        max_prefill_tokens=s.max_prefill_tokens,
        staging_tokens=s.staging_tokens,
    )


async def start(node: Node, spec: ClusterSpec, wiring: Wiring) -> dict[str, str]:
    config = s_worker_config(spec)
    model = await asyncio.to_thread(load_model, spec, spec.s_worker.threads)
    ref = await node.spawn(SWorker(model, list(wiring.r_workers), config), "s-worker")
    return {"s-worker": ref.url}
