"""Prefill and decode instances of one host taking turns on its cores.

Where a host has too few cores to give each instance its own (2 cores, one prefill and one decode instance),
splitting them leaves a prompt waiting for one core's prefill while the decode's core idles between steps.
Instead every instance gets threads for all the cores and they take turns: a prefill batch runs alone on every
core, decode steps run between batches. Running both at once would be worse than either: each step's GEMMs
synchronise their threads, so one thread preempted by the other instance stalls all of its own.

Two `flock` files make the turns, with prefill first: a decode step enters through the gate and holds the cores
lock for the step; a prefill batch holds the gate while it waits for the cores, so it waits for at most the
step in progress and no new step starts meanwhile. Both are released at the end of the batch, when the decode
instance, already waiting at the gate, takes the next turn before the prefill instance has built its next
batch. flock locks belong to the open file, so a process that dies gives its turn back.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# the gate and the cores lock
_SUFFIXES = (".gate", ".cores")


class Turns:
    """The turns of the instances sharing `path` (the files `path`.gate and `path`.cores, created as needed).
    Its methods block: call them on the step thread (aiollm.serving.step_thread), never the event loop."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._gate, self._cores = (os.open(f"{path}{suffix}", os.O_RDWR | os.O_CREAT, 0o600) for suffix in _SUFFIXES)

    @contextmanager
    def prefill(self) -> Iterator[None]:
        """Every core, for one prefill batch: after the decode step in progress, before any later one."""
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._cores, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._cores, fcntl.LOCK_UN)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)

    @contextmanager
    def decode(self) -> Iterator[None]:
        """Every core, for one decode step, once no prefill batch runs or waits."""
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._cores, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._cores, fcntl.LOCK_UN)


def remove(path: str) -> None:
    """Delete the files of the turns at `path` (when every instance using them has stopped)."""
    for suffix in _SUFFIXES:
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def taking(turn: Callable[[], object] | None, fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` run inside `turn()` (a Turns method), or `fn` itself without turns."""
    if turn is None:
        return fn

    def in_turn(*args, **kwargs) -> T:
        with turn():
            return fn(*args, **kwargs)

    return in_turn
