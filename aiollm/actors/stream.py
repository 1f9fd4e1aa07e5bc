"""The consumer end of a stream and its credit accounting.

Credit-based flow control: the consumer starts the producer with `window` credits; each item
costs one; each time the consumer has *taken* half a window of items it grants that many back.
So at most `window` items are ever queued here or in flight, however slow the consumer — the
producer's generator simply is not resumed at zero credit.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiollm.actors.messages import Message

# Returned by `StreamReceiver.next` when the producer finished normally.
END = object()


class StreamReceiver:
    """Items received for one stream, in order, plus how the end came (normal or an error)."""

    __slots__ = ("items", "window", "grant", "_taken", "_threshold", "_waiter", "_done", "_error")

    def __init__(self, window: int) -> None:
        if window <= 0:
            raise ValueError(f"stream window must be > 0, got {window}")
        self.items: deque[Any] = deque()
        self.window = window
        # Called with n when the consumer has taken n items; may return an awaitable (a credit frame).
        self.grant: Callable[[int], Awaitable[None] | None] = lambda n: None
        self._taken = 0
        self._threshold = max(1, window // 2)
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        """The producer ended (normally or not); no cancel needs to be sent."""
        return self._done or self._error is not None

    def push(self, item: Message) -> None:
        self.items.append(item)
        self._wake()

    def finish(self) -> None:
        self._done = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self._error = error
            self._wake()

    async def next(self) -> Any:
        """The next item, `END` after the last, or the producer's error."""
        while not self.items:
            if self._error is not None:
                raise self._error
            if self._done:
                return END
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self.items.popleft()
        self._taken += 1
        if self._taken >= self._threshold and not self.finished:
            n, self._taken = self._taken, 0
            pending = self.grant(n)
            if pending is not None:
                await pending
        return item

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


async def consume(
    rx: StreamReceiver, start: Callable[[], Awaitable[None]], cancel: Callable[[], None]
) -> AsyncIterator[Any]:
    """Start a stream and yield its items; leaving early (break, error, task cancelled) cancels the producer.

    Use `contextlib.aclosing(ref.stream(...))` to make an early `break` cancel at once rather than
    when the generator is garbage-collected.
    """
    try:
        await start()
        while True:
            item = await rx.next()
            if item is END:
                return
            yield item
    finally:
        if not rx.finished:
            cancel()
