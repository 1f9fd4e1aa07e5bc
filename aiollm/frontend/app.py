"""The OpenAI-compatible HTTP frontend (FastAPI + uvicorn) over a `Backend`.

Why the frontend owns text: tokenisation, the chat template, incremental detokenisation and stop
strings all happen here, so the backends (an in-process engine or the disaggregated cluster's
controller) move only token ids. Every request is watched for a client disconnect; when the
client goes, the backend is told to cancel, which frees the request's KV wherever it lives.
A request for `n` choices is `n` backend requests (aiollm.frontend.generation), merged by index.
Besides the OpenAI routes it serves vLLM's `/tokenize`, `/detokenize`, `/version` and `/ping`.
Errors use OpenAI's JSON shape: 400 naming the parameter, 404 for an unknown model, 429 when
the frontend or the backend is at its admission limit, 503 when the backend cannot serve.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Protocol

import jinja2
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

import aiollm
from aiollm.errors import require_positive
from aiollm.frontend import protocol as oai
from aiollm.frontend.generation import Choice, Generation
from aiollm.frontend.limits import ApiKey, BodyLimit
from aiollm.frontend.metrics import CONTENT_TYPE, ServingMetrics
from aiollm.frontend.reply import Reply
from aiollm.frontend.responses import usage
from aiollm.log import get_logger
from aiollm.model import structured
from aiollm.model.sampling import MAX_SEED, SamplingParams, choice_seed
from aiollm.serving.backend import Backend, GenerateRequest, ModelInfo, Overloaded, Unavailable

_log = get_logger("frontend")


class TextTokenizer(Protocol):
    """What the frontend needs from a tokenizer (aiollm.model's Tokenizer has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class FrontendConfig:
    """Where the frontend listens and how much it takes at once."""

    # interface to bind (loopback by default)
    host: str = "127.0.0.1"
    # TCP port; 0 picks a free one
    port: int = 8000
    # HTTP generation requests served at once; one more gets 429
    max_in_flight: int = 512
    # vocabulary size, to validate token-id prompts; 0 skips the check
    vocab_size: int = 0
    # max_tokens when a request omits it (capped by the context): decode instances reserve KV for the
    # whole completion, so "the rest of an 8k context" for every chat request would starve admission
    default_max_tokens: int = 1024
    # largest request body; a larger one is refused (413) before a byte of it is parsed
    max_body_bytes: int = 4 * 1024**2
    # seconds a client refused for overload is told to wait (the Retry-After header of a 429)
    retry_after_s: float = 1.0
    # clients of /v1/ must send `Authorization: Bearer api_key`; "" : no key needed
    api_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"FrontendConfig.port must be in [0, 65535], got {self.port}")
        require_positive(self, "max_in_flight", "default_max_tokens", "max_body_bytes", "retry_after_s")


