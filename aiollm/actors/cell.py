"""`ActorCell`: the runtime around one actor — its bounded mailbox and the loop that runs one message at a time.

Why one loop task per actor and no task per message: an ask's handler runs directly in the loop,
so the ask path costs one wake-up, not a task creation. Cancelling one request (the asker gave up)
cancels the loop task while it is inside that request's handler and absorbs the cancellation with
`Task.uncancel()`; the actor keeps running. Stream handlers are async generators whose steps are
scheduled through the mailbox's system lane, so their code, too, runs one piece at a time with the
other handlers, and a generator at zero credit is simply not resumed.

A request from a peer that finds the actor idle does not even cost that wake-up: `run_now` runs
the handler from the transport's receive callback as the loop task would (see `inline.py`; on the
Pythons it was verified on, unless AIOLLM_INLINE_STEPS=0).
"""

from __future__ import annotations

import asyncio
import contextvars
import traceback
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import TYPE_CHECKING, Any

from aiollm.actors import inline
from aiollm.actors.actor import Actor
from aiollm.actors.inline import Resume, enter_task, first_step, in_task, leave_task
from aiollm.actors.mailbox import Mailbox, MailboxClosed
from aiollm.actors.messages import STREAM, Message, Terminated
from aiollm.actors.reply import LocalReply, LocalSink, Reply, Sink, wait_reply
from aiollm.actors.stream import StreamReceiver, consume
from aiollm.errors import ActorDied, AiollmError, ProtocolError, RemoteError
from aiollm.log import get_logger

if TYPE_CHECKING:
    from aiollm.actors.node import Node
    from aiollm.actors.ref import ActorRef


_log = get_logger("actors")


