"""The OpenAI API surface against the scripted backend, through the official openai client: every field is
honoured or refused with a 400 naming it, n choices, logprobs shapes, echo, one chunk per token, and vLLM's
/tokenize, /detokenize, /version and /ping."""

import json
import sys

import httpx
import openai
import pytest

import aiollm
from aiollm.model import structured
from aiollm.model.sampling import choice_seed
from tests.unit.test_frontend import EOS, REPLY, served  # noqa: F401 (the fixture)

CHAT = [{"role": "user", "content": "hey"}]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"suffix": "x"}, "suffix"),
        ({"extra_body": {"best_of": 2}}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"extra_body": {"response_format": {"type": "xml"}}}, "response_format"),
        (
            {
                "extra_body": {
                    "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
                }
            },
            "response_format",
        ),
        ({"extra_body": {"response_format": {"type": "json_object", "json_schema": {}}}}, "response_format"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"extra_body": {"guided_json": {}}}, "guided_json"),
        ({"extra_body": {"spaces_between_special_tokens": False}}, "spaces_between_special_tokens"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
        ({"n": 17}, "n"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"min_tokens": 5}, "max_tokens": 4}, "min_tokens"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"999": 1}}, "logit_bias"),
        ({"extra_body": {"stop_token_ids": [999]}}, "stop_token_ids"),
    ],
)
async def test_completions_refuse_what_they_cannot_honour(served, kwargs, param):  # noqa: F811
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(**({"model": "tiny", "prompt": "Hi", "max_tokens": 4} | kwargs))
    assert info.value.body["param"] == param, info.value.body


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"extra_body": {"functions": [{"name": "f"}]}}, "functions"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"extra_body": {"echo": True}}, "echo"),
        ({"messages": [{"role": "user", "content": "hey", "name": "bob"}]}, "messages"),
    ],
)
async def test_chat_refuses_what_it_cannot_honour(served, kwargs, param):  # noqa: F811
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(**({"model": "tiny", "messages": CHAT, "max_tokens": 4} | kwargs))
    assert info.value.body["param"] == param, info.value.body


async def test_harmless_fields_are_accepted_and_sampling_fields_reach_the_backend(served):  # noqa: F811
    backend, client, _ = served
    await client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=6,
        user="u",
        metadata={"k": "v"},
        store=False,
        parallel_tool_calls=False,
        tool_choice="none",
        response_format={"type": "text"},
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        logit_bias={"65": -3},
        seed=9,
        extra_body={
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "min_p": 0.05,
            "top_k": -1,
            "stop_token_ids": [7],
            "ignore_eos": True,
            "skip_special_tokens": True,
            "include_stop_str_in_output": False,
            "spaces_between_special_tokens": True,
        },
    )
    p = backend.requests[0].sampling
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.1)
    assert (p.min_tokens, p.min_p, p.top_k, p.stop_token_ids, p.ignore_eos) == (2, 0.05, 0, (7,), True)
    assert p.logit_bias == ((65, -3.0),) and p.seed == 9 and p.logprobs is None


async def test_response_format_reaches_the_backend_as_the_schema_text(served, monkeypatch):  # noqa: F811
    backend, client, _ = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}}
    await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, response_format=fmt)
    await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, response_format={"type": "json_object"}
    )
    first, second = backend.requests[0].sampling, backend.requests[1].sampling
    assert json.loads(first.json_schema) == schema and not first.json_object
    assert second.json_object and second.json_schema is None
    # without xgrammar a JSON request is a 501 naming response_format and what is missing
    monkeypatch.setattr(structured, "_check_schema", lambda schema: structured._xgr())
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, response_format=fmt)
    assert info.value.status_code == 501 and info.value.body["param"] == "response_format"
    assert "xgrammar" in info.value.body["message"]


async def test_n_choices_have_distinct_seeds_and_sum_their_usage(served):  # noqa: F811
    backend, client, _ = served
    out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=5, n=3, seed=11, temperature=1)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.text == REPLY[:5] for c in out.choices)
    assert out.usage.completion_tokens == 15 and out.usage.prompt_tokens == 2
    assert [r.sampling.seed for r in backend.requests] == [choice_seed(11, i) for i in range(3)]
    assert len({r.request_id for r in backend.requests}) == 3
    stream = await client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=4,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: REPLY[:4], 1: REPLY[:4]} and chunks[-1].usage.completion_tokens == 8
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason == "length") == 2


