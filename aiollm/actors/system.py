"""The actor every node runs under the name `_node`: remote spawning and stopping, used by graph.py.

Spawning by class path (`package.module:Class`) is safe to offer only because every connection is
authenticated with the cluster secret first, and only `Actor` subclasses are accepted.
"""

from __future__ import annotations

import asyncio
import importlib

from aiollm.actors.actor import Actor, handler
from aiollm.actors.messages import Shutdown, Spawn, Spawned, StopActor

# The system actor's name on every node.
SYSTEM_ACTOR = "_node"


def import_actor_class(path: str) -> type[Actor]:
    """The Actor subclass named by `package.module:Class`; `ValueError` naming what is wrong."""
    module_name, _, qualname = path.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"actor class {path!r}: expected 'package.module:Class'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"actor class {path!r}: cannot import {module_name!r} ({exc})") from None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not (isinstance(obj, type) and issubclass(obj, Actor)):
        raise ValueError(f"actor class {path!r}: not an Actor subclass")
    return obj


class NodeActor(Actor):
    """Spawns and stops actors on request; `Shutdown` stops the whole node."""

    @handler(Spawn)
    async def spawn(self, msg: Spawn) -> Spawned:
        ref = await self.node.spawn(import_actor_class(msg.cls), msg.name, **msg.kwargs)
        return Spawned(ref.url)

    @handler(StopActor)
    async def stop_actor(self, msg: StopActor) -> None:
        if msg.name == self.name:
            raise ValueError("the system actor stops with its node (send Shutdown)")
        await self.node.stop_actor(msg.name)

    @handler(Shutdown)
    async def shutdown(self, msg: Shutdown) -> None:
        # After this reply: the node drains this actor too, so it cannot wait for itself here.
        asyncio.get_running_loop().create_task(self.node.stop())
