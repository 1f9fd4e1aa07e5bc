"""The one thread a process runs its model steps on.

A step's GEMMs and torch ops run on the OpenMP team of the thread that calls them, and libgomp keeps one team
per calling thread. `asyncio.to_thread` hands each step to whichever thread of the default executor is idle, so a
process that steps through it grows a team per executor thread, and a team that just finished a step spins on the
cores the next step's team needs (a colocated fp32 server on 2 cores at saturation: 336-372 tokens/s in
back-to-back runs that way, 380-425 with one step thread). Every step of a process goes through `run_step`, on one
thread, so the process has one team, warm, and nothing spinning beside it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None


def _step_executor() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(1, thread_name_prefix="aiollm-step")
    return _executor


async def run_step(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on the process's step thread; the event loop serves messages meanwhile. Steps queue
    in call order (a process computes one step at a time anyway)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_step_executor(), functools.partial(fn, *args, **kwargs))
