"""What the FastDecode integration tests share: a tiny random Llama written once per module (its loaded model and
its directory, which the R-worker processes read their KV shape from) and R-worker processes started from it."""
import asyncio

import pytest

from aiollm.deploy.graph import Graph
from aiollm.model.loader import load
from aiollm.testing.tiny_llama import write_hf_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_fastdecode")
    write_hf_dir(directory, init_std=0.2)
    return load(directory), directory


async def start_r_workers(graph: Graph, directory, n: int, kv_memory: str, kv_dtype: str = "fp32") -> list[str]:
    """`n` R-worker processes (`python -m aiollm.node --role r-worker`, one attention thread each) on `graph`."""
    args = ("--model", str(directory), "--kv-dtype", kv_dtype, "--kv-memory", kv_memory, "--threads", "1")
    nodes = await asyncio.gather(*(graph.start_node("r-worker", process=True, args=args) for _ in range(n)))
    return [node.actors["r-worker"] for node in nodes]
