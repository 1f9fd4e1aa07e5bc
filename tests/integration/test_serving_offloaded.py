"""DistServe serving with an offloaded decode instance: the S-part in the decode instance, attention on two
FastDecode R-worker processes (`python -m aiollm.node --role r-worker`, fp32 KV) that pull each sequence's KV
straight from the prefill instance; driven through the official openai client."""

import asyncio

import pytest

from aiollm.actors import NodeConfig
from aiollm.deploy.graph import Graph
from aiollm.model.engine import generate
from aiollm.model.loader import load
from aiollm.model.sampling import SamplingParams
from aiollm.serving.fastdecode.messages import GetRLoad
from aiollm.testing.serving_cluster import SECRET, cluster
from aiollm.testing.tiny_llama import write_hf_dir

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "naïve café jumps over the lazy dog"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model and its directory (the R-worker processes read its config from there)."""
    directory = tmp_path_factory.mktemp("tiny-offloaded")
    write_hf_dir(directory, init_std=0.2)
    return load(str(directory)), directory


async def _r_workers(graph: Graph, directory, n: int = 2) -> list[str]:
    args = ("--model", str(directory), "--kv-dtype", "fp32", "--block-size", "16", "--kv-memory", "4MiB")
    nodes = await asyncio.gather(*(graph.start_node("r-worker", process=True, args=args) for _ in range(n)))
    return [node.actors["r-worker"] for node in nodes]


async def _blocks_used(graph: Graph, urls: list[str]) -> list[int]:
    return [load.blocks_used for load in await asyncio.gather(*(graph.ref(u).ask(GetRLoad()) for u in urls))]


async def _wait_until(check, timeout=10.0) -> bool:
    for _ in range(int(timeout / 0.05)):
        if await check():
            return True
        await asyncio.sleep(0.05)
    return await check()


@pytest.mark.slow
async def test_offloaded_decode_tokens_equal_colocated_generate(tiny):
    model, directory = tiny
    tok = model.tokenizer
    refs = generate(model, [tok.encode(p) for p in PROMPTS], SamplingParams(max_tokens=24, ignore_eos=True))
    async with Graph(NodeConfig(secret=SECRET)) as graph:
        urls = await _r_workers(graph, directory)
        async with cluster(model, r_workers=[urls]) as c:
            executor = c.decodes[0].executor
            peak = [0, 0]

            async def sample():
                while True:
                    peak[:] = [max(p, b) for p, b in zip(peak, executor.booked)]
                    await asyncio.sleep(0.005)

            sampler = asyncio.create_task(sample())
            try:  # all at once: one batch spread over both R-workers
                outs = await asyncio.gather(
                    *(
                        c.client.completions.create(
                            model="tiny", prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
                        )
                        for p in PROMPTS
                    )
                )
            finally:
                sampler.cancel()
            assert [o.choices[0].text for o in outs] == [r.text for r in refs]
            assert all(o.usage.completion_tokens == 24 for o in outs)
            assert all(p > 0 for p in peak)  # both R-workers held sequences
            stream = await c.client.completions.create(
                model="tiny",
                prompt=PROMPTS[1],
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            assert "".join([chunk.choices[0].text async for chunk in stream]) == refs[1].text
            assert c.decodes[0].finished == len(PROMPTS) + 1
            assert await _wait_until(lambda: _all_free(graph, urls, c))


async def _all_free(graph, urls, c) -> bool:
    return sum(await _blocks_used(graph, urls)) == 0 and c.kv_blocks_used() == 0 and not c.controller._requests


@pytest.mark.slow
async def test_cancelled_stream_frees_its_blocks_on_the_r_worker(tiny):
    model, directory = tiny
    async with Graph(NodeConfig(secret=SECRET)) as graph:
        urls = await _r_workers(graph, directory)
        async with cluster(model, r_workers=[urls]) as c:
            stream = await c.client.completions.create(
                model="tiny",
                prompt="The quick brown fox",
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 3:
                    break
            used = await _blocks_used(graph, urls)
            assert sorted(used) == [0, -(-(len(model.tokenizer.encode("The quick brown fox")) + 200) // 16)]
            await stream.close()
            assert await _wait_until(lambda: _all_free(graph, urls, c))
            assert c.decodes[0].finished == 0
