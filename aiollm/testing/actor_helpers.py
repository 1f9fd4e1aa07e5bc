"""Shared pieces of the actor runtime tests: a config with short timeouts, node fixtures, a watcher actor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiollm.actors import Actor, Node, NodeConfig, Terminated, handler

SECRET = b"test-cluster-secret-0123456789"
# Short heartbeats so liveness tests finish quickly.
FAST = dict(heartbeat_interval=0.1, heartbeat_timeout=0.5, drain_timeout=1.0)


@asynccontextmanager
async def started(listen: tuple[str, ...] = (), **overrides: object) -> AsyncIterator[Node]:
    """A started node that is always stopped afterwards."""
    node = Node(NodeConfig(secret=overrides.pop("secret", SECRET), **{**FAST, **overrides}))
    await node.start(listen)
    try:
        yield node
    finally:
        await node.stop(timeout=1.0)


class Watcher(Actor):
    """Collects the Terminated notices it receives."""

    def __init__(self) -> None:
        self.terminated: asyncio.Queue[Terminated] = asyncio.Queue()

    @handler(Terminated)
    async def on_terminated(self, msg: Terminated) -> None:
        self.terminated.put_nowait(msg)


async def wait_until(predicate, timeout: float = 5.0, step: float = 0.01) -> None:
    """Poll `predicate` until true; fail with TimeoutError after `timeout` s."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(step)
