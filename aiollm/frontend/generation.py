"""One HTTP request's generation: its choices' token deltas -> per-token pieces of text, interleaved.

Each choice (`n` of them) is its own backend request. A choice yields one `Piece` per generated token,
as vLLM streams: a token whose text is not settled yet (part of a UTF-8 character, a special token, the
start of a possible stop string) gives a piece with empty text, and its text arrives with a later piece,
so a client counting chunks counts tokens. A stop string ends the choice (the backend is cancelled);
the last piece carries the finish reason. `Generation` submits every choice, waits for each one's first
piece (so an overloaded or unavailable backend is still an HTTP error, not a broken stream), then yields
the choices' pieces as they arrive. A client that disconnects cancels every choice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from aiollm.frontend.detokenize import IncrementalText
from aiollm.log import get_logger
from aiollm.model.logprobs import TokenLogprobs
from aiollm.serving.backend import FINISH_STOP, GenerateRequest, Unavailable

_log = get_logger("frontend")
_DONE = object()


@dataclass(frozen=True)
class Piece:
    """One generated token's share of a choice's text."""

    # the choice it belongs to
    index: int
    # newly settled text (may be empty)
    text: str
    # the finish reason on the choice's last piece
    finish: str | None
    # the token (None only for an empty final delta)
    token: int | None
    # its logprobs, when the request asks for them
    logprobs: TokenLogprobs | None
    # characters of the choice's text before this piece
    offset: int


class Choice:
    """One choice: backend deltas -> pieces, stop strings, metrics, cancel on an unfinished exit."""

    def __init__(
        self,
        frontend: Any,
        request: GenerateRequest,
        index: int,
        decode: Callable[[list[int]], str],
        stops: list[str],
        include_stop: bool = False,
    ) -> None:
        self.frontend, self.request, self.index = frontend, request, index
        self.text = IncrementalText(decode, stops, include_stop)
        self.arrival = time.monotonic()
        self.num_tokens = 0

    def _piece(self, text: str, finish: str | None, token: int | None, lp: TokenLogprobs | None, at: int) -> Piece:
        return Piece(self.index, text, finish, token, lp, at)

    async def pieces(self) -> AsyncIterator[Piece]:
        """One piece per token, the last with the finish reason; cancels the backend on exit unless finished."""
        backend, metrics, rid = self.frontend.backend, self.frontend.metrics, self.request.request_id
        first = last = None
        outcome = "aborted"
        self.frontend.in_flight += 1
        try:
            metrics.prompt_tokens.inc(len(self.request.prompt_ids))
            async for delta in backend.submit(self.request):
                last = time.monotonic()
                first = first or last
                metrics.tokens_generated(len(delta.token_ids))
                entries = delta.logprobs or []
                for k, token in enumerate(delta.token_ids):
                    self.num_tokens += 1
                    at = len(self.text.text)
                    text = self.text.feed([token])
                    lp = entries[k] if k < len(entries) else None
                    if self.text.stopped:
                        outcome = "stop"
                        await backend.cancel(rid)
                        yield self._piece(text, FINISH_STOP, token, lp, at)
                        return
                    if k + 1 == len(delta.token_ids) and delta.finish_reason is not None:
                        outcome = delta.finish_reason
                        yield self._piece(text + self.text.flush(), delta.finish_reason, token, lp, at)
                        return
                    yield self._piece(text, None, token, lp, at)
                if not delta.token_ids and delta.finish_reason is not None:
                    outcome = delta.finish_reason
                    yield self._piece(self.text.flush(), delta.finish_reason, None, None, len(self.text.text))
                    return
            raise Unavailable(f"request {rid} ended without a finish reason (cancelled)")
        finally:
            self.frontend.in_flight -= 1
            # counted before the await below: a dropped stream's task may be cancelled again while it waits
            metrics.request_done(outcome, self.arrival, first, last, self.num_tokens)
            if outcome == "aborted":
                await asyncio.shield(backend.cancel(rid))


class Generation:
    """The choices of one HTTP request, streamed together; `start` first, `close` always."""

    def __init__(self, frontend: Any, http: Any, choices: list[Choice]) -> None:
        self.frontend, self.http, self.choices = frontend, http, choices
        self._iters = [c.pieces() for c in choices]
        self._firsts: list[Piece] = []
        self._pumps: list[asyncio.Task] = []
        self._watcher: asyncio.Task | None = None

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    async def start(self) -> None:
        """Submit every choice and wait for its first piece; raises the backend's `Overloaded` or `Unavailable`."""
        self._watcher = asyncio.create_task(self._watch_disconnect())
        results = await asyncio.gather(*(anext(it) for it in self._iters), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            await self.close()
            raise failed
        self._firsts = list(results)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Every choice's pieces, each choice in order, the choices interleaved as their tokens arrive."""
        queue: asyncio.Queue = asyncio.Queue()
        for it, first in zip(self._iters, self._firsts):
            if first.finish is None:
                self._pumps.append(asyncio.create_task(self._pump(it, queue)))
        for first in self._firsts:
            yield first
        live = len(self._pumps)
        while live:
            item = await queue.get()
            if item is _DONE:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    @staticmethod
    async def _pump(it: AsyncIterator[Piece], queue: asyncio.Queue) -> None:
        try:
            async for piece in it:
                queue.put_nowait(piece)
            queue.put_nowait(_DONE)
        except Exception as exc:
            queue.put_nowait(exc)

    async def close(self) -> None:
        """Stop every choice still running (each cancels its backend request) and the disconnect watcher."""
        if self._watcher is not None:
            self._watcher.cancel()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        for it in self._iters:
            await it.aclose()

    async def _watch_disconnect(self) -> None:
        """Cancel every choice's backend request once the HTTP client has gone."""
        while True:
            message = await self.http.receive()
            if message["type"] == "http.disconnect":
                _log.info("client disconnected", request_id=self.choices[0].request.request_id)
                for choice in self.choices:
                    await self.frontend.backend.cancel(choice.request.request_id)
                return
