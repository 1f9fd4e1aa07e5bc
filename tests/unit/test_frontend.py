"""The OpenAI-compatible frontend against a scripted backend, through the official openai client.

The backend here is a test double (one character per token, a fixed reply), so these tests pin
the HTTP behaviour alone: shapes, streaming, stop strings, errors, metrics, and cancellation on
disconnect. The real engine and the cluster are covered in tests/integration.
"""

import asyncio

import httpx
import openai
import pytest

from aiollm.frontend.app import Frontend, FrontendConfig, start_server
from aiollm.model.logprobs import TokenLogprobs
from aiollm.serving.backend import (
    FINISH_LENGTH,
    FINISH_STOP,
    BackendStats,
    ModelInfo,
    Overloaded,
    TokenDelta,
    Unavailable,
)

EOS = 3
REPLY = "Hello, world! The end."


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS or not skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _logprobs(token, k):
    """A fixed, recognisable distribution: the token at -0.25, then 'z', 'y', ... below it."""
    if k is None:
        return None
    top = [(token, -0.25)] + [(ord("z") - i, -1.0 - i) for i in range(k - 1)]
    return [TokenLogprobs(-0.25, tuple(top[:k]))]


class ScriptedBackend:
    """Replies REPLY one character per delta, then EOS; `mode` makes it refuse instead."""

    def __init__(self, delay=0.0):
        self.delay = delay
        self.mode = None
        self.active: set[str] = set()
        self.cancelled: list[str] = []
        self.requests = []

    async def submit(self, request):
        if self.mode == "overloaded":
            raise Overloaded("all prefill queues are full")
        if self.mode == "unavailable":
            raise Unavailable("no decode instance is alive")
        self.requests.append(request)
        self.active.add(request.request_id)
        try:
            script = [ord(c) for c in REPLY] + [EOS]
            for i, token in enumerate(script[: request.sampling.max_tokens]):
                if request.request_id not in self.active:
                    return
                await asyncio.sleep(self.delay)
                last = i + 1 == request.sampling.max_tokens
                logprobs = _logprobs(token, request.sampling.logprobs)
                if token == EOS and not request.sampling.ignore_eos:
                    yield TokenDelta((token,), FINISH_STOP, logprobs)
                    return
                yield TokenDelta((token,), FINISH_LENGTH if last else None, logprobs)
        finally:
            self.active.discard(request.request_id)

    async def cancel(self, request_id):
        if request_id in self.active:
            self.cancelled.append(request_id)
            self.active.discard(request_id)

    async def stats(self):
        return BackendStats(
            waiting=0,
            running=len(self.active),
            prefill_queues={"p0": 0},
            decode_queues={"d0": 0},
            kv_blocks_used=7,
            kv_blocks_total=64,
            alive={"p0": True, "d0": self.mode != "decode-dead"},
            instance_kv_blocks_used={"p0": 3, "d0": 4 if self.mode != "decode-dead" else 0},
            resumed={"repull": 2, "reprefill": 1},
        )


@pytest.fixture
async def served():
    backend = ScriptedBackend()
    frontend = Frontend(
        backend,
        CharTokenizer(),
        ModelInfo("tiny", max_context=64),
        FrontendConfig(port=0, max_in_flight=4, vocab_size=256, default_max_tokens=40),
    )
    server, task, port = await start_server(frontend.app, "127.0.0.1", 0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        yield backend, client, port
    finally:
        await client.close()
        server.should_exit = True
        await task


async def test_completion_and_usage(served):
    backend, client, _ = served
    out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=5)
    assert out.choices[0].text == REPLY[:5] and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2, 5)
    assert backend.requests[0].prompt_ids == (ord("H"), ord("i"))
    out = await client.completions.create(model="tiny", prompt=[72, 105], max_tokens=40, temperature=0)
    assert out.choices[0].text == REPLY and out.choices[0].finish_reason == "stop"
    assert backend.requests[1].sampling.temperature == 0


async def test_streaming_completion_and_chat(served):
    _, client, _ = served
    stream = await client.completions.create(
        model="tiny", prompt="Hi", max_tokens=40, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == REPLY
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(REPLY) + 1
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hey"}], max_tokens=40, stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == REPLY
    out = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}])
    assert out.choices[0].message.content == REPLY and out.choices[0].finish_reason == "stop"


