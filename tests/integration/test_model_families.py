"""Each supported family (Llama 3 with llama3 RoPE scaling, Qwen2 with q/k/v biases, Qwen3 with q/k norms,
Mistral with a sliding window shorter than the sequences), as a tiny random model transformers saves as a sharded
HF directory: fp32 greedy tokens equal transformers' over 4 prompts x 32 tokens through the colocated engine,
DistServe (prefill instance -> decode instance), DistServe with an offloaded decode instance (decode S-part,
attention on an R-worker process) and the FastDecode S-worker over the same R-worker."""

import asyncio
import dataclasses

import pytest
import torch

from aiollm.actors import NodeConfig
from aiollm.deploy.graph import Graph
from aiollm.model.engine import generate
from aiollm.model.llama import LlamaModel
from aiollm.model.loader import load
from aiollm.model.sampling import SamplingParams
from aiollm.serving.backend import GenerateRequest
from aiollm.serving.distserve.client import ClusterClient
from aiollm.serving.fastdecode.s_worker import SWorker, SWorkerConfig
from aiollm.testing.fastdecode_cluster import start_r_workers
from aiollm.testing.serving_cluster import SECRET, cluster
from aiollm.testing.tiny_families import FAMILIES, write_family_dir

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "naïve café jumps over the lazy dog"]
MAX_TOKENS = 32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(family, loaded model, its directory, the prompts' ids, transformers' greedy tokens)."""
    directory = tmp_path_factory.mktemp(request.param)
    hf = write_family_dir(directory, request.param)
    assert (directory / "model.safetensors.index.json").is_file()
    model = load(directory)
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    with torch.no_grad():
        expected = [
            hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, eos_token_id=None, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    return request.param, model, directory, prompts, expected


async def _tokens(client: ClusterClient, prompts) -> list[list[int]]:
    async def one(i: int) -> list[int]:
        out = []
        async for delta in client.submit(GenerateRequest(f"req-{i}", tuple(prompts[i]), GREEDY)):
            out += delta.token_ids
        return out

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def test_colocated_greedy_tokens_equal_transformers(family):
    name, model, _, prompts, expected = family
    assert [c.token_ids for c in generate(model, prompts, GREEDY)] == expected
    if name == "mistral":  # the window matters here: attending to every token gives other tokens
        assert model.config.sliding_window < min(len(p) for p in prompts) + MAX_TOKENS
        whole = LlamaModel(
            dataclasses.replace(model.config, sliding_window=None), model.weights, model.tokenizer, model.dtype
        )
        assert [c.token_ids for c in generate(whole, prompts, GREEDY)] != expected


@pytest.mark.slow
async def test_distserve_offloaded_and_s_worker_tokens_equal_transformers(family):
    _, model, directory, prompts, expected = family
    texts = [model.tokenizer.decode(t) for t in expected]
    async with Graph(NodeConfig(secret=SECRET)) as graph:
        urls = await start_r_workers(graph, directory, 1, "4MiB")
        for r_workers in (None, [urls]):  # prefill instance -> decode instance, or its S-part + the R-worker
            async with cluster(model, r_workers=r_workers) as c:
                outs = await asyncio.gather(
                    *(
                        c.client.completions.create(
                            model="tiny",
                            prompt=p,
                            max_tokens=MAX_TOKENS,
                            temperature=0,
                            extra_body={"ignore_eos": True},
                        )
                        for p in prompts
                    )
                )
                assert [o.choices[0].text for o in outs] == texts, f"r_workers={r_workers}"
        s = await graph.driver.spawn(SWorker(model, urls, SWorkerConfig(max_batch=4)), "s")
        client = ClusterClient(s.url)
        await graph.driver.spawn(client, "client")
        assert await _tokens(client, prompts) == expected
