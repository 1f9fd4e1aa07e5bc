"""The `Actor` base class users subclass, and the `@handler` decorator that builds its handler table.

The runtime state (mailbox, loop task, streams) lives in a separate `ActorCell` (`cell.py`), so
the only names an actor inherits are the documented ones below and a handler can be called
anything (`start`, `cancel`, `shutdown`...) without shadowing the runtime.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from aiollm.actors.messages import Message, Terminated

if TYPE_CHECKING:
    from aiollm.actors.cell import ActorCell
    from aiollm.actors.node import Node
    from aiollm.actors.ref import ActorRef


def handler(msg_type: type[Message]) -> Callable[[Callable], Callable]:
    """Mark an `async def` (ask/tell) or `async def ... yield` (stream) method as the handler of `msg_type`."""
    if not (isinstance(msg_type, type) and issubclass(msg_type, Message)):
        raise TypeError(f"@handler needs a Message subclass, got {msg_type!r}")

    def mark(fn: Callable) -> Callable:
        if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
            raise TypeError(f"handler {fn.__qualname__} must be `async def` (or an async generator for streams)")
        fn.__aiollm_handles__ = msg_type
        return fn

    return mark


class Actor:
    """Base class of every actor: subclass it, add `@handler(MsgType)` methods, spawn it on a `Node`.

    After `node.spawn` the instance has `node`, `name` and `ref`. `on_start` runs before the first
    message, `on_stop` after the last.
    """

    # message type -> (function, is_stream); built per class from its @handler methods.
    handlers: ClassVar[dict[type[Message], tuple[Callable, bool]]] = {}

    # The node hosting this actor, its name there and its ref (set by Node.spawn).
    node: Node
    name: str
    ref: ActorRef
    # The runtime state (mailbox, loop); not for subclasses.
    _cell: ActorCell

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[type[Message], tuple[Callable, bool]] = {}
        for klass in reversed(cls.__mro__):
            own: set[type[Message]] = set()
            for attr in vars(klass).values():
                msg_type = getattr(attr, "__aiollm_handles__", None)
                if msg_type is None:
                    continue
                if msg_type in own:
                    raise TypeError(f"{klass.__qualname__} has two handlers for {msg_type.__name__}")
                own.add(msg_type)
                table[msg_type] = (attr, inspect.isasyncgenfunction(attr))
        cls.handlers = table

    async def on_start(self) -> None:
        """Called once before the first message is processed."""

    async def on_stop(self) -> None:
        """Called once after the last message (or after the drain timeout)."""

    async def watch(self, ref: ActorRef) -> None:
        """Receive `Terminated` when `ref`'s actor stops, its process dies or its node becomes unreachable."""
        if Terminated not in self.handlers:
            raise TypeError(f"{type(self).__qualname__} watches {ref.url} but has no @handler(Terminated)")
        await self.node.watch(self._cell, ref)

    async def unwatch(self, ref: ActorRef) -> None:
        """Stop watching `ref`."""
        await self.node.unwatch(self._cell, ref)

    def stop(self) -> None:
        """Ask the node to stop this actor after its current message (usable from inside a handler)."""
        asyncio.get_running_loop().create_task(self.node.stop_actor(self.name))