async def test_chat_uses_template_and_fills_max_tokens(served):
    backend, client, _ = served
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}])
    prompt = "user: hey\nassistant:"
    assert backend.requests[0].prompt_ids == tuple(map(ord, prompt))
    assert backend.requests[0].sampling.max_tokens == 40  # the configured default, under the context's rest
    await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 30}])
    assert backend.requests[1].sampling.max_tokens == 64 - len("user: \nassistant:") - 30  # the context's rest


async def test_stop_string_truncates_and_cancels(served):
    backend, client, _ = served
    out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=40, stop=["world"])
    assert out.choices[0].text == "Hello, " and out.choices[0].finish_reason == "stop"
    stream = await client.completions.create(model="tiny", prompt="Hi", max_tokens=40, stop="wor", stream=True)
    text = "".join([c.choices[0].text async for c in stream])
    assert text == "Hello, "  # the held-back "wo" never reached the client
    assert len(backend.cancelled) == 2 and not backend.active


@pytest.mark.parametrize(
    "kwargs, status, param",
    [
        ({"temperature": 5}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"n": 0}, 400, "n"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 63}, 400, "max_tokens"),  # 2 prompt tokens + 63 > 64
        ({"prompt": "x" * 64}, 400, "prompt"),
        ({"prompt": [999]}, 400, "prompt"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": "gpt-4"}, 404, "model"),
        ({"seed": 2**64}, 400, "seed"),
        ({"extra_body": {"top_k": 2**64}}, 400, "top_k"),
        ({"max_tokens": 2**40}, 400, "max_tokens"),
    ],
)
async def test_bad_parameters_name_the_parameter(served, kwargs, status, param):
    _, client, _ = served
    args = {"model": "tiny", "prompt": "Hi", "max_tokens": 4} | kwargs
    with pytest.raises(openai.APIStatusError) as info:
        await client.completions.create(**args)
    assert info.value.status_code == status
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


async def test_chat_context_overflow_names_max_tokens(served):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hey"}], max_tokens=60)
    assert info.value.body["param"] == "max_tokens" and info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="tiny", messages=[])
    assert info.value.body["param"] == "messages"


async def test_overload_and_unavailable(served):
    backend, client, port = served
    backend.mode = "overloaded"
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
    backend.mode = "unavailable"
    with pytest.raises(openai.InternalServerError) as info:
        await client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
    assert info.value.status_code == 503
    backend.mode = None
    backend.delay = 0.05  # hold 4 requests in flight, the 5th is refused by the frontend itself
    held = [asyncio.create_task(client.completions.create(model="tiny", prompt="Hi", max_tokens=20)) for _ in range(4)]
    await asyncio.sleep(0.1)
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
    assert all(r.choices[0].text == REPLY[:20] for r in await asyncio.gather(*held))


async def test_disconnect_cancels_the_request(served):
    backend, _, port = served
    backend.delay = 0.02
    async with httpx.AsyncClient() as http:
        async with http.stream(
            "POST",
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "tiny", "prompt": "Hi", "max_tokens": 40, "stream": True},
        ) as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    break
        for _ in range(100):  # non-streaming: the client times out while the backend works
            if not backend.active:
                break
            await asyncio.sleep(0.02)
        assert len(backend.cancelled) == 1 and not backend.active
        with pytest.raises(httpx.ReadTimeout):
            await http.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={"model": "tiny", "prompt": "Hi", "max_tokens": 40},
                timeout=0.1,
            )
        for _ in range(100):
            if len(backend.cancelled) == 2:
                break
            await asyncio.sleep(0.02)
        assert len(backend.cancelled) == 2 and not backend.active
        counted = []
        for _ in range(100):  # dropped streams count as aborted
            metrics = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            counted = [line for line in metrics.splitlines() if line.startswith("aiollm_requests_total")]
            if counted == ['aiollm_requests_total{outcome="aborted"} 2.0']:
                break
            await asyncio.sleep(0.05)
        assert counted == ['aiollm_requests_total{outcome="aborted"} 2.0']


