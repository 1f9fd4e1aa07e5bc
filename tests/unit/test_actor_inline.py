"""Handlers run inline from a transport callback (`ActorCell.run_now`) behave as if the actor's task ran them."""

import asyncio
import contextvars

import pytest

from aiollm.actors import Actor, Message, handler
from aiollm.actors.echo import EchoActor, Ping, Pong, Sleep
from aiollm.actors.reply import LocalReply
from aiollm.testing.actor_helpers import started


@pytest.fixture
def inline_path(inline_steps):
    """For the tests of the inline path itself (they assert that `run_now` ran the handler): skipped on the plain path."""
    if not inline_steps:
        pytest.skip("asserts the inline path; on the plain path run_now declines every request")


LABEL = contextvars.ContextVar("label", default="unset")


class Probe(Message, tag="test.inline.probe"):
    """Ask what the handler sees of its task and context; waits `pause` s in the middle when > 0."""

    # seconds to sleep between the two looks
    pause: float = 0.0


class Seen(Message, tag="test.inline.seen"):
    """What a Probe handler saw."""

    # current_task() was the actor's loop task, before and after the pause
    own_task: list[bool]
    # the context variable set by the previous Probe handler, before the pause
    label: str


class ProbeActor(Actor):
    @handler(Probe)
    async def probe(self, msg: Probe) -> Seen:
        cell_task = self._cell._task
        own = [asyncio.current_task() is cell_task]
        label = LABEL.get()
        LABEL.set("set by a handler")
        if msg.pause:
            async with asyncio.timeout(5):  # needs a current task
                await asyncio.sleep(msg.pause)
        own.append(asyncio.current_task() is cell_task)
        return Seen(own, label)


async def inline(cell, msg):
    """Call run_now from a plain callback, as a transport does; returns (ran inline, the reply future)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    reply = LocalReply(fut)
    done = loop.create_future()
    loop.call_soon(lambda: done.set_result(cell.run_now(msg, reply)))
    return await done, fut, reply


async def test_run_now_runs_the_handler_only_on_the_inline_path(inline_steps) -> None:
    async with started() as node:
        await node.spawn(EchoActor, "echo")
        ran, fut, _ = await inline(node.actors["echo"], Ping(1))
        assert ran is inline_steps
        if not ran:  # the caller (a transport) queues it instead, and the actor's task answers
            assert await node.ref("echo").ask(Ping(2), timeout=2) == Pong(2)
        else:
            assert fut.result() == Pong(1)


@pytest.mark.usefixtures("inline_path")
async def test_inline_handler_sees_its_own_task_and_context_and_may_suspend() -> None:
    async with started() as node:
        await node.spawn(ProbeActor, "probe")
        cell = node.actors["probe"]
        ran, fut, _ = await inline(cell, Probe())
        assert ran and fut.done()  # replied before the callback returned
        assert fut.result() == Seen([True, True], "unset")
        ran, fut, _ = await inline(cell, Probe(pause=0.01))
        assert ran and not fut.done()  # suspended: the loop task continues it
        assert await asyncio.wait_for(fut, 2) == Seen([True, True], "set by a handler")
        ref = node.ref("probe")
        assert await ref.ask(Probe()) == Seen([True, True], "set by a handler")  # the queued path, same context


@pytest.mark.usefixtures("inline_path")
async def test_not_inline_while_busy_or_from_a_task() -> None:
    async with started() as node:
        await node.spawn(EchoActor, "echo")
        cell = node.actors["echo"]
        assert not cell.run_now(Ping(1), LocalReply(asyncio.get_running_loop().create_future()))  # inside a task
        ran, slow, _ = await inline(cell, Sleep(0.2))
        assert ran
        ran, _fut, _ = await inline(cell, Ping(2))
        assert not ran  # the actor is still in Sleep: the caller queues instead
        assert await asyncio.wait_for(slow, 2) is None


@pytest.mark.usefixtures("inline_path")
@pytest.mark.parametrize("before_takeover", [True, False], ids=["before-takeover", "after-takeover"])
async def test_cancelling_a_suspended_inline_handler(before_takeover) -> None:
    async with started() as node:
        await node.spawn(EchoActor, "echo")
        cell = node.actors["echo"]
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        reply = LocalReply(fut)
        both = loop.create_future()

        def start_and_cancel():
            cell.run_now(Sleep(10), reply)
            if before_takeover:  # the loop task has not yet taken the handler over
                cell.cancel(reply)
            both.set_result(None)

        loop.call_soon(start_and_cancel)
        await both
        if not before_takeover:
            await asyncio.sleep(0.05)
            cell.cancel(reply)
        await asyncio.sleep(0.05)
        assert not fut.done()  # a cancelled ask is not answered; the actor lives on
        assert cell.actor.cancelled == 1  # the handler itself saw the cancellation
        assert await node.ref("echo").ask(Ping(3), timeout=2) == Pong(3)
