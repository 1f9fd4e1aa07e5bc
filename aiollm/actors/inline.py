"""Running a handler straight from the transport's receive callback, as if the actor's own task ran it.

Why: on small VMs a task wake-up in a process that was asleep costs far more than in a tight loop
(cold caches, one more event-loop turn with its epoll call), and without this a remote ask pays two
on the serving side. When an actor is idle (its loop task parked on an empty mailbox), `ActorCell`
runs the handler's first step right where the request frame was decoded, so a handler that does
not suspend (most asks) has replied before the callback returns.

To the handler nothing changes: the step runs in the actor task's context (contextvars) with that
task as `asyncio.current_task()` (so `asyncio.timeout`, task groups and cancellation work), and
if it suspends, the rest of it is handed to the actor's loop task as a `Resume`, which that task
awaits: the waiting, waking and cancelling from then on are plain asyncio.

This drives private asyncio names, so it runs only on the CPython versions it was checked on
(`VERIFIED`); elsewhere, or with AIOLLM_INLINE_STEPS=0 in the environment, `enabled` is False and
the actor's own task runs every handler (the plain path: one wake-up more per remote request).
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import sys
from collections.abc import Coroutine
from typing import Any

# CPython versions this module's use of asyncio's internals was checked on (the actor tests pass
# inline there). 3.14 keeps the running task on the thread state, no longer in `_current_tasks`.
VERIFIED_ON = ((3, 11), (3, 12), (3, 13))
VERIFIED = sys.implementation.name == "cpython" and sys.version_info[:2] in VERIFIED_ON
# Whether `ActorCell.run_now` runs handlers inline; read at each call, so tests can switch it.
enabled = VERIFIED and os.environ.get("AIOLLM_INLINE_STEPS", "1") != "0"

if VERIFIED:
    # asyncio's own bookkeeping of the running task (what Task.__step does around each step); the
    # only private names used, and only here.
    enter_task = asyncio.tasks._enter_task
    leave_task = asyncio.tasks._leave_task
    # event loop -> its running task; `in_task(loop)` is `asyncio.current_task(loop) is not None` minus a call.
    in_task = asyncio.tasks._current_tasks.__contains__
else:  # never called: `enabled` stays False
    enter_task = leave_task = in_task = None


def first_step(
    loop: asyncio.AbstractEventLoop, task: asyncio.Task, context: contextvars.Context, coro: Coroutine[Any, Any, Any]
) -> tuple[bool, Any]:
    """Run `coro` up to its first suspension as `task` in `context`: (finished, what it waits on).

    Call only from a callback (no task running) while `task` is suspended. Exceptions of `coro`
    propagate.
    """
    enter_task(loop, task)
    try:
        return False, context.run(coro.send, None)
    except StopIteration:
        return True, None
    finally:
        leave_task(loop, task)


class Resume:
    """The rest of a coroutine that `first_step` started; awaiting it continues the coroutine in the awaiting task.

    It passes each future the coroutine waits on up to the task and the outcome back down, as if the
    task had run the coroutine from the start. `error` (e.g. a cancellation that reached the task
    before it took the coroutine over) is thrown into the coroutine first.
    """

    __slots__ = ("coro", "waiting_on", "error")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self.coro = coro
        # What the first step yielded (a future, or None for a bare yield).
        self.waiting_on = waiting_on
        self.error: BaseException | None = None

    def __await__(self):
        coro = self.coro
        try:
            yielded = self.waiting_on if self.error is None else coro.throw(self.error)
            while True:
                try:
                    value = yield yielded
                except GeneratorExit:
                    coro.close()
                    raise
                except BaseException as exc:
                    yielded = coro.throw(exc)
                else:
                    yielded = coro.send(value)
        except StopIteration as stop:
            return stop.value
