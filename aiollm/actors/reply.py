"""Where an actor's answers go: a `Reply` for an ask, a `Sink` for a stream, local or remote alike.

The actor loop only calls `ok`/`fail` (asks) and `item`/`end`/`fail` (streams); whether that sets a
future in this process or sends a frame to a peer is the subclass's business (`peer.py` has the
remote ones). Both carry the cancellation flags the loop checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiollm.actors.messages import ASK, STREAM, Message
from aiollm.errors import AiollmError

if TYPE_CHECKING:
    from aiollm.actors.cell import ActorCell
    from aiollm.actors.stream import StreamReceiver


class Reply:
    """The answer slot of one ask.

    Subclasses implement `answer`, which is synchronous so that a handler run from a transport
    callback can reply there (no coroutine when the answer goes out at once), and `fail`.
    """

    __slots__ = ("cancelled", "cancel_requested")
    kind = ASK

    def __init__(self) -> None:
        # The asker gave up: skip the request if it is still queued.
        self.cancelled = False
        # The actor loop task was cancelled on behalf of this request (it must `uncancel`).
        self.cancel_requested = False

    def answer(self, value: Message | None) -> Awaitable[None] | None:
        """Deliver the handler's return value now if possible (None), else return what finishes it (awaited
        by the actor, so a slow link holds the actor back). Never raises: an unsendable value fails the ask."""
        raise NotImplementedError

    async def ok(self, value: Message | None) -> None:
        rest = self.answer(value)
        if rest is not None:
            await rest

    async def fail(self, error: AiollmError) -> None:
        raise NotImplementedError

    def pending(self, cell: ActorCell) -> None:
        """The handler was started inline and suspended: from now on a cancellation must find it in `cell`."""


class LocalReply(Reply):
    """An ask from this process: the answer is set on the asker's future, no serialisation."""

    __slots__ = ("fut",)

    def __init__(self, fut: asyncio.Future) -> None:
        super().__init__()
        self.fut = fut

    def answer(self, value: Message | None) -> None:
        if not self.fut.done():
            self.fut.set_result(value)

    async def fail(self, error: AiollmError) -> None:
        if not self.fut.done():
            self.fut.set_exception(error)


class Sink:
    """The producer end of one stream: items are sent while credits last, then the generator is parked."""

    __slots__ = ("credits", "agen", "cell", "parked", "queued", "done", "cancelled", "cancel_requested")
    kind = STREAM

    def __init__(self, credits: int) -> None:
        # Items the consumer still accepts before it grants more.
        self.credits = credits
        # The handler's async generator, set when the stream starts.
        self.agen: Any = None
        # The producing actor's cell, set when the stream starts.
        self.cell: ActorCell | None = None
        # Waiting for credit (not in the mailbox's system lane).
        self.parked = False
        # In the system lane, waiting for its next step.
        self.queued = False
        # Finished, failed or cancelled: no more steps.
        self.done = False
        self.cancelled = False
        self.cancel_requested = False

    def grant(self, n: int) -> None:
        """The consumer took items: allow `n` more and resume a parked generator."""
        self.credits += n
        if self.parked and not self.done:
            self.parked = False
            self.cell.schedule_step(self)

    async def item(self, value: Message) -> None:
        raise NotImplementedError

    async def end(self) -> None:
        raise NotImplementedError

    async def fail(self, error: AiollmError) -> None:
        raise NotImplementedError


class LocalSink(Sink):
    """A stream consumed in this process: items go straight into the consumer's receiver."""

    __slots__ = ("rx",)

    def __init__(self, rx: StreamReceiver, credits: int) -> None:
        super().__init__(credits)
        self.rx = rx

    async def item(self, value: Message) -> None:
        self.rx.push(value)

    async def end(self) -> None:
        self.rx.finish()

    async def fail(self, error: AiollmError) -> None:
        self.rx.fail(error)


async def wait_reply(fut: asyncio.Future, timeout: float | None, on_abandon: Callable[[], None]) -> Any:
    """Await an ask's future with an optional timeout (a timer, not a task); `on_abandon` runs on
    timeout or cancellation so the remote handler is cancelled too."""
    if timeout is None:
        handle = None
    else:
        handle = asyncio.get_running_loop().call_later(timeout, expire, fut, timeout)
    try:
        return await fut
    except (asyncio.CancelledError, TimeoutError):
        on_abandon()
        raise
    finally:
        if handle is not None:
            handle.cancel()


def expire(fut: asyncio.Future, timeout: float) -> None:
    """Timer callback: fail an ask's future with TimeoutError unless it is already settled."""
    if not fut.done():
        fut.set_exception(TimeoutError(f"no reply within {timeout} s"))
