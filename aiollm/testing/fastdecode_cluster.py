"""R-worker processes for the FastDecode integration tests, started from a model directory."""

import asyncio

from aiollm.deploy.graph import Graph


async def start_r_workers(graph: Graph, directory, n: int, kv_memory: str, kv_dtype: str = "fp32") -> list[str]:
    """`n` R-worker processes (`python -m aiollm.node --role r-worker`, one attention thread each) on `graph`."""
    args = ("--model", str(directory), "--kv-dtype", kv_dtype, "--kv-memory", kv_memory, "--threads", "1")
    nodes = await asyncio.gather(*(graph.start_node("r-worker", process=True, args=args) for _ in range(n)))
    return [node.actors["r-worker"] for node in nodes]