async def test_completion_logprobs_shape(served):  # noqa: F811
    _, client, _ = served
    out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=3, logprobs=2)
    lp = out.choices[0].logprobs
    assert lp.tokens == list(REPLY[:3]) and lp.token_logprobs == [-0.25] * 3
    assert lp.top_logprobs[0] == {"H": -0.25, "z": -1.0} and lp.text_offset == [0, 1, 2]
    stream = await client.completions.create(model="tiny", prompt="Hi", max_tokens=3, logprobs=0, stream=True)
    chunks = [c async for c in stream]
    assert [c.choices[0].logprobs.tokens for c in chunks] == [["H"], ["e"], ["l"]]
    assert chunks[2].choices[0].logprobs.text_offset == [2] and chunks[0].choices[0].logprobs.top_logprobs == [
        {"H": -0.25}
    ]


async def test_chat_logprobs_shape(served):  # noqa: F811
    _, client, _ = served
    out = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == ["H", "e"] and content[0].bytes == [ord("H")]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("e", -0.25), ("z", -1.0), ("y", -2.0)]
    out = await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, logprobs=True)
    assert out.choices[0].logprobs.content[0].top_logprobs == []
    assert (await client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)).choices[0].logprobs is None
    stream = await client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=1, stream=True
    )
    chunks = [c async for c in stream]
    assert [[e.token for e in c.choices[0].logprobs.content] for c in chunks[1:]] == [["H"], ["e"]]


async def test_echo_prepends_the_prompt(served):  # noqa: F811
    _, client, _ = served
    out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=3, echo=True)
    assert out.choices[0].text == "Hi" + REPLY[:3]
    stream = await client.completions.create(model="tiny", prompt=[72, 105], max_tokens=3, echo=True, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == "Hi" + REPLY[:3]


async def test_one_chunk_per_token_even_when_its_text_is_empty(served):  # noqa: F811
    _, client, _ = served
    n = len(REPLY) + 3  # the EOS (no text) and two more scripted tokens past it are cut by max_tokens
    stream = await client.completions.create(
        model="tiny",
        prompt="Hi",
        max_tokens=len(REPLY) + 1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == chunks[-1].usage.completion_tokens == len(REPLY) + 1 < n
    assert token_chunks[-1].choices[0].text == "" and token_chunks[-1].choices[0].finish_reason == "length"


async def test_stop_strings_can_be_kept_and_special_tokens_shown(served):  # noqa: F811
    _, client, _ = served
    out = await client.completions.create(
        model="tiny", prompt="Hi", max_tokens=40, stop=["world"], extra_body={"include_stop_str_in_output": True}
    )
    assert out.choices[0].text == "Hello, world" and out.choices[0].finish_reason == "stop"
    out = await client.completions.create(
        model="tiny",
        prompt="Hi",
        max_tokens=len(REPLY) + 1,
        extra_body={"skip_special_tokens": False, "ignore_eos": True},
    )
    assert out.choices[0].text == REPLY + chr(EOS)


async def test_tokenize_detokenize_version_ping(served):  # noqa: F811
    _, _, port = served
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as http:
        got = (await http.post(f"{base}/tokenize", json={"model": "tiny", "prompt": "Hi"})).json()
        assert got == {"count": 2, "max_model_len": 64, "tokens": [72, 105], "token_strs": None}
        got = (await http.post(f"{base}/tokenize", json={"messages": CHAT})).json()
        assert got["tokens"] == [ord(c) for c in "user: hey\nassistant:"]
        assert (await http.post(f"{base}/detokenize", json={"tokens": [72, 105]})).json() == {"prompt": "Hi"}
        bad = await http.post(f"{base}/detokenize", json={"tokens": [999]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        bad = await http.post(f"{base}/tokenize", json={"prompt": "Hi", "model": "other"})
        assert bad.status_code == 404
        assert (await http.get(f"{base}/version")).json() == {"version": aiollm.__version__}
        assert (await http.get(f"{base}/ping")).status_code == 200