class ActorCell:
    """Mailbox, loop task and live streams of one actor; what Node, Peer and Watches talk to."""

    def __init__(self, actor: Actor, node: Node, name: str, ref: ActorRef, mailbox_size: int) -> None:
        actor.node, actor.name, actor.ref, actor._cell = node, name, ref, self
        self.actor = actor
        self.name = name
        self.ref = ref
        self.handlers = type(actor).handlers
        self.mailbox = Mailbox(mailbox_size, name)
        self._task: asyncio.Task | None = None
        # The loop task's contextvars, so that handlers run inline see the same ones.
        self._context = contextvars.copy_context()
        # A handler that started inline and suspended, queued for the loop task to continue.
        self._resume: Resume | None = None
        self._loop = asyncio.get_running_loop()
        # The Reply or Sink whose handler code is running right now.
        self._current: Reply | Sink | None = None
        # Streams with a live generator, closed when the actor stops.
        self._sinks: set[Sink] = set()
        self.stopped = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        await self.actor.on_start()
        self._task = self._loop.create_task(self._run(), name=f"actor:{self.name}", context=self._context)
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The loop only ends by draining or cancellation; if a runtime bug ends it otherwise, say so and stop
        the actor rather than leave askers waiting on a mailbox nobody reads."""
        if not task.cancelled() and task.exception() is not None:
            _log.error("actor loop crashed", actor=self.name, exc_info=task.exception())
            asyncio.get_running_loop().create_task(self.actor.node.stop_actor(self.name, 0.0, "crashed"))

    async def tell_local(self, msg: Message) -> None:
        item = (msg, None)
        if not self.mailbox.put_nowait(item):
            await self.mailbox.put(item)

    async def ask_local(self, msg: Message, timeout: float | None) -> Message | None:
        fut = asyncio.get_running_loop().create_future()
        reply = LocalReply(fut)
        item = (msg, reply)
        if not self.mailbox.put_nowait(item):
            await self.mailbox.put(item)
        return await wait_reply(fut, timeout, lambda: self.cancel(reply))

    def run_now(self, msg: Message, reply: Reply | None) -> bool:
        """Handle an ask or tell right away, from a transport callback, if the actor is idle; False: queue it.

        Idle means the loop task is parked on an empty mailbox, so order and one-at-a-time hold. The
        handler runs as that task (`inline.py`): its first step here, with no coroutine of the
        runtime around it, so a handler that does not suspend has been answered (`Reply.answer`)
        before this returns. One that suspends is wrapped in `_complete` and continued by the loop task.
        Never where `inline.enabled` is False (an unverified Python, or AIOLLM_INLINE_STEPS=0).
        """
        task = self._task
        loop = self._loop
        if (
            not inline.enabled
            or task is None
            or self._resume is not None
            or not self.mailbox.parked()
            or (reply is not None and reply.kind == STREAM)
            or in_task(loop)
        ):
            return False
        entry = self.handlers.get(msg.__class__)
        if entry is None or entry[1] or (reply is not None and reply.cancelled):
            self._continue(self._handle(msg, reply))  # rejected (or skipped) the usual way
            return True
        coro = entry[0](self.actor, msg)
        enter_task(loop, task)
        try:
            waiting_on = self._context.run(coro.send, None)
        except StopIteration as stop:
            leave_task(loop, task)
            result = stop.value
            if reply is None:
                return True
            if result is not None and not isinstance(result, Message):
                self._continue(reply.fail(_bad_result(msg, result)))
                return True
            rest = reply.answer(result)
            if rest is not None:
                self._continue(rest)
            return True
        except BaseException as exc:
            leave_task(loop, task)
            self._raised_inline(msg, reply, exc)
            return True
        leave_task(loop, task)
        if reply is not None:
            reply.pending(self)
        self._continue(self._complete(msg, reply, Resume(coro, waiting_on)))
        return True

    def _continue(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as the loop task from a callback: its first step now, the rest queued for the loop task."""
        try:
            done, waiting_on = first_step(self._loop, self._task, self._context, coro)
        except (Exception, asyncio.CancelledError) as exc:  # what the runtime runs here lets only its bugs through
            self._crashed(exc)
            return
        if not done:
            self._resume = resume = Resume(coro, waiting_on)
            self.mailbox.put_system(resume)

    def _raised_inline(self, msg: Message, reply: Reply | None, exc: BaseException) -> None:
        """A handler run inline raised in its first step: as `_complete` would, but from a callback."""
        if isinstance(exc, Exception):
            _log.error("handler raised", actor=self.name, message=type(msg).__name__, exc_info=exc)
            if reply is not None:
                self._continue(reply.fail(_remote_error(exc)))
        elif isinstance(exc, asyncio.CancelledError):  # not asked for (nothing could cancel it yet): the loop would end
            if reply is not None:
                self._continue(
                    reply.fail(ActorDied(f"actor {self.name!r} stopped while handling {type(msg).__name__}"))
                )
            self._crashed(exc)
        else:
            raise exc

    def _crashed(self, exc: BaseException) -> None:
        _log.error("actor loop crashed", actor=self.name, exc_info=exc)
        self._loop.create_task(self.actor.node.stop_actor(self.name, 0.0, "crashed"))

    def stream_local(self, msg: Message, window: int) -> AsyncIterator[Message]:
        rx = StreamReceiver(window)
        sink = LocalSink(rx, window)
        rx.grant = sink.grant
        return consume(rx, lambda: self.mailbox.put((msg, sink)), lambda: self.cancel(sink))

    def cancel(self, reply: Reply | Sink) -> None:
        """The asker or consumer gave up: skip the request, cancel its running handler, or close its generator."""
        if reply.cancelled:
            return
        reply.cancelled = True
        if self._current is reply and self._task is not None:
            reply.cancel_requested = True
            self._task.cancel()
        elif reply.kind == STREAM and reply.agen is not None and not reply.done:
            reply.parked = False
            self.schedule_step(reply)

    def schedule_step(self, sink: Sink) -> None:
        if not sink.queued:
            sink.queued = True
            self.mailbox.put_system(sink)

    def deliver_terminated(self, url: str, reason: str) -> None:
        """Queue a `Terminated` notice (system lane: bounded by the number of watches)."""
        if not self.mailbox.closed:
            self.mailbox.put_system((Terminated(url, reason), None))

    async def shutdown(self, timeout: float) -> None:
        """Stop taking messages, drain the mailbox for up to `timeout` s, cancel the rest, run `on_stop`."""
        if self.stopped.done():
            return
        self.mailbox.close()
        task = self._task
        if task is not None and not task.done():
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                _log.warning("drain timeout: cancelling", actor=self.name, left=len(self.mailbox))
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        died = ActorDied(f"actor {self.name!r} stopped")
        for item in self.mailbox.drain():
            if item.__class__ is tuple and item[1] is not None:  # queued stream steps are in _sinks
                await item[1].fail(died)
        for sink in list(self._sinks):
            await self._close_stream(sink, died)
        try:
            await self.actor.on_stop()
        except Exception:
            _log.exception("on_stop failed", actor=self.name)
        if not self.stopped.done():
            self.stopped.set_result(None)

    # --- the loop --------------------------------------------------------------------------

    async def _run(self) -> None:
        get = self.mailbox.get
        while True:
            try:
                item = await get()
            except MailboxClosed:
                return
            except asyncio.CancelledError:  # meant for the handler that started inline and waits for us
                if self._resume is None:
                    raise
                item = self.mailbox.take_system()  # that Resume: queued first, while the mailbox was empty
                item.error = asyncio.CancelledError()
            cls = item.__class__
            if cls is tuple:
                await self._handle(item[0], item[1])
            elif cls is Resume:
                self._resume = None
                await item
            else:
                await self._step(item)

    async def _handle(self, msg: Message, reply: Reply | Sink | None) -> None:
        if reply is not None and reply.cancelled:
            return
        entry = self.handlers.get(msg.__class__)
        is_stream = reply is not None and reply.kind == STREAM
        if entry is None or entry[1] != is_stream:
            await self._reject(msg, reply, entry)
            return
        if is_stream:
            reply.agen = entry[0](self.actor, msg)
            reply.cell = self
            self._sinks.add(reply)
            await self._step(reply)
            return
        await self._complete(msg, reply, entry[0](self.actor, msg))

    async def _complete(self, msg: Message, reply: Reply | None, handling: Awaitable[Any]) -> None:
        """Await an ask's or tell's handler (a fresh coroutine, or the `Resume` of one started inline) and answer."""
        self._current = reply
        try:
            result = await handling
        except asyncio.CancelledError:
            self._current = None
            if reply is None or not self._absorb_cancel(reply):
                if reply is not None:
                    await reply.fail(ActorDied(f"actor {self.name!r} stopped while handling {type(msg).__name__}"))
                raise
            return
        except Exception as exc:
            self._current = None
            _log.error("handler raised", actor=self.name, message=type(msg).__name__, exc_info=exc)
            if reply is not None:
                await reply.fail(_remote_error(exc))
            return
        self._current = None
        if reply is None:
            return
        if reply.cancel_requested:  # the handler swallowed our CancelledError
            reply.cancel_requested = False
            self._task.uncancel()
        if result is not None and not isinstance(result, Message):
            await reply.fail(_bad_result(msg, result))
        else:
            await reply.ok(result)

    async def _step(self, sink: Sink) -> None:
        """Run a stream's generator up to its next item, send it, and reschedule while credits last."""
        sink.queued = False
        if sink.done:
            return
        if sink.cancelled:
            await self._close_stream(sink, None)
            return
        self._current = sink
        try:
            value = await sink.agen.__anext__()
        except StopAsyncIteration:
            self._current = None
            self._finish(sink)
            await sink.end()
            return
        except asyncio.CancelledError:
            self._current = None
            self._finish(sink)
            if not self._absorb_cancel(sink):
                await sink.fail(ActorDied(f"actor {self.name!r} stopped while streaming"))
                raise
            return
        except Exception as exc:
            self._current = None
            self._finish(sink)
            _log.error("stream handler raised", actor=self.name, exc_info=exc)
            await sink.fail(_remote_error(exc))
            return
        self._current = None
        if sink.cancel_requested:
            sink.cancel_requested = False
            self._task.uncancel()
        if not isinstance(value, Message):
            error = RemoteError("TypeError", f"stream handler yielded {type(value).__name__}; yield Messages")
            await self._close_stream(sink, error)
            return
        sink.credits -= 1
        await sink.item(value)
        if sink.cancelled or sink.credits > 0:
            self.schedule_step(sink)
        else:
            sink.parked = True

    async def _close_stream(self, sink: Sink, error: AiollmError | None) -> None:
        """Close a generator suspended at a yield (its `finally` runs); tell the consumer if it still listens."""
        self._finish(sink)
        try:
            await sink.agen.aclose()
        except Exception:
            _log.exception("stream handler failed while closing", actor=self.name)
        if error is not None:
            await sink.fail(error)

    def _finish(self, sink: Sink) -> None:
        sink.done = True
        self._sinks.discard(sink)

    def _absorb_cancel(self, reply: Reply | Sink) -> bool:
        """True if the CancelledError was ours for this request (absorbed); False if the actor is stopping."""
        if not reply.cancel_requested:
            return False
        reply.cancel_requested = False
        return self._task.uncancel() == 0

    async def _reject(self, msg: Message, reply: Reply | Sink | None, entry: tuple | None) -> None:
        if entry is None:
            known = ", ".join(sorted(t.__name__ for t in self.handlers)) or "nothing"
            text = (
                f"actor {self.name!r} ({type(self.actor).__qualname__}) has no handler for "
                f"{type(msg).__name__}; it handles {known}"
            )
        elif entry[1]:
            text = f"{type(msg).__name__} is handled by a stream handler on {self.name!r}; use ref.stream()"
        else:
            text = f"{type(msg).__name__} is not a stream on {self.name!r}; use ref.ask() or ref.tell()"
        _log.warning("message rejected", actor=self.name, reason=text)
        if reply is not None:
            await reply.fail(ProtocolError(text))


def _bad_result(msg: Message, result: object) -> RemoteError:
    return RemoteError(
        "TypeError", f"handler for {type(msg).__name__} returned {type(result).__name__}; return a Message or None"
    )


def _remote_error(exc: BaseException) -> RemoteError:
    return RemoteError(type(exc).__qualname__, str(exc), "".join(traceback.format_exception(exc)))
