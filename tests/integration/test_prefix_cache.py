"""Prefix caching through a disaggregated cluster (tiny random-weight Llama, instances on their own nodes over
TCP): shared system prompts and multi-turn conversations give the reference engine's tokens with the cache on
and off while the cache is hit; the decode instance pulls only the blocks it lacks; the controller routes a
request to the prefill instance holding its prefix when the queues are equal."""

import asyncio

import httpx
import pytest
import torch

from aiollm.model.engine import generate
from aiollm.model.sampling import SamplingParams
from aiollm.serving.backend import GenerateRequest
from aiollm.serving.colocated import ColocatedEngine, EngineConfig
from aiollm.serving.distserve.controller import ControllerConfig
from aiollm.serving.distserve.decode import DecodeConfig
from aiollm.serving.distserve.prefill import PrefillConfig
from aiollm.testing.serving_cluster import cluster

N_NEW = 8


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _complete(c, prompt: list[int]) -> str:
    out = await c.client.completions.create(
        model="tiny", prompt=prompt, max_tokens=N_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def _reference(model, prompt: list[int]):
    return generate(model, [prompt], SamplingParams(max_tokens=N_NEW, ignore_eos=True))[0]


def _configs(on: bool):
    return {
        "prefill": PrefillConfig(kv_blocks=64, prefix_cache=on),
        "decode": DecodeConfig(kv_blocks=128, prefix_cache=on),
        "controller": ControllerConfig(prefix_routing=on),
    }


async def _texts(c, prompts):
    outs = []
    for prompt in prompts:  # one after another: each finds what the ones before it left in the caches
        out = await c.client.completions.create(
            model="tiny", prompt=prompt, max_tokens=N_NEW, temperature=0, extra_body={"ignore_eos": True}
        )
        outs.append(out.choices[0].text)
    return outs


@pytest.mark.parametrize("on", [True, False])
async def test_a_shared_system_prompt_gives_the_tokens_of_a_miss(tiny, on):
    vocab = tiny.config.vocab
    system = _ids(1, 50, vocab)
    prompts = [system + _ids(10 + i, 5 + 3 * i, vocab) for i in range(4)]
    refs = [c.text for c in generate(tiny, prompts, SamplingParams(max_tokens=N_NEW, ignore_eos=True))]
    async with cluster(tiny, **_configs(on)) as c:
        assert await _texts(c, prompts) == refs
        prefill, decode = c.prefills[0], c.decodes[0].executor
        if on:  # 3 of the system prompt's blocks are mapped for each request after the first
            assert prefill.hit_tokens == 3 * 3 * 16 and prefill.prompt_tokens == sum(map(len, prompts))
            assert decode.blocks_reused == 3 * 3
        else:
            assert prefill.hit_tokens == 0 and decode.blocks_reused == 0
        assert c.kv_blocks_used() == 0  # cached blocks nobody references count as free
        own = await prefill.on_get_load(None)
        assert (own.prompt_tokens, own.prefix_hit_tokens) == (prefill.prompt_tokens, prefill.hit_tokens)
        for _ in range(100):  # the controller's summary (/metrics) polls the instances every 0.5 s
            load = await c.controller.on_get_load(None)
            if load.prompt_tokens == prefill.prompt_tokens:
                break
            await asyncio.sleep(0.05)
        assert (load.prefix_hit_tokens, load.kv_blocks_reused) == (prefill.hit_tokens, decode.blocks_reused)
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{c.port}/metrics")).text
        assert f"aiollm_prefix_cache_hit_tokens {float(prefill.hit_tokens)}" in metrics
        assert f"aiollm_kv_blocks_reused {float(decode.blocks_reused)}" in metrics


@pytest.mark.parametrize("on", [True, False])
async def test_multi_turn_conversations_give_the_tokens_of_a_miss(tiny, on):
    vocab = tiny.config.vocab
    system = _ids(2, 20, vocab)
    async with cluster(tiny, **_configs(on)) as c:
        prefill = c.prefills[0]
        for conv in range(2):
            history, previous = system + _ids(100 + conv, 9, vocab), system
            for turn in range(3):  # each turn resends the conversation: its answers and a new user message
                ref, hits = _reference(tiny, history), prefill.hit_tokens
                assert await _complete(c, history) == ref.text, (conv, turn)
                # a turn maps the full blocks of the prompt before it (the first turn: of the system prompt)
                assert prefill.hit_tokens - hits == (len(previous) // 16 * 16 if on and conv + turn else 0)
                previous, history = history, history + ref.token_ids + _ids(200 + 10 * conv + turn, 7, vocab)


async def test_chat_with_a_shared_system_prompt(tiny):
    tok = tiny.tokenizer
    system = {"role": "system", "content": "You answer in one word. Paris is the capital of France. " * 3}
    questions = ["The quick brown fox", "def add(a, b):", "Berlin is the capital of"]
    chats = [[system, {"role": "user", "content": q}] for q in questions]
    ids = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in chats]
    refs = generate(tiny, ids, SamplingParams(max_tokens=N_NEW))
    async with cluster(tiny) as c:
        for messages, ref in zip(chats, refs):
            out = await c.client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=N_NEW, temperature=0
            )
            assert out.choices[0].message.content == ref.text
        assert c.prefills[0].hit_tokens >= 2 * 16


