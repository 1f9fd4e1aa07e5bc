"""OpenAI's request shapes for /v1/completions and /v1/chat/completions (and vLLM's /tokenize, /detokenize).

Requests are pydantic models (FastAPI validates them at the edge and the frontend turns a validation
error into OpenAI's 400 body naming the parameter). Nothing a client sends is silently ignored: an
unknown field is a 400 naming it (`extra="forbid"`), and a known one aiollm cannot honour (`suffix`,
`best_of` != n, `echo` with `logprobs`, tools and functions, `spaces_between_special_tokens=false`) is a 400
naming it too. `response_format` `json_object` and `json_schema` are honoured by constrained decoding
(aiollm.model.structured); a schema it cannot follow is a 400 naming `response_format`. `user`, `metadata`, `store`
and `parallel_tool_calls` are accepted because they cannot change an answer: aiollm neither stores
requests nor calls tools. vLLM's `extra_body` extensions `top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `skip_special_tokens` and `include_stop_str_in_output`
are honoured. Responses are built in aiollm.frontend.responses.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from aiollm.model.logprobs import MAX_TOP_LOGPROBS
from aiollm.model.sampling import MAX_INT, MAX_LOGIT_BIAS, MAX_PENALTY, MAX_REPETITION_PENALTY

# OpenAI caps `stop` at 4 sequences.
MAX_STOP_SEQUENCES = 4
# most choices one request may ask for (`n`)
MAX_CHOICES = 16
# a seed is an int64, as OpenAI's and vLLM's are
INT64 = 2**63


def valid_text(value: str, what: str) -> str:
    """`value` if it is valid Unicode; a lone surrogate ("\\ud800" in the JSON) has no UTF-8 form and no tokens."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode: {exc.reason} at position {exc.start}") from None
    return value


class _Strict(BaseModel):
    """Every request model refuses fields it does not know."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous(cls, value: bool) -> bool:
        if value:
            raise ValueError("continuous_usage_stats is not supported")
        return value


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: the schema the output follows (`strict` is accepted; the schema is always
    enforced, additional properties only where it allows them, as vLLM's xgrammar backend does)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with, and only with, type 'json_schema'")
        return self

    @property
    def schema_text(self) -> str | None:
        """The JSON schema's text for type json_schema, else None."""
        if self.json_schema is None:
            return None
        return json.dumps(self.json_schema.schema_, separators=(",", ":"), ensure_ascii=False)


class _SamplingFields(_Strict):
    """Fields shared by both endpoints."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # vLLM: 0 or -1 keeps every token
    top_k: int = Field(0, ge=-1, le=MAX_INT)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    # accepted, with no effect on the answer by definition: aiollm stores nothing
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return [valid_text(s, "a stop sequence") for s in stops]

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int]:
        if any(not 0 <= t <= MAX_INT for t in value or []):
            raise ValueError(f"token ids must be in [0, {MAX_INT}]")
        return list(value or [])

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float]:
        for key, bias in (value or {}).items():
            if not key.isdigit() or int(key) > MAX_INT:
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}")
        return dict(value or {})

    @field_validator("spaces_between_special_tokens")
    @classmethod
    def _spaces(cls, value: bool) -> bool:
        if not value:
            raise ValueError("only true is supported (the tokenizer decodes special tokens as they are)")
        return value

    @property
    def stops(self) -> list[str]:
        return self.stop or []  # normalised to a list by the validator

    @property
    def top_logprobs_n(self) -> int | None:
        """None without logprobs; else how many alternatives each token reports."""
        raise NotImplementedError

    def refusal(self) -> tuple[str, str] | None:
        """(message, param) of the first cross-field rule the request breaks, or None."""
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
        return None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
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

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix is not supported")
        return value

    @property
    def top_logprobs_n(self) -> int | None:
        return self.logprobs

    def refusal(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of != self.n:
            return f"best_of ({self.best_of}) must equal n ({self.n}): choices are never ranked", "best_of"
        if self.echo and self.logprobs is not None:
            return "echo with logprobs is not supported (prompt logprobs are not computed)", "echo"
        return super().refusal()


class ChatMessage(_Strict):
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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # accepted, with no effect by definition: aiollm calls no tools
    parallel_tool_calls: bool | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, value):
        if value:
            raise ValueError("tool calling is not supported")
        return value

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, value):
        if value not in (None, "none"):
            raise ValueError("tool calling is not supported (only 'none')")
        return value

    @property
    def top_logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is None:
            self.max_tokens = self.max_completion_tokens
        return self

    def refusal(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs set to true", "top_logprobs"
        return super().refusal()


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM): a prompt, or chat messages through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # default: True for a prompt, False for messages (the template writes the special tokens)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True

    @field_validator("prompt")
    @classmethod
    def _valid(cls, value):
        return valid_text(value, "the prompt") if value is not None else value


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM)."""

    model: str | None = None
    tokens: list[int]


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON shape."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
