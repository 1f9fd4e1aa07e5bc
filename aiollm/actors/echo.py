"""The `echo` role: a small real actor that exercises every path of the runtime.

Used by the two-node demo, the runtime's integration tests and the ask-latency benchmark:
asks (`Ping`, `Echo` with an optional tensor, `PingPeer` to ping another node), a stream
(`Count`), a slow handler that can be cancelled (`Sleep`), a handler that raises (`Fail`), and
counters to observe all of it (`Stats`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import numpy as np

from aiollm.actors.actor import Actor, handler
from aiollm.actors.messages import Message
from aiollm.actors.ref import ActorRef

if TYPE_CHECKING:
    pass


class Ping(Message, tag="echo.ping"):
    """Ask for a `Pong` with the same sequence number (the latency probe)."""

    # Echoed back.
    seq: int


class Pong(Message, tag="echo.pong"):
    """Answer to `Ping`."""

    # The Ping's seq.
    seq: int


class Echo(Message, tag="echo.echo"):
    """Ask to get the same text and tensor back."""

    # Any text.
    text: str
    # An optional array, returned as received.
    data: np.ndarray | None = None


class Count(Message, tag="echo.count"):
    """Stream `Counted(0..n-1)`, waiting `delay` s before each."""

    # Number of items.
    n: int
    # Seconds before each item.
    delay: float = 0.0
    # Bytes of payload per item (a zero-filled uint8 array), to make memory in flight visible.
    payload: int = 0


class Counted(Message, tag="echo.counted"):
    """One item of a `Count` stream."""

    # Position in the stream.
    i: int
    # Payload requested by Count.payload (None when 0).
    data: np.ndarray | None = None


class Sleep(Message, tag="echo.sleep"):
    """Ask that sleeps `seconds`, then answers None; cancelling the ask cancels the sleep."""

    # How long to sleep.
    seconds: float


class Fail(Message, tag="echo.fail"):
    """Ask whose handler raises RuntimeError(text)."""

    # The exception's message.
    text: str


class GetStats(Message, tag="echo.get_stats"):
    """Ask for the counters."""


class Stats(Message, tag="echo.stats"):
    """What the echo actor has seen."""

    # Messages handled (all kinds).
    handled: int
    # Sleep handlers and Count generators that were cancelled.
    cancelled: int
    # Count items produced (yielded) so far, over all streams.
    produced: int


class PingPeer(Message, tag="echo.ping_peer"):
    """Ask the echo actor to ping another actor `n` times and report the round trips."""

    # The actor to ping (usually another node's echo).
    target: ActorRef
    # Number of pings.
    n: int


class PeerRtt(Message, tag="echo.peer_rtt"):
    """Answer to `PingPeer`: ask round-trip times seen from the pinging actor, in microseconds."""

    # Pings answered.
    n: int
    # Median round trip.
    p50_us: float
    # Slowest round trip.
    max_us: float


class EchoActor(Actor):
    """Answers the echo messages; keeps counters so tests can see remote effects."""

    def __init__(self) -> None:
        self.handled = 0
        self.cancelled = 0
        self.produced = 0

    @handler(Ping)
    async def ping(self, msg: Ping) -> Pong:
        self.handled += 1
        return Pong(msg.seq)

    @handler(Echo)
    async def echo(self, msg: Echo) -> Echo:
        self.handled += 1
        return msg

    @handler(Count)
    async def count(self, msg: Count) -> AsyncIterator[Counted]:
        self.handled += 1
        try:
            for i in range(msg.n):
                if msg.delay:
                    await asyncio.sleep(msg.delay)
                self.produced += 1
                yield Counted(i, np.zeros(msg.payload, np.uint8) if msg.payload else None)
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            raise

    @handler(Sleep)
    async def sleep(self, msg: Sleep) -> None:
        self.handled += 1
        try:
            await asyncio.sleep(msg.seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    @handler(Fail)
    async def fail(self, msg: Fail) -> None:
        self.handled += 1
        raise RuntimeError(msg.text)

    @handler(PingPeer)
    async def ping_peer(self, msg: PingPeer) -> PeerRtt:
        self.handled += 1
        times = []
        for seq in range(msg.n):
            start = time.perf_counter()
            await msg.target.ask(Ping(seq), timeout=10)
            times.append((time.perf_counter() - start) * 1e6)
        return PeerRtt(msg.n, float(np.median(times)), max(times))

    @handler(GetStats)
    async def stats(self, msg: GetStats) -> Stats:
        return Stats(self.handled, self.cancelled, self.produced)
