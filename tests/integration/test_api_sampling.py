"""Sampling options and logprobs end to end, through every serving path with the official openai client: the
colocated engine, DistServe prefill -> decode, DistServe with the decode's attention on R-worker processes, and
the FastDecode S-worker. Each path's text and logprobs equal the reference engine's for the same options
(penalties, logit_bias, min_tokens, min_p, seed, response_format); the reference's logprobs equal a float64 log-softmax of the
model's logits; `n` with a seed is reproducible; a stream has one chunk per token."""

import contextlib
import json

import openai
import pytest
import torch

from aiollm.actors import NodeConfig
from aiollm.deploy.graph import Graph
from aiollm.frontend.app import Frontend, FrontendConfig, start_server
from aiollm.model.engine import generate
from aiollm.model.sampling import SamplingParams
from aiollm.serving.backend import ModelInfo
from aiollm.serving.colocated import ColocatedEngine, EngineConfig
from aiollm.serving.distserve.client import ClusterClient
from aiollm.serving.fastdecode.s_worker import SWorker, SWorkerConfig
from aiollm.testing.fastdecode_cluster import start_r_workers
from aiollm.testing.serving_cluster import SECRET, cluster

PROMPT = "The quick brown fox"
# greedy with every processor, and sampled with a seed
OPTIONS = [
    {
        "temperature": 0.0,
        "presence_penalty": 0.4,
        "frequency_penalty": 0.3,
        "logit_bias": {"5": 3.0, "17": -2.0},
        "extra_body": {"repetition_penalty": 1.3, "min_tokens": 4},
    },
    {"temperature": 0.9, "seed": 7, "presence_penalty": 0.5, "extra_body": {"min_p": 0.02, "top_k": 40}},
]

# response_format on the tiny model: an enum and any JSON end within a few tokens; an object is cut by max_tokens
STRUCTURED = [
    (
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"enum": ["yes", "no"]}}},
        {"json_schema": '{"enum":["yes","no"]}'},
    ),
    ({"type": "json_object"}, {"json_object": True}),
    (
        {
            "type": "json_schema",
            "json_schema": {"name": "o", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}}},
        },
        {"json_schema": '{"type":"object","properties":{"ok":{"type":"boolean"}}}'},
    ),
]


def _params(option: dict, max_tokens: int, logprobs: int) -> SamplingParams:
    extra = option.get("extra_body", {})
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=option["temperature"],
        seed=option.get("seed"),
        presence_penalty=option.get("presence_penalty", 0.0),
        frequency_penalty=option.get("frequency_penalty", 0.0),
        repetition_penalty=extra.get("repetition_penalty", 1.0),
        min_tokens=extra.get("min_tokens", 0),
        min_p=extra.get("min_p", 0.0),
        top_k=extra.get("top_k", 0),
        logit_bias=tuple((int(t), b) for t, b in option.get("logit_bias", {}).items()),
        logprobs=logprobs,
    )


def test_reference_logprobs_are_the_float64_log_softmax_of_the_logits(tiny_fd):
    model, _ = tiny_fd
    prompt = model.tokenizer.encode(PROMPT)
    out = generate(model, [prompt], _params(OPTIONS[0], 8, 5))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        with torch.inference_mode():
            exact = torch.log_softmax(model.prefill([prompt + out.token_ids[:i]])[0].double(), dim=-1)
        assert entry.logprob == pytest.approx(float(exact[token]), abs=1e-4)
        best = torch.sort(exact, descending=True).values[:5].tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(best, abs=1e-4)
        assert all(float(exact[t]) == pytest.approx(lp, abs=1e-4) for t, lp in entry.top)


async def _check_path(client: openai.AsyncOpenAI, model) -> None:
    prompt = model.tokenizer.encode(PROMPT)
    for fmt, fields in STRUCTURED:  # greedy constrained decoding: the reference's tokens, JSON when complete
        ref = generate(model, [prompt], SamplingParams(max_tokens=16, **fields))[0]
        extra = {"response_format": fmt}
        out = await client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body=extra
        )
        assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
        if ref.finish_reason == "stop":
            json.loads(ref.text)
    for option in OPTIONS:
        ref = generate(model, [prompt], _params(option, 12, 3))[0]
        kwargs = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "logprobs": 3} | option
        out = await client.completions.create(**kwargs)
        assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.token_ids)
        lp = out.choices[0].logprobs
        assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
        # the 3 most likely and the sampled token (fewer where two decode to the same text)
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs) and len(lp.top_logprobs) == len(ref.token_ids)
        stream = await client.completions.create(**kwargs, stream=True)
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].text for c in chunks) == ref.text and len(chunks) == len(ref.token_ids)
        streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
        assert streamed == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    messages = [{"role": "user", "content": PROMPT}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    out = await client.chat.completions.create(**chat)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    # n with a seed: reproducible, distinct choices; a stream with ignore_eos has one chunk per token
    n = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "n": 3, "seed": 5, "temperature": 1.0}
    first, again = (await client.completions.create(**n)), (await client.completions.create(**n))
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1 and first.usage.completion_tokens <= 24
    stream = await client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert len([c for c in chunks if c.choices]) == chunks[-1].usage.completion_tokens == 20


@contextlib.asynccontextmanager
async def _frontend(backend, model):
    info = ModelInfo("tiny", model.config.max_context)
    frontend = Frontend(backend, model.tokenizer, info, FrontendConfig(port=0, vocab_size=model.config.vocab))
    server, task, port = await start_server(frontend.app, "127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="t", max_retries=0, timeout=120)
    try:
        yield client
    finally:
        await client.close()
        server.should_exit = True
        await task


async def test_colocated_engine(tiny_fd):
    model, _ = tiny_fd
    engine = ColocatedEngine(model, EngineConfig(kv_blocks=64))
    await engine.start()
    try:
        async with _frontend(engine, model) as client:
            await _check_path(client, model)
    finally:
        await engine.stop()


async def test_distserve_prefill_then_decode(tiny_fd):
    model, _ = tiny_fd
    async with cluster(model) as c:
        await _check_path(c.client, model)


@pytest.mark.slow
async def test_offloaded_decode_and_the_s_worker(tiny_fd):
    model, directory = tiny_fd
    async with Graph(NodeConfig(secret=SECRET)) as graph:
        urls = await start_r_workers(graph, directory, 2, "4MiB")
        async with cluster(model, r_workers=[urls]) as c:
            await _check_path(c.client, model)
        s = await graph.driver.spawn(SWorker(model, urls, SWorkerConfig(max_batch=8)), "s-api")
        client = ClusterClient(s.url)
        await graph.driver.spawn(client, "client-api")
        async with _frontend(client, model) as http:
            await _check_path(http, model)