async def test_models_health_metrics(served):
    _, client, port = served
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    await client.completions.create(model="tiny", prompt="Hi", max_tokens=5)
    async with httpx.AsyncClient() as http:
        health = (await http.get(f"http://127.0.0.1:{port}/health")).json()
        assert health == {"status": "ok", "instances": {"p0": True, "d0": True}}
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    for line in (
        "aiollm_time_to_first_token_seconds_count 1.0",
        "aiollm_time_per_output_token_seconds_count 1.0",
        'aiollm_prefill_queue_length{instance="p0"} 0.0',
        "aiollm_kv_blocks_used 7.0",
        'aiollm_instance_up{instance="d0"} 1.0',
        'aiollm_instance_kv_blocks_used{instance="p0"} 3.0',
        "aiollm_backend_up 1.0",
        'aiollm_requests_resumed{how="repull"} 2.0',
        "aiollm_generation_tokens_total 5.0",
        'aiollm_requests_total{outcome="length"} 1.0',
    ):
        assert line in text


async def test_a_tiny_temperature_is_sampled_greedily_and_an_unseeded_request_gets_a_seed(served):
    backend, client, _ = served
    await client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=1e-39)
    await client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0.7)
    await client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0.7, seed=-5)
    tiny, unseeded, negative = (r.sampling for r in backend.requests)
    assert tiny.greedy and not unseeded.greedy and unseeded.seed is not None
    assert negative.seed == (-5) % 2**63


async def test_health_is_503_without_a_decode_path_and_metrics_survive_a_lost_backend(served):
    backend, _, port = served
    async with httpx.AsyncClient() as http:
        backend.mode = "decode-dead"
        response = await http.get(f"http://127.0.0.1:{port}/health")
        assert response.status_code == 503 and "d0" in response.json()["error"]["message"]
        assert 'aiollm_instance_up{instance="d0"} 0.0' in (await http.get(f"http://127.0.0.1:{port}/metrics")).text
        backend.mode = None

        async def unreachable():
            raise Unavailable("controller unreachable")

        backend.stats = unreachable
        response = await http.get(f"http://127.0.0.1:{port}/metrics")
        assert response.status_code == 200 and "aiollm_backend_up 0.0" in response.text
        assert (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 503


async def test_overload_says_when_to_retry(served):
    backend, _, port = served
    backend.mode = "overloaded"
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        )
    assert response.status_code == 429 and response.headers["retry-after"] == "1"


async def test_an_oversized_body_is_refused_before_it_is_parsed():
    backend = ScriptedBackend()
    config = FrontendConfig(port=0, vocab_size=256, max_body_bytes=4096)
    frontend = Frontend(backend, CharTokenizer(), ModelInfo("tiny", max_context=64), config)
    server, task, port = await start_server(frontend.app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        async with httpx.AsyncClient() as http:
            response = await http.post(url, json={"model": "tiny", "prompt": "x" * 10_000})
            assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"

            async def chunks():  # no Content-Length: the bytes are counted as they arrive
                for _ in range(10):
                    yield b"x" * 1000

            response = await http.post(url, content=chunks(), headers={"content-type": "application/json"})
            assert response.status_code == 413
            ok = await http.post(url, json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200
        assert len(backend.requests) == 1
    finally:
        server.should_exit = True
        await task


async def test_the_api_key_guards_v1_but_not_health():
    backend = ScriptedBackend()
    config = FrontendConfig(port=0, vocab_size=256, api_key="sesame-0123456789")
    frontend = Frontend(backend, CharTokenizer(), ModelInfo("tiny", max_context=64), config)
    server, task, port = await start_server(frontend.app, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        for key in ("wrong", "none"):
            client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
            await client.close()
        client = openai.AsyncOpenAI(base_url=base, api_key="sesame-0123456789", max_retries=0)
        out = await client.completions.create(model="tiny", prompt="Hi", max_tokens=2)
        assert out.choices[0].text == REPLY[:2]
        await client.close()
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
            assert (await http.get(f"{base}/models")).status_code == 401
    finally:
        server.should_exit = True
        await task


async def test_a_lone_surrogate_is_a_400_naming_the_field(served):
    _, _, port = served
    # the JSON escapes a lone surrogate, as a client that does not check would send it
    bodies = [
        ('{"model": "tiny", "prompt": "caf\\ud800", "max_tokens": 2}', "prompt", "/v1/completions"),
        ('{"model": "tiny", "prompt": "Hi", "stop": ["\\udfff"], "max_tokens": 2}', "stop", "/v1/completions"),
        (
            '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
            "messages",
            "/v1/chat/completions",
        ),
    ]
    async with httpx.AsyncClient() as http:
        for body, param, path in bodies:
            response = await http.post(
                f"http://127.0.0.1:{port}{path}", content=body, headers={"content-type": "application/json"}
            )
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == param and "not valid Unicode" in error["message"]