class HTTPError(Exception):
    """An error answered to the client in OpenAI's shape (with `Retry-After` when the client should retry)."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ):
        super().__init__(message)
        self.status, self.body = status, oai.error_body(message, err_type, param, code)
        self.headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None


def _bad(message: str, param: str | None, code: str | None = None) -> HTTPError:
    return HTTPError(400, message, "invalid_request_error", param, code)


class Frontend:
    """Builds the FastAPI app for one backend and one tokenizer."""

    def __init__(self, backend: Backend, tokenizer: TextTokenizer, info: ModelInfo, config: FrontendConfig) -> None:
        self.backend, self.tokenizer, self.info, self.config = backend, tokenizer, info, config
        self.metrics = ServingMetrics()
        self.in_flight = 0
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="aiollm", docs_url=None, redoc_url=None)
        app.add_middleware(BodyLimit, max_bytes=self.config.max_body_bytes)
        if self.config.api_key:
            app.add_middleware(ApiKey, key=self.config.api_key)

        @app.exception_handler(RequestValidationError)
        async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0]
            names = [str(p) for p in first.get("loc", ()) if p != "body" and not isinstance(p, int)]
            param = names[0] if names else None
            return JSONResponse(
                oai.error_body(f"{param or 'body'}: {first.get('msg')}", "invalid_request_error", param),
                status_code=400,
            )

        @app.exception_handler(HTTPError)
        async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
            return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)

        @app.get("/health")
        async def health() -> Response:
            try:
                stats = await self.backend.stats()
            except Unavailable as exc:
                raise HTTPError(503, str(exc), "service_unavailable") from exc
            if not stats.serving:
                dead = sorted(n for n, up in stats.alive.items() if not up)
                raise HTTPError(503, f"no live prefill or decode path (down: {', '.join(dead)})", "service_unavailable")
            return JSONResponse({"status": "ok", "instances": stats.alive})

        @app.get("/v1/models")
        async def models() -> dict:
            return {
                "object": "list",
                "data": [
                    {
                        "id": self.info.name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "aiollm",
                        "max_model_len": self.info.max_context,
                    }
                ],
            }

        @app.get("/metrics")
        async def metrics() -> Response:
            self.metrics.in_flight.set(self.in_flight)
            try:
                stats = await self.backend.stats()
            except Unavailable:  # the frontend's own figures still count; the backend's read as down
                stats = None
            return Response(self.metrics.render(stats), media_type=CONTENT_TYPE)

        @app.post("/v1/completions")
        async def completions(body: oai.CompletionRequest, request: Request) -> Response:
            self._check_model(body.model)
            if isinstance(body.prompt, str):
                # in a thread: a long prompt must not stall the event loop that streams everyone's tokens
                ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt)
            else:
                ids = self._check_ids(body.prompt)
            return await self._respond(request, body, ids, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: oai.ChatCompletionRequest, request: Request) -> Response:
            self._check_model(body.model)
            text = self._chat_text(body.messages)
            ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)
            return await self._respond(request, body, ids, chat=True)

        @app.get("/version")
        async def version() -> dict:
            return {"version": aiollm.__version__}

        @app.get("/ping")
        async def ping() -> Response:
            return Response(status_code=200)

        @app.post("/ping")
        async def ping_post() -> Response:
            return Response(status_code=200)

        @app.post("/tokenize")
        async def tokenize(body: oai.TokenizeRequest) -> dict:
            if body.model is not None:
                self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise _bad("tokenize takes either a prompt or messages", "prompt")
            if body.prompt is not None:
                special = body.add_special_tokens if body.add_special_tokens is not None else True
                ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt, add_special_tokens=special)
            else:
                text = self._chat_text(body.messages, body.add_generation_prompt)
                special = bool(body.add_special_tokens)
                ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=special)
            return {"count": len(ids), "max_model_len": self.info.max_context, "tokens": ids, "token_strs": None}

        @app.post("/detokenize")
        async def detokenize(body: oai.DetokenizeRequest) -> dict:
            if body.model is not None:
                self._check_model(body.model)
            return {"prompt": self.tokenizer.decode(self._check_ids(body.tokens, "tokens"))}

        return app

    def _chat_text(self, messages: list[oai.ChatMessage], add_generation_prompt: bool = True) -> str:
        plain = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as exc:  # e.g. a role the model's template refuses
            raise _bad(f"messages: the chat template refused them: {exc}", "messages") from exc

    def _check_model(self, name: str) -> None:
        if name != self.info.name:
            raise HTTPError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.info.name}`.",
                "invalid_request_error",
                "model",
                "model_not_found",
            )

    def _check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab = self.config.vocab_size
        if any(not 0 <= i < (vocab or 2**31) for i in ids):
            raise _bad(f"{param}: token ids must be in [0, {vocab or 2**31})", param)
        return ids

    def _sampling(self, body, prompt_len: int, chat: bool) -> SamplingParams:
        context = self.info.max_context
        prompt_param = "messages" if chat else "prompt"
        if prompt_len >= context:
            raise _bad(
                f"This model's maximum context length is {context} tokens; the {prompt_param} has {prompt_len} tokens.",
                prompt_param,
                "context_length_exceeded",
            )
        if body.max_tokens is not None:
            max_tokens = body.max_tokens
        else:
            max_tokens = min(context - prompt_len, self.config.default_max_tokens)
        if prompt_len + max_tokens > context:
            param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
            raise _bad(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, {max_tokens} in the "
                f"completion). Please reduce the length of the {prompt_param} or {param}.",
                param,
                "context_length_exceeded",
            )
        vocab = self.config.vocab_size
        bias = tuple((int(token), float(b)) for token, b in (body.logit_bias or {}).items())
        if vocab and any(token >= vocab for token, _ in bias):
            raise _bad(f"logit_bias: token ids must be in [0, {vocab})", "logit_bias")
        if vocab and any(token >= vocab for token in body.stop_token_ids or ()):
            raise _bad(f"stop_token_ids: token ids must be in [0, {vocab})", "stop_token_ids")
        # a request without a seed gets one here, so that a resume after a fault draws what it would have drawn
        seed = body.seed % (MAX_SEED + 1) if body.seed is not None else secrets.randbelow(MAX_SEED + 1)
        fmt = body.response_format
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                min_p=body.min_p,
                seed=seed,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                min_tokens=body.min_tokens,
                logit_bias=bias,
                logprobs=body.top_logprobs_n,
                json_object=fmt is not None and fmt.type == "json_object",
                json_schema=fmt.schema_text if fmt is not None else None,
            )
        except ValueError as exc:  # messages start with the field's name
            raise _bad(str(exc), str(exc).split(":", 1)[0]) from exc

    async def _check_format(self, sampling: SamplingParams) -> None:
        """A 400 naming response_format with xgrammar's reason for a schema it cannot follow (checked in a thread:
        a large schema takes a while), a 501 naming it without xgrammar."""
        try:
            await asyncio.to_thread(structured.check, sampling)
        except structured.StructuredOutputUnavailable as exc:
            raise HTTPError(501, str(exc), "not_implemented_error", "response_format") from exc
        except ValueError as exc:
            raise _bad(str(exc), "response_format") from exc

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    async def _respond(self, request: Request, body, ids: list[int], chat: bool) -> Response:
        refused = body.refusal()
        if refused is not None:
            raise _bad(*refused)
        sampling = self._sampling(body, len(ids), chat)
        if sampling.structured:
            await self._check_format(sampling)
        if self.in_flight + body.n > self.config.max_in_flight:
            raise HTTPError(
                429,
                f"Too many requests in flight ({self.config.max_in_flight}); retry later.",
                "rate_limit_error",
                code="rate_limit_exceeded",
                retry_after=self.config.retry_after_s,
            )
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        skip = body.skip_special_tokens

        def decode(token_ids: list[int]) -> str:
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip)

        choices = []
        for index in range(body.n):
            params = replace(sampling, seed=choice_seed(sampling.seed, index))
            rid = request_id if body.n == 1 else f"{request_id}-{index}"
            request_ = GenerateRequest(rid, tuple(ids), params)
            choices.append(Choice(self, request_, index, decode, body.stops, body.include_stop_str_in_output))
        generation = Generation(self, request, choices)
        try:
            await generation.start()
        except Overloaded as exc:
            raise HTTPError(
                429, str(exc), "rate_limit_error", code="overloaded", retry_after=self.config.retry_after_s
            ) from exc
        except Unavailable as exc:
            raise HTTPError(503, str(exc), "service_unavailable") from exc
        echo = ""
        if not chat and body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else decode(ids)
        reply = Reply(request_id, self.info.name, chat, body.top_logprobs_n, echo, self._token_text)
        if not body.stream:
            try:
                async for piece in generation.pieces():
                    reply.add(piece)
            except Unavailable as exc:
                raise HTTPError(503, str(exc), "service_unavailable") from exc
            finally:
                await generation.close()
            return JSONResponse(reply.whole(usage(len(ids), generation.num_tokens)))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(self._sse(generation, reply, include_usage, len(ids)), media_type="text/event-stream")

    async def _sse(
        self, generation: Generation, reply: Reply, include_usage: bool, prompt_len: int
    ) -> AsyncIterator[str]:
        try:
            for chunk in reply.opening(len(generation.choices)):
                yield _event(chunk)
            try:
                async for piece in generation.pieces():
                    yield _event(reply.chunk(piece))
            except Unavailable as exc:  # headers are sent: report in-band, as OpenAI does
                yield _event(oai.error_body(str(exc), "service_unavailable"))
                return
            if include_usage:
                yield _event(reply.usage_chunk(usage(prompt_len, generation.num_tokens)))
            yield "data: [DONE]\n\n"
        finally:
            await generation.close()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def start_server(app: FastAPI, host: str, port: int) -> tuple[uvicorn.Server, asyncio.Task, int]:
    """Start uvicorn on this event loop; returns the server, its task, and the bound port (for port 0)."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError(f"HTTP server on {host}:{port} stopped while starting")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return server, task, bound
