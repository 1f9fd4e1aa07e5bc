"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions.

Requests are pydantic models (FastAPI validates them at the edge and the frontend turns a
validation error into OpenAI's 400 body naming the parameter). Parameters aiollm cannot honour
(n > 1, logprobs, penalties, logit_bias, echo) are refused with a 400 naming them, rather than
silently ignored. `top_k` and `ignore_eos` are accepted as vLLM-style extensions (`extra_body`).
Responses are plain dicts built by the functions below, in the field order OpenAI uses.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from aiollm.model.sampling import MAX_INT

# OpenAI caps `stop` at 4 sequences.
MAX_STOP_SEQUENCES = 4
# a seed is an int64, as OpenAI's and vLLM's are
INT64 = 2**63


def valid_text(value: str, what: str) -> str:
    """`value` if it is valid Unicode; a lone surrogate ("\\ud800" in the JSON) has no UTF-8 form and no tokens."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode: {exc.reason} at position {exc.start}") from None
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=MAX_INT)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; pass 0 or omit it")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return [valid_text(s, "a stop sequence") for s in stops]

    @property
    def stops(self) -> list[str]:
        return self.stop or []  # normalised to a list by the validator


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be empty")
            if isinstance(value[0], str):
                if len(value) != 1:
                    raise ValueError("only one prompt per request is supported")
                value = value[0]
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        return valid_text(value, "the prompt") if isinstance(value, str) else value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    @field_validator("logprobs", "best_of")
    @classmethod
    def _unsupported(cls, value):
        if value not in (None, 0, 1):
            raise ValueError("not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict]

    @field_validator("content")
    @classmethod
    def _text_only(cls, value):
        if isinstance(value, str):
            return valid_text(value, "the content")
        parts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return valid_text("".join(parts), "the content")


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool) -> bool:
        if value:
            raise ValueError("logprobs is not supported")
        return value

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(request_id: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    return _response("text_completion", request_id, model, [_text_choice(text, finish_reason)], use)


def completion_chunk(
    request_id: str, model: str, text: str, finish_reason: str | None, use: dict | None = None
) -> dict:
    choices = [] if use is not None else [_text_choice(text, finish_reason)]
    return _response("text_completion", request_id, model, choices, use)


def chat_completion(request_id: str, model: str, text: str, finish_reason: str, use: dict) -> dict:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return _response("chat.completion", request_id, model, [choice], use)


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None, use: dict | None = None) -> dict:
    choices = (
        [] if use is not None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    )
    return _response("chat.completion.chunk", request_id, model, choices, use)


def _text_choice(text: str, finish_reason: str | None) -> dict:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


def _response(kind: str, request_id: str, model: str, choices: list[dict], use: dict | None) -> dict:
    """The envelope every response and streamed chunk shares; `usage` only where given."""
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body
