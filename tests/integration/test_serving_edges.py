"""Serving edges: the colocated engine behind the same frontend, overload answered with 429, and a
prefilled KV whose lease expires because nobody pulls it."""

import asyncio

import openai

from aiollm.actors import Actor, Node, NodeConfig, handler
from aiollm.frontend.app import Frontend, FrontendConfig, start_server
from aiollm.model.engine import generate
from aiollm.model.sampling import SamplingParams
from aiollm.serving.backend import ModelInfo
from aiollm.serving.colocated import ColocatedEngine, EngineConfig
from aiollm.serving.distserve.controller import ControllerConfig
from aiollm.serving.distserve.messages import KVLost, Prefill, Prefilled, Sampling
from aiollm.serving.distserve.prefill import PrefillConfig, PrefillInstance
from aiollm.testing.serving_cluster import SECRET, cluster


async def test_colocated_engine_serves_the_same_tokens_and_frees_cancelled_kv(tiny):
    tok = tiny.tokenizer
    ref = generate(tiny, [tok.encode("The quick brown fox")], SamplingParams(max_tokens=10))[0]
    engine = ColocatedEngine(tiny, EngineConfig(kv_blocks=64))
    await engine.start()
    frontend = Frontend(engine, tok, ModelInfo("tiny", tiny.config.max_context), FrontendConfig(port=0))
    server, task, port = await start_server(frontend.app, "127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="t", max_retries=0)
    try:
        out = await client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=10, temperature=0)
        assert out.choices[0].text == ref.text
        stream = await client.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=240,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            assert engine.kv_blocks_used > 0
            break
        await stream.close()
        for _ in range(250):
            if engine.kv_blocks_used == 0:
                break
            await asyncio.sleep(0.02)
        assert engine.kv_blocks_used == 0
    finally:
        await client.close()
        server.should_exit = True
        await task
        await engine.stop()


async def test_full_controller_queue_answers_429_and_loses_nothing_else(tiny):
    config = ControllerConfig(max_waiting=2, prefill_queue_limit=1)
    async with cluster(tiny, controller=config) as c:
        results = await asyncio.gather(
            *(
                c.client.completions.create(
                    model="tiny", prompt="def add(a, b):", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
                )
                for _ in range(12)
            ),
            return_exceptions=True,
        )
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        served = [r for r in results if not isinstance(r, Exception)]
        assert refused and served and len(refused) + len(served) == 12
        assert all(r.usage.completion_tokens == 6 for r in served)
        assert c.kv_blocks_used() == 0 and not c.controller._requests


class _Inbox(Actor):
    """Stands in for a controller: keeps what the prefill instance tells it."""

    def __init__(self):
        self.got = []

    @handler(Prefilled)
    async def on_prefilled(self, msg):
        self.got.append(msg)

    @handler(KVLost)
    async def on_lost(self, msg):
        self.got.append(msg)


async def test_unpulled_kv_is_freed_when_its_lease_expires(tiny):
    async with Node(NodeConfig(secret=SECRET)) as node:
        await node.start()
        prefill = PrefillInstance(tiny, PrefillConfig(kv_blocks=8, lease_s=0.3))
        ref = await node.spawn(prefill, "prefill0")
        inbox = _Inbox()
        inbox_ref = await node.spawn(inbox, "inbox")
        sampling = Sampling.of(SamplingParams(max_tokens=8, ignore_eos=True))
        await ref.tell(Prefill("r1", tiny.tokenizer.encode("The quick brown fox"), sampling, inbox_ref))
        for _ in range(200):
            if inbox.got:
                break
            await asyncio.sleep(0.01)
        assert isinstance(inbox.got[0], Prefilled) and prefill.cache.used_blocks > 0
        for _ in range(300):
            if len(inbox.got) == 2:
                break
            await asyncio.sleep(0.01)
        assert isinstance(inbox.got[1], KVLost) and inbox.got[1].request_id == "r1"
        assert prefill.cache.used_blocks == 0