async def test_decode_pulls_only_the_blocks_it_lacks(tiny):
    vocab = tiny.config.vocab
    shared = _ids(3, 48, vocab)  # three full blocks
    first, second = shared + _ids(4, 5, vocab), shared + _ids(5, 20, vocab)
    async with cluster(tiny) as c:
        prefill, decode = c.prefills[0], c.decodes[0].executor
        assert await _complete(c, first) == _reference(tiny, first).text
        assert (decode.blocks_pulled, decode.blocks_reused, prefill.blocks_sent) == (4, 0, 4)
        assert await _complete(c, second) == _reference(tiny, second).text
        # 5 blocks: the 3 shared ones mapped from the decode instance's own cache, 2 pulled
        assert (decode.blocks_pulled, decode.blocks_reused, prefill.blocks_sent) == (6, 3, 6)
        assert await _complete(c, second) == _reference(tiny, second).text
        # the whole prompt again: its 4 full blocks are cached on both sides; the partial one moves
        assert (decode.blocks_pulled, decode.blocks_reused, prefill.blocks_sent) == (7, 7, 7)


async def test_a_request_goes_to_the_instance_holding_its_prefix(tiny):
    vocab = tiny.config.vocab
    other, prefix = _ids(6, 40, vocab), _ids(7, 64, vocab)
    follow_up = prefix + _ids(8, 10, vocab)
    async with cluster(tiny, n_prefill=2) as c:
        p0, p1 = c.prefills
        p0._next_batch = list  # prefill0 holds its queue: the next request goes to prefill1
        held = asyncio.create_task(_complete(c, other))
        for _ in range(500):
            if c.controller.dispatcher.prefill["prefill0"].queued == 1:
                break
            await asyncio.sleep(0.01)
        assert await _complete(c, prefix) == _reference(tiny, prefix).text
        assert p1.prefilled == 1
        del p0._next_batch
        p0._wake.set()
        assert await held == _reference(tiny, other).text
        assert c.controller.dispatcher.choose_prefill() == "prefill0"  # equal queues: shortest-queue says 0
        assert await _complete(c, follow_up) == _reference(tiny, follow_up).text
        assert (p0.prefilled, p1.prefilled) == (1, 2)
        assert p1.hit_tokens == 64 and c.controller.prefix_routed == 1


async def test_the_colocated_engine_reuses_prefixes_with_the_same_tokens(tiny):
    vocab = tiny.config.vocab
    system = _ids(9, 40, vocab)
    prompts = [system + _ids(20 + i, 6, vocab) for i in range(3)]
    engine = ColocatedEngine(tiny, EngineConfig(kv_blocks=64))
    await engine.start()
    try:
        for i, prompt in enumerate(prompts):
            request = GenerateRequest(f"r{i}", tuple(prompt), SamplingParams(max_tokens=N_NEW, ignore_eos=True))
            got = [t async for delta in engine.submit(request) for t in delta.token_ids]
            assert got == _reference(tiny, prompt).token_ids
        assert (engine.hit_tokens, engine.prompt_tokens) == (2 * 32, sum(map(len, prompts)))
        assert engine.kv_blocks_used == 0
    finally:
        await engine.stop()
