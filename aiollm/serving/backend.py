"""The small async interface between the HTTP frontend and whatever generates tokens.

Why an interface: the same frontend serves the disaggregated cluster (through the controller
actor) and, for tests and the colocated baseline, an in-process engine. Both take a tokenised
request with its sampling options and yield token deltas until a finish reason; both can cancel
a request, which frees its KV wherever it lives. Text (detokenisation, stop strings) stays in the
frontend, so the backends only ever see token ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from aiollm.errors import AiollmError
from aiollm.model.logprobs import TokenLogprobs
from aiollm.model.sampling import SamplingParams
from aiollm.model.sequence import FINISH_LENGTH, FINISH_STOP


class Overloaded(AiollmError):
    """The backend is at its admission limit right now; the client may retry later (HTTP 429)."""


class Unavailable(AiollmError):
    """The backend cannot serve at all right now, e.g. no live prefill or decode instance (HTTP 503)."""


@dataclass(frozen=True)
class GenerateRequest:
    """One tokenised request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    # how to sample (max_tokens, temperature, penalties, seed, logprobs, ...); stop strings stay in the frontend
    sampling: SamplingParams

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: prompt_ids must not be empty")


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one request; the last delta carries the finish reason."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    # one entry per token, only for a request that asks for logprobs
    logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class BackendStats:
    """Load figures the frontend exports on /metrics."""

    # requests accepted but not yet producing tokens
    waiting: int = 0
    # requests producing tokens
    running: int = 0
    # queue length of each prefill instance (or the one colocated instance), by name
    prefill_queues: dict[str, int] = field(default_factory=dict)
    # requests waiting for admission at each decode instance, by name
    decode_queues: dict[str, int] = field(default_factory=dict)
    # KV blocks in use and in total, summed over live instances
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    # each instance's liveness and the KV blocks it holds, by name (empty for a single in-process engine)
    alive: dict[str, bool] = field(default_factory=dict)
    instance_kv_blocks_used: dict[str, int] = field(default_factory=dict)
    # requests resumed after losing an instance, by how ("repull", "reprefill")
    resumed: dict[str, int] = field(default_factory=dict)
    # replans enacted, and the last one in words
    replans: int = 0
    last_replan: str = ""
    # prefix caching: prompt tokens prefilled and those mapped from a prefix cache; prompt KV blocks decode
    # instances pulled and those they mapped from their own cache instead
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    kv_blocks_pulled: int = 0
    kv_blocks_reused: int = 0

    @property
    def serving(self) -> bool:
        """Whether a request can be served now: a live prefill and a live decode instance (or no instances
        to lose: an in-process engine)."""
        if not self.alive:
            return True
        return any(self.alive.get(n) for n in self.prefill_queues) and any(
            self.alive.get(n) for n in self.decode_queues
        )


@dataclass(frozen=True)
class ModelInfo:
    """What the frontend tells clients about the served model."""

    # the id clients pass as `model`
    name: str
    # longest prompt + completion, in tokens
    max_context: int


class Backend(Protocol):
    """What the frontend needs from a token generator."""

    def submit(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Start generating; the iterator ends after the delta with a finish reason.

        Raises `Overloaded` or `Unavailable` (from the first `__anext__`) when it cannot take the request."""
        ...

    async def cancel(self, request_id: str) -> None:
        """Stop a request and free its KV; a no-op for an unknown or finished request."""
        ...

    async def stats(self) -> BackendStats: ...


__all__ = [
    "FINISH_LENGTH",
    "FINISH_STOP",
    "Backend",
    "BackendStats",
    "GenerateRequest",
    "ModelInfo",
    "Overloaded",
    "TokenDelta",
    "Unavailable",
]
