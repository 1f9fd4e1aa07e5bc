"""DistServe serving end to end through the official openai client: prefill and decode instances,
controller and frontend on their own nodes (TCP between them), a tiny random-weight Llama."""

import asyncio

import openai
import pytest

from aiollm.model.engine import generate
from aiollm.model.sampling import SamplingParams
from aiollm.serving.distserve.controller import ControllerConfig
from aiollm.serving.distserve.decode import DecodeConfig
from aiollm.serving.distserve.prefill import PrefillConfig
from aiollm.testing.serving_cluster import cluster

PROMPTS = ["The quick brown fox", "Paris is the capital of", "def add(a, b):", "naïve café"]


async def _wait_until(predicate, timeout=10.0):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_completions_and_chat_equal_colocated_generate(tiny):
    tok = tiny.tokenizer
    chat = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    chat_ids = [tok.encode(tok.apply_chat_template(m), add_special_tokens=False) for m in chat]
    refs = generate(tiny, [tok.encode(p) for p in PROMPTS] + chat_ids, SamplingParams(max_tokens=12))
    async with cluster(tiny) as c:
        for prompt, ref in zip(PROMPTS, refs):
            out = await c.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
            assert out.usage.completion_tokens == len(ref.token_ids)
            stream = await c.client.completions.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            assert "".join([chunk.choices[0].text async for chunk in stream]) == ref.text
        for messages, ref in zip(chat, refs[len(PROMPTS) :]):
            out = await c.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
            assert out.choices[0].message.content == ref.text
            stream = await c.client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
            )
            assert "".join([ch.choices[0].delta.content or "" async for ch in stream]) == ref.text
        assert await _wait_until(lambda: c.kv_blocks_used() == 0)


async def test_two_prefill_two_decode_share_load(tiny):
    async with cluster(tiny, n_prefill=2, n_decode=2) as c:
        outs = await asyncio.gather(
            *(
                c.client.completions.create(
                    model="tiny", prompt=PROMPTS[i % 4], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
                )
                for i in range(16)
            )
        )
        assert all(o.usage.completion_tokens == 8 for o in outs)
        assert [p.prefilled > 0 for p in c.prefills] == [True, True]
        assert [d.finished > 0 for d in c.decodes] == [True, True]
        assert sum(p.prefilled for p in c.prefills) == 16 and sum(d.finished for d in c.decodes) == 16


async def test_burst_against_small_kv_budget_loses_nothing(tiny):
    prefill, decode = PrefillConfig(kv_blocks=4), DecodeConfig(kv_blocks=12)
    async with cluster(tiny, prefill=prefill, decode=decode) as c:
        peaks = {"prefill": 0, "decode": 0}

        async def sample():
            while True:
                peaks["prefill"] = max(peaks["prefill"], c.prefills[0].cache.used_blocks)
                peaks["decode"] = max(peaks["decode"], c.decodes[0].executor.used_blocks)
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        try:
            outs = await asyncio.gather(
                *(
                    c.client.completions.create(
                        model="tiny",
                        prompt=PROMPTS[i % 4] + " " + str(i),
                        max_tokens=8,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(200)
                )
            )
        finally:
            sampler.cancel()
        assert len(outs) == 200 and all(o.choices[0].finish_reason == "length" for o in outs)
        assert all(o.usage.completion_tokens == 8 for o in outs)
        assert 0 < peaks["prefill"] <= 4 and 0 < peaks["decode"] <= 12  # the budgets bound the KV held
        assert c.kv_blocks_used() == 0 and not c.controller._requests


async def test_cancelled_stream_frees_its_kv(tiny):
    async with cluster(tiny) as c:
        stream = await c.client.completions.create(
            model="tiny",
            prompt="The quick brown fox",
            max_tokens=240,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for chunk in stream:
            request_id = chunk.id
            seen += 1
            if seen == 3:
                break
        assert c.kv_blocks_used() > 0
        await stream.close()
        assert await _wait_until(lambda: c.kv_blocks_used() == 0 and not c.controller._requests)
        assert request_id not in [t.request_id for t in c.controller.finished]  # it stopped early


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 3}, "temperature"),
        ({"max_tokens": 1000}, "max_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
async def test_bad_parameters_give_400_naming_them(tiny, kwargs, param):
    async with cluster(tiny) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.client.chat.completions.create(
                **({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]} | kwargs)
            )
        assert info.value.body["param"] == param


async def test_decode_instance_lost_mid_stream_fails_over(tiny):
    async with cluster(tiny, n_decode=2, controller=ControllerConfig(max_retries=2)) as c:
        stream = await c.client.completions.create(
            model="tiny",
            prompt="Paris is the capital of",
            max_tokens=200,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        victim = None
        usage = finish = None
        async for chunk in stream:
            if victim is None:
                req = next(iter(c.controller._requests.values()))
                if req.stage == "decode":
                    victim = req.decode
                    await c.nodes[victim].stop()  # the decode instance's node goes away mid-stream
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                usage = chunk.usage
        assert victim is not None and finish == "length" and usage.completion_tokens == 200
        survivor = c.decodes[1 - int(victim[-1])]
        assert survivor.finished == 1
        assert await _wait_until(lambda: c.prefills[0].cache.used_blocks == 0 and survivor.executor.used_blocks == 0)
