"""A DistServe cluster for tests: n prefill + m decode instances, controller and frontend, each on its own
node in this process, talking over TCP on 127.0.0.1 (the full codec, KV tensors included), with the
HTTP frontend on a free port and an openai client pointed at it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import openai

from aiollm.actors import Node, NodeConfig
from aiollm.frontend.app import Frontend, FrontendConfig, start_server
from aiollm.serving.backend import ModelInfo
from aiollm.serving.distserve.client import ClusterClient
from aiollm.serving.distserve.controller import Controller, ControllerConfig
from aiollm.serving.distserve.decode import DecodeConfig, DecodeInstance
from aiollm.serving.distserve.prefill import PrefillConfig, PrefillInstance
from aiollm.serving.fastdecode.offloaded_executor import OffloadedExecutor

SECRET = b"integration-test-secret-0123456789"


@dataclass
class Cluster:
    client: openai.AsyncOpenAI
    port: int
    prefills: list[PrefillInstance]
    decodes: list[DecodeInstance]
    controller: Controller
    frontend: Frontend
    nodes: dict[str, Node]

    def kv_blocks_used(self) -> int:
        return sum(p.cache.used_blocks for p in self.prefills) + sum(d.executor.used_blocks for d in self.decodes)


@contextlib.asynccontextmanager
async def cluster(
    model,
    n_prefill: int = 1,
    n_decode: int = 1,
    prefill: PrefillConfig = PrefillConfig(kv_blocks=64),
    decode: DecodeConfig = DecodeConfig(kv_blocks=128),
    controller: ControllerConfig = ControllerConfig(),
    name: str = "tiny",
    r_workers: list[list[str]] | None = None,
):
    """`r_workers[i]`: R-worker URLs that make decode instance i offloaded (they must accept SECRET)."""
    nodes: dict[str, Node] = {}
    server = task = None
    client = None
    try:

        async def node(label: str) -> Node:
            n = Node(NodeConfig(secret=SECRET))
            await n.start(["tcp://127.0.0.1:0"])
            nodes[label] = n
            return n

        prefills, decodes, urls_p, urls_d = [], [], {}, {}
        for i in range(n_prefill):
            actor = PrefillInstance(model, prefill)
            urls_p[f"prefill{i}"] = (await (await node(f"prefill{i}")).spawn(actor, f"prefill{i}")).url
            prefills.append(actor)
        for i in range(n_decode):
            decode_node = await node(f"decode{i}")
            executor = (
                None
                if r_workers is None
                else await OffloadedExecutor.connect(
                    decode_node, r_workers[i], model, decode.block_size, decode.kv_dtype
                )
            )
            actor = DecodeInstance(model, decode, executor)
            urls_d[f"decode{i}"] = (await decode_node.spawn(actor, f"decode{i}")).url
            decodes.append(actor)
        ctrl = Controller(urls_p, urls_d, controller)
        ctrl_url = (await (await node("controller")).spawn(ctrl, "controller")).url
        backend = ClusterClient(ctrl_url)
        await (await node("frontend")).spawn(backend, "frontend")
        frontend = Frontend(
            backend,
            model.tokenizer,
            ModelInfo(name, model.config.max_context),
            FrontendConfig(port=0, vocab_size=model.config.vocab),
        )
        server, task, port = await start_server(frontend.app, "127.0.0.1", 0)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="test", max_retries=0, timeout=120)
        yield Cluster(client, port, prefills, decodes, ctrl, frontend, nodes)
    finally:
        if client is not None:
            await client.close()
        if server is not None:
            server.should_exit = True
            await task
        for n in reversed(list(nodes.values())):
            await n.stop()
