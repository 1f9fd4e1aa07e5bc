"""Actors on one node: handler table, one message at a time, errors, backpressure, streams, cancel, watch, stop."""

import asyncio
from contextlib import aclosing

import numpy as np
import pytest

from aiollm.actors import Actor, Message, handler
from aiollm.actors.echo import Count, Echo, EchoActor, Fail, GetStats, Ping, Pong, Sleep
from aiollm.errors import ActorDied, ProtocolError, RemoteError
from aiollm.testing.actor_helpers import Watcher, started, wait_until

pytestmark = pytest.mark.usefixtures("inline_steps")  # every test on the inline and the plain path


class Hold(Message, tag="test.actor.hold"):
    """Handled by waiting on the actor's gate."""

    # label recorded by the actor
    n: int


class Odd(Message, tag="test.actor.odd"):
    """A message the Gate actor has no handler for."""


class Bad(Message, tag="test.actor.bad"):
    """Handled by returning a non-Message."""


class Gate(Actor):
    """Holds each message until `gate` is set; records order and concurrency."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.seen: list[int] = []
        self.running = 0
        self.max_running = 0

    @handler(Hold)
    async def hold(self, msg: Hold) -> None:
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        await self.gate.wait()
        self.seen.append(msg.n)
        self.running -= 1

    @handler(Bad)
    async def bad(self, msg: Bad) -> int:
        return 42


async def test_local_ask_tell_stream_pass_objects_as_is() -> None:
    async with started() as node:
        ref = await node.spawn(EchoActor, "echo")
        msg = Echo("hi", np.arange(3))
        assert await ref.ask(msg) is msg  # no serialisation on the same node
        assert await ref.ask(Ping(5), timeout=1) == Pong(5)
        await ref.tell(Ping(6))
        assert [c.i async for c in ref.stream(Count(5))] == [0, 1, 2, 3, 4]
        assert (await ref.ask(GetStats())).handled == 4


async def test_handler_error_becomes_remote_error_and_actor_lives() -> None:
    async with started() as node:
        ref = await node.spawn(EchoActor, "echo")
        with pytest.raises(RemoteError) as info:
            await ref.ask(Fail("boom"))
        assert info.value.type_name == "RuntimeError" and info.value.message == "boom"
        assert "raise RuntimeError(msg.text)" in info.value.traceback_text
        assert await ref.ask(Ping(1)) == Pong(1)


async def test_unknown_message_and_wrong_kind_are_rejected() -> None:
    async with started() as node:
        gate = await node.spawn(Gate, "gate")
        with pytest.raises(ProtocolError, match="has no handler for Odd; it handles Bad, Hold"):
            await gate.ask(Odd())
        with pytest.raises(RemoteError, match="returned int"):
            await gate.ask(Bad())
        echo = await node.spawn(EchoActor, "echo")
        with pytest.raises(ProtocolError, match="use ref.stream"):
            await echo.ask(Count(3))
        with pytest.raises(ProtocolError, match="not a stream"):
            async for _ in echo.stream(Ping(1)):
                pass
        with pytest.raises(TypeError, match="Message instances"):
            await echo.ask("hello")


async def test_handler_table_is_checked_at_class_definition() -> None:
    with pytest.raises(TypeError, match="must be `async def`"):

        class Sync(Actor):
            @handler(Ping)
            def ping(self, msg):
                return None

    with pytest.raises(TypeError, match="two handlers for Ping"):

        class Twice(Actor):
            @handler(Ping)
            async def a(self, msg):
                return None

            @handler(Ping)
            async def b(self, msg):
                return None


async def test_one_message_at_a_time_and_full_mailbox_makes_senders_wait() -> None:
    async with started(mailbox_size=2) as node:
        actor = Gate()
        ref = await node.spawn(actor, "gate")
        for n in range(3):  # one being handled, two queued
            await ref.tell(Hold(n))
        blocked = asyncio.ensure_future(ref.tell(Hold(3)))
        await asyncio.sleep(0.05)
        assert not blocked.done()  # the sender waits while the mailbox is full
        actor.gate.set()
        await asyncio.wait_for(blocked, 1)
        await wait_until(lambda: len(actor.seen) == 4)
        assert actor.seen == [0, 1, 2, 3] and actor.max_running == 1


async def test_slow_stream_consumer_bounds_the_producer() -> None:
    async with started() as node:
        echo = EchoActor()
        ref = await node.spawn(echo, "echo")
        window = 4
        consumed = 0
        async with aclosing(ref.stream(Count(1000), window=window)) as items:
            async for item in items:
                assert item.i == consumed
                consumed += 1
                await asyncio.sleep(0.002)  # a slow consumer
                assert consumed <= echo.produced <= consumed + window
                if consumed == 40:
                    break
        await wait_until(lambda: echo.cancelled == 1)  # leaving early closed the generator
        assert echo.produced <= 40 + window


async def test_cancelling_an_ask_cancels_the_handler() -> None:
    async with started() as node:
        echo = EchoActor()
        ref = await node.spawn(echo, "echo")
        with pytest.raises(TimeoutError):
            await ref.ask(Sleep(10), timeout=0.05)
        await wait_until(lambda: echo.cancelled == 1)
        task = asyncio.ensure_future(ref.ask(Sleep(10)))
        await asyncio.sleep(0.05)
        task.cancel()
        await wait_until(lambda: echo.cancelled == 2)
        assert await ref.ask(Ping(1), timeout=1) == Pong(1)  # the actor keeps running


async def test_cancelling_a_queued_ask_skips_it() -> None:
    async with started() as node:
        actor = Gate()
        ref = await node.spawn(actor, "gate")
        await ref.tell(Hold(0))
        with pytest.raises(TimeoutError):
            await ref.ask(Hold(1), timeout=0.05)
        await ref.tell(Hold(2))
        actor.gate.set()
        await wait_until(lambda: actor.seen == [0, 2])


async def test_watch_gets_terminated_when_actor_stops() -> None:
    async with started() as node:
        ref = await node.spawn(EchoActor, "echo")
        watcher = Watcher()
        await node.spawn(watcher, "watcher")
        await watcher.watch(ref)
        await node.stop_actor("echo")
        notice = await asyncio.wait_for(watcher.terminated.get(), 1)
        assert notice.url == ref.url and notice.reason == "stopped"
        with pytest.raises(ActorDied):
            await ref.ask(Ping(1))
        await watcher.watch(ref)  # watching what is already gone answers at once
        assert (await asyncio.wait_for(watcher.terminated.get(), 1)).reason == "not found"
    with pytest.raises(TypeError, match="no @handler\\(Terminated\\)"):
        await EchoActor().watch(ref)


async def test_stop_drains_then_fails_what_is_left() -> None:
    async with started() as node:
        actor = Gate()
        ref = await node.spawn(actor, "gate")
        asks = [asyncio.ensure_future(ref.ask(Hold(n))) for n in range(3)]
        await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(node.stop_actor("gate", timeout=0.1))
        await asyncio.sleep(0.01)
        with pytest.raises(ActorDied):  # no new messages while draining
            await ref.tell(Hold(9))
        await stopping
        results = await asyncio.gather(*asks, return_exceptions=True)
        assert all(isinstance(r, ActorDied) for r in results)

        actor = Gate()
        ref = await node.spawn(actor, "gate2")
        asks = [asyncio.ensure_future(ref.ask(Hold(n))) for n in range(3)]
        await asyncio.sleep(0.01)
        actor.gate.set()
        await node.stop_actor("gate2", timeout=1)  # drained within the timeout: every ask answered
        assert await asyncio.gather(*asks) == [None, None, None]


class Quit(Message, tag="test.actor.quit"):
    """Makes the actor stop itself."""


class Named(Actor):
    """Handlers named like runtime internals must not break the actor (the runtime lives in ActorCell)."""

    @handler(Ping)
    async def start(self, msg: Ping) -> Pong:
        return Pong(msg.seq)

    @handler(Hold)
    async def cancel(self, msg: Hold) -> None:
        return None

    @handler(Quit)
    async def shutdown(self, msg: Quit) -> None:
        self.stop()


async def test_handler_names_cannot_shadow_the_runtime_and_an_actor_can_stop_itself() -> None:
    async with started() as node:
        ref = await node.spawn(Named, "named")
        assert await ref.ask(Ping(3)) == Pong(3)
        assert await ref.ask(Hold(1)) is None
        watcher = Watcher()
        await node.spawn(watcher, "watcher")
        await watcher.watch(ref)
        await ref.ask(Quit())
        assert (await asyncio.wait_for(watcher.terminated.get(), 1)).reason == "stopped"
        assert "named" not in node.actors


async def test_node_listens_on_several_addresses_and_routes_all_of_them_locally() -> None:
    async with started(("inproc://multi-a", "tcp://127.0.0.1:0")) as node:
        assert node.url == "inproc://multi-a" and node.addresses[1].startswith("tcp://127.0.0.1:")
        await node.spawn(EchoActor, "echo")
        msg = Echo("same object")
        for address in node.addresses:
            assert await node.ref(f"{address}/echo").ask(msg) is msg  # local: no serialisation
        async with started() as other:
            for address in node.addresses:
                out = await other.ref(f"{address}/echo").ask(msg)
                assert out == msg and out is not msg


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"secret": b"short"}, "secret"),
        ({"heartbeat_interval": 0}, "heartbeat_interval"),
        ({"heartbeat_interval": 2.0, "heartbeat_timeout": 1.0}, "heartbeat_timeout"),
        ({"mailbox_size": 0}, "mailbox_size"),
        ({"max_frame_bytes": -1}, "max_frame_bytes"),
        ({"stream_window": 0}, "stream_window"),
        ({"name": "a/b"}, "name"),
    ],
)
def test_node_config_names_the_bad_field(overrides: dict, field: str) -> None:
    from aiollm.actors import NodeConfig

    with pytest.raises(ValueError, match=f"NodeConfig.{field}"):
        NodeConfig(**{"secret": b"0123456789abcdef", **overrides})
