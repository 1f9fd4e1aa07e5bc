"""Whether each process of a cluster spec fits its memory budget, checked from the model's config before
anything starts (no weights are read).

A prefill instance holds the weights and its KV buffer (`prefill.kv_blocks`); a decode instance the weights and,
with attention in-process, its KV pool (`decode.kv_blocks`; offloaded, the KV is on its R-workers); the colocated
engine the weights and `decode.kv_blocks`; an S-worker the weights and its staging KV (`s_worker.staging_tokens`);
an R-worker no weights, only KV (`r_worker.kv_memory`, which must hold one block). A role's `memory` of ""
is not checked.

    check_memory(spec)                       # every process `serve` starts
    check_memory(spec, ["decode"], offloaded=True)   # one role started by hand
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from aiollm.deploy.spec import ClusterSpec, SpecError
from aiollm.errors import ModelFormatError
from aiollm.model.config import ModelConfig
from aiollm.model.size import kv_bytes_per_block, weights_bytes
from aiollm.sizes import format_size, parse_size


@dataclass(frozen=True)
class ProcessMemory:
    """What one process of a role holds, against its budget."""

    # the spec field holding the budget, e.g. "decode.memory"
    field: str
    # the budget in bytes (0: unchecked)
    budget: int
    # bytes of weights (0: an R-worker, which holds none)
    weights: int
    # KV blocks it allocates, and bytes of one
    kv_blocks: int
    block_bytes: int

    @property
    def needed(self) -> int:
        return self.weights + self.kv_blocks * self.block_bytes


def serve_roles(spec: ClusterSpec) -> list[str]:
    """The roles whose processes `serve` starts for `spec` that hold weights or KV."""
    if spec.colocated:
        return ["decode"]
    return ["prefill", "decode"] + (["r_worker"] if spec.decode.r_workers else [])


def processes(
    spec: ClusterSpec, config: ModelConfig, roles: Iterable[str] | None = None, *, offloaded: bool | None = None
) -> list[ProcessMemory]:
    """The memory of each kind of process `roles` start (default: `serve_roles`); `offloaded`: whether a decode
    instance's attention is on R-workers (default: `decode.r_workers` > 0)."""
    offloaded = bool(spec.decode.r_workers) if offloaded is None else offloaded
    block = kv_bytes_per_block(config, spec.kv.dtype, spec.kv.block_size)
    weights = weights_bytes(config, spec.model.dtype)
    out = []
    for role in serve_roles(spec) if roles is None else roles:
        if role == "prefill":
            blocks = spec.prefill.kv_blocks
        elif role == "decode":
            blocks = 0 if offloaded and not spec.colocated else spec.decode.kv_blocks
        elif role == "s_worker":
            blocks = -(-spec.s_worker.staging_tokens // spec.kv.block_size)
        elif role == "r_worker":
            out.append(ProcessMemory("r_worker.kv_memory", spec.r_worker.kv_memory_bytes, 0, 1, block))
            continue
        else:
            raise ValueError(f"role {role!r}: expected prefill, decode, s_worker or r_worker")
        out.append(ProcessMemory(f"{role}.memory", _budget(getattr(spec, role).memory), weights, blocks, block))
    return out


def check_memory(
    spec: ClusterSpec,
    roles: Iterable[str] | None = None,
    *,
    offloaded: bool | None = None,
    config: ModelConfig | None = None,
) -> None:
    """SpecError naming the first role whose budget cannot hold its weights and KV (see `processes`), before
    anything starts. Reads the model's config (not its weights) only when one of those roles has a budget."""
    roles = serve_roles(spec) if roles is None else list(roles)
    if not any(spec.r_worker.kv_memory if role == "r_worker" else getattr(spec, role).memory for role in roles):
        return
    config = config or _model_config(spec)
    for process in processes(spec, config, roles, offloaded=offloaded):
        if process.budget and process.needed > process.budget:
            raise SpecError(f"{process.field}: {format_size(process.budget)} cannot hold {_needs(spec, process)}")


def _needs(spec: ClusterSpec, p: ProcessMemory) -> str:
    """What a process holds, in words: 'the weights (0.5 GiB, fp32) and 4096 KV blocks of 16 tokens (...)'."""
    kv = spec.kv
    if not p.weights:
        return f"one KV block of {kv.block_size} tokens ({format_size(p.block_bytes)}, {kv.dtype})"
    weights = f"the weights ({format_size(p.weights)}, {spec.model.dtype})"
    if not p.kv_blocks:
        return f"{weights}; its KV is on the R-workers"
    kv_bytes = format_size(p.kv_blocks * p.block_bytes)
    blocks = f"{p.kv_blocks} KV blocks of {kv.block_size} tokens ({kv_bytes}, {kv.dtype})"
    room = (p.budget - p.weights) // p.block_bytes
    return f"{weights} and {blocks}" + (f"; {room} KV blocks fit beside the weights" if room > 0 else "")


def _budget(text: str) -> int:
    return parse_size(text) if text else 0


def _model_config(spec: ClusterSpec) -> ModelConfig:
    try:
        return _load_config(spec.model.name)
    except (FileNotFoundError, ModelFormatError) as exc:
        raise SpecError(f"model.name: {exc}") from None


@functools.lru_cache(maxsize=4)
def _load_config(name: str) -> ModelConfig:
    from aiollm.model.loader import load_config

    return load_config(name)
