"""An actor's bounded mailbox: one consumer (the actor loop), many producers that wait when it is full.

Why not `asyncio.Queue`: the mailbox also needs a small *system lane* that bypasses the bound
(stream steps and `Terminated` notices, at most one per stream or watch, so it cannot grow without
bound), and a close that wakes every waiter with `ActorDied`. The common path — room available,
loop waiting — is one deque append and one future wake-up.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from aiollm.errors import ActorDied


class MailboxClosed(Exception):
    """Raised by `get` once the mailbox is closed and empty: the actor loop ends."""


class Mailbox:
    """Bounded FIFO of user messages plus an unbounded-by-construction system lane served first."""

    def __init__(self, capacity: int, owner: str) -> None:
        if capacity <= 0:
            raise ValueError(f"mailbox capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.owner = owner
        self.closed = False
        self._items: deque[Any] = deque()
        self._system: deque[Any] = deque()
        self._getter: asyncio.Future | None = None
        self._putters: deque[asyncio.Future] = deque()

    def __len__(self) -> int:
        return len(self._items) + len(self._system)

    def put_nowait(self, item: Any) -> bool:
        """Append if there is room (True); False when full. `ActorDied` once closed."""
        if self.closed:
            raise ActorDied(f"actor {self.owner!r} is stopping or stopped")
        if len(self._items) >= self.capacity:
            return False
        self._items.append(item)
        self._wake_getter()
        return True

    async def put(self, item: Any) -> None:
        """Append, waiting while the mailbox is full. `ActorDied` if it is or becomes closed."""
        while not self.put_nowait(item):
            fut = asyncio.get_running_loop().create_future()
            self._putters.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._wake_putter()  # pass the slot we were given to the next waiter
                raise
            finally:
                if not fut.done():
                    self._putters.remove(fut)

    def put_system(self, item: Any) -> None:
        """Append to the system lane: served before user messages, never waits, accepted while draining."""
        self._system.append(item)
        self._wake_getter()

    async def get(self) -> Any:
        """The next item, system lane first; `MailboxClosed` once closed and empty."""
        while not self._system and not self._items:
            if self.closed:
                raise MailboxClosed(self.owner)
            self._getter = asyncio.get_running_loop().create_future()
            try:
                await self._getter
            finally:
                self._getter = None
        if self._system:
            return self._system.popleft()
        item = self._items.popleft()
        if self._putters:
            self._wake_putter()
        return item

    def parked(self) -> bool:
        """True while the consumer waits in `get` on an empty mailbox (nothing queued since)."""
        getter = self._getter
        return getter is not None and not getter.done()

    def take_system(self) -> Any:
        """Remove and return the first item of the system lane (the caller knows it is there)."""
        return self._system.popleft()

    def close(self) -> None:
        """Refuse new user messages; waiting senders get `ActorDied`; `get` drains what is queued."""
        self.closed = True
        self._wake_getter()
        while self._putters:
            fut = self._putters.popleft()
            if not fut.done():
                fut.set_result(None)

    def drain(self) -> list[Any]:
        """Remove and return everything still queued (after the loop ended)."""
        items = list(self._system) + list(self._items)
        self._system.clear()
        self._items.clear()
        return items

    def _wake_getter(self) -> None:
        getter = self._getter
        if getter is not None and not getter.done():
            getter.set_result(None)

    def _wake_putter(self) -> None:
        while self._putters:
            fut = self._putters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
