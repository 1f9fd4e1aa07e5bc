"""Accelerators and clusters: the published peak numbers the planner sizes against.

Why peak numbers: the derived latency profiles (H100, H200, and A100 for models DistServe never
profiled) start from the datasheet FLOP/s and memory bandwidth and apply efficiency factors that
`latency.py` states and calibrates; the memory check needs the HBM size. Figures are dense bf16 FLOP/s
(no sparsity) for the SXM parts, from NVIDIA's A100 (2021), H100 (2023) and H200 (2024) datasheets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aiollm.errors import require_positive


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator's datasheet numbers."""

    name: str
    # Dense bf16 tensor-core FLOP/s.
    peak_flops: float
    # HBM bandwidth, bytes/s.
    mem_bandwidth: float
    # HBM capacity, bytes.
    mem_bytes: float
    # NVLink bandwidth per GPU per direction, bytes/s (the KV transfer inside a node).
    nvlink_bandwidth: float

    def __post_init__(self) -> None:
        require_positive(self, "peak_flops", "mem_bandwidth", "mem_bytes", "nvlink_bandwidth")


GB = 1e9
GPUS: dict[str, GPUSpec] = {
    spec.name: spec
    for spec in (
        GPUSpec("A100-80G", peak_flops=312e12, mem_bandwidth=2.039e12, mem_bytes=80 * GB, nvlink_bandwidth=300 * GB),
        GPUSpec("H100-80G", peak_flops=989e12, mem_bandwidth=3.35e12, mem_bytes=80 * GB, nvlink_bandwidth=450 * GB),
        GPUSpec("H200", peak_flops=989e12, mem_bandwidth=4.8e12, mem_bytes=141 * GB, nvlink_bandwidth=450 * GB),
    )
}

# Cross-node bandwidth per node when the cluster string does not give one: DistServe's testbed had
# 25 Gbit/s between nodes (the reason for its low-affinity algorithm); H100/H200 nodes usually have
# 8x400 Gbit/s InfiniBand.
DEFAULT_INTER_NODE_BANDWIDTH = {"A100-80G": 25e9 / 8, "H100-80G": 8 * 400e9 / 8, "H200": 8 * 400e9 / 8}


def get_gpu(name: str) -> GPUSpec:
    """The spec for `name` (case-insensitive)."""
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")


@dataclass(frozen=True)
class ClusterSpec:
    """N nodes of M identical GPUs."""

    nodes: int
    gpus_per_node: int
    gpu: GPUSpec
    # Bytes/s between two nodes (KV transfer when prefill and decode sit on different nodes).
    inter_node_bandwidth: float

    def __post_init__(self) -> None:
        require_positive(self, "nodes", "gpus_per_node", "inter_node_bandwidth")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}x{self.gpu.name}"


_CLUSTER_RE = re.compile(r"^(\d+)x(\d+)x([A-Za-z0-9-]+?)(?:@(\d+(?:\.\d+)?)gbps)?$", re.IGNORECASE)


def parse_cluster(text: str) -> ClusterSpec:
    """Parse `NODESxGPUSxGPU[@GBITgbps]`, e.g. `1x4xA100-80G` or `4x8xH100-80G@400gbps`."""
    match = _CLUSTER_RE.match(text.strip())
    if not match:
        raise ValueError(f"cluster {text!r}: expected NODESxGPUSxGPU[@Ngbps], e.g. 1x4xA100-80G")
    nodes, per_node, gpu_name, gbps = match.groups()
    gpu = get_gpu(gpu_name)
    bandwidth = float(gbps) * 1e9 / 8 if gbps else DEFAULT_INTER_NODE_BANDWIDTH[gpu.name]
    return ClusterSpec(int(nodes), int(per_node), gpu, bandwidth)
