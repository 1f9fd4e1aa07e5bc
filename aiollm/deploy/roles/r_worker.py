"""Role `r-worker`: one FastDecode R-worker, holding sequences' KV in its RAM and running their attention."""

from __future__ import annotations

from aiollm.actors.node import Node
from aiollm.deploy.roles import Wiring, add_model_flags, spec_flag
from aiollm.deploy.spec import ClusterSpec
from aiollm.model.loader import load_config
from aiollm.serving.fastdecode.r_worker import RWorker


def add_arguments(parser) -> None:
    add_model_flags(parser, "r_worker", weights=False)
    spec_flag(parser, "--kv-memory", "r_worker.kv_memory", "KV budget in RAM, e.g. 8GiB (admission refuses beyond)")


async def start(node: Node, spec: ClusterSpec, wiring: Wiring) -> dict[str, str]:
    import torch

    torch.set_num_threads(1)  # torch only reshapes here; its OpenMP team must not compete with the kernel's
    config = load_config(spec.model.name)
    ref = await node.spawn(
        RWorker,
        "r-worker",
        n_layers=config.n_layers,
        n_kv_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        kv_memory=spec.r_worker.kv_memory_bytes,
        kv_dtype=spec.kv.dtype,
        block_size=spec.kv.block_size,
        threads=spec.r_worker.threads,
        window=config.sliding_window or 0,
    )
    return {"r-worker": ref.url}
