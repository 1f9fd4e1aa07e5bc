"""The UCX worker of an event loop and the progress engine that drives it (used by `ucx`).

Why a separate engine: ucxx's own asyncio progress modes either spin (every pending request re-polls
with `sleep(0)` unless its notifier thread runs) or add a thread hop per completion (~2 ms round trips
in "thread" mode). This engine progresses the worker from the event loop itself: when the worker's
event fd fires or an operation is posted, then it re-arms the worker and sleeps in epoll.
Imports the binding; without it, fails with the install command.
"""

from __future__ import annotations

import asyncio
import os

try:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # UCX otherwise prints a warning on stdout
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array
except ImportError as exc:
    raise ImportError(
        "ucx:// addresses need the UCX binding, which is not installed: pip install 'aiollm[ucx]'"
    ) from exc

from aiollm.transports.base import TransportConfig
from aiollm.transports.framing import options_for

# Options this transport reads from TransportConfig.options, with their defaults.
DEFAULT_OPTIONS: dict[str, int | str] = {
    # "event": progress on the worker's event fd, sleep when idle; "polling": progress every loop turn.
    "ucx.progress": "event",
    # In "event" mode, microseconds to keep polling (yielding the core) after activity before sleeping.
    # With it a round trip takes 112 us against 152 without; on a shared core 261 against 233 (a spin that does
    # not yield would make that 2 ms; always polling makes it 8 ms).
    "ucx.spin_us": 50,
    # UCX transports when UCX_TLS is not set; tcp, shared memory (sysv/posix/cma) and self (same process).
    "ucx.tls": "tcp,sm,self",
    # Frames a sender may have in flight before the receiver grants more credits.
    "ucx.window_frames": 64,
    # Frames whose buffers total at most this many bytes travel as one message (buffers copied into it).
    "ucx.inline_bytes": 8192,
}
_PROGRESS_MODES = ("event", "polling")
# Seconds between safety-net progress calls while operations are pending (an event could be missed).
_SAFETY_PROGRESS = 0.05
# What `ucx` uses from here, the binding's objects included (so only this module imports ucxx).
__all__ = ["Array", "DEFAULT_OPTIONS", "Engine", "engine_for", "ucx_api"]


class Engine:
    """The UCX worker of one event loop and the loop that progresses it."""

    def __init__(self, loop: asyncio.AbstractEventLoop, progress: str, tls: str, spin_us: int) -> None:
        config = {} if "UCX_TLS" in os.environ else {"TLS": tls}
        self.context = ucx_api.UCXContext(config, (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.address = bytes(self.worker.address)
        self.loop = loop
        self.polling = progress == "polling"
        self.spin = spin_us / 1e6
        self.spin_until = 0.0
        self.pending: list[tuple[object, asyncio.Future, object]] = []
        self.connections: set = set()  # UcxConnection objects, polled for control messages
        self.scheduled = False
        self.safety: asyncio.TimerHandle | None = None
        self.fd = self.worker.epoll_file_descriptor
        self.users = 0  # open listeners, connections and handshakes; at zero the worker is released
        self.active = True  # the loop watches the worker's fd
        loop.add_reader(self.fd, self.kick)

    def acquire(self) -> None:
        if self.users == 0 and not self.active:
            self.active = True
            self.loop.add_reader(self.fd, self.kick)
            _ENGINES.setdefault(self.loop, self)
        self.users += 1

    def release(self) -> None:
        """Drop one user; after the last one the loop stops watching the worker, which can then be freed."""
        self.users -= 1
        if self.users == 0 and self.active:
            self.active = False
            if _ENGINES.get(self.loop) is self:
                del _ENGINES[self.loop]
            self.worker.progress()
            self.loop.remove_reader(self.fd)
            if self.safety is not None:
                self.safety.cancel()
                self.safety = None

    def submit(self, request, keep: object) -> asyncio.Future:
        """Track `request` (keeping `keep`, its buffer, alive) until it completes; returns its future."""
        fut = self.loop.create_future()
        self.pending.append((request, fut, keep))
        self.kick()
        return fut

    def kick(self) -> None:
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self.pump)

    def pump(self) -> None:
        """Progress the worker, finish completed requests, read control messages, then re-arm or re-poll.

        With `ucx.spin_us` > 0 the loop keeps polling that long after activity before arming, yielding
        the core between polls: a reply that follows within it skips a sleep/wake-up pair. The spin is
        bounded, so an idle worker always ends up asleep in epoll.
        """
        self.scheduled = False
        self.worker.progress()
        active = False
        if self.pending:
            still = []
            for entry in self.pending:
                request, fut = entry[0], entry[1]
                if not request.completed:
                    still.append(entry)
                elif not fut.done():
                    active = True
                    try:
                        request.check_error()
                        fut.set_result(None)
                    except Exception as exc:
                        fut.set_exception(exc)
            self.pending = still
        for conn in list(self.connections):
            active = conn.poll_control() or active
        if self.polling and (self.pending or self.connections):
            self.kick()
            return
        now = self.loop.time()
        if active:
            self.spin_until = now + self.spin
        if now < self.spin_until:
            os.sched_yield()  # let a peer that shares this core run (and answer) before we poll again
            self.kick()
        elif not self.worker.arm():  # arm() is False when events are pending
            self.kick()
        if self.pending and self.safety is None:
            self.safety = self.loop.call_later(_SAFETY_PROGRESS, self._safety_net)

    def _safety_net(self) -> None:
        self.safety = None
        self.kick()


# event loop -> its engine, while the loop has UCX listeners or connections.
_ENGINES: dict[asyncio.AbstractEventLoop, Engine] = {}


def engine_for(config: TransportConfig) -> Engine:
    """The engine of the running loop, created with `config`'s ucx options on first use."""
    opts = options_for(config, "ucx", DEFAULT_OPTIONS)
    if opts["ucx.progress"] not in _PROGRESS_MODES:
        raise ValueError(
            f"TransportConfig.options['ucx.progress']: expected one of {_PROGRESS_MODES}, got {opts['ucx.progress']!r}"
        )
    if int(opts["ucx.window_frames"]) < 2:
        raise ValueError("TransportConfig.options['ucx.window_frames'] must be >= 2")
    loop = asyncio.get_running_loop()
    engine = _ENGINES.get(loop)
    if engine is None:
        engine = _ENGINES[loop] = Engine(
            loop, str(opts["ucx.progress"]), str(opts["ucx.tls"]), int(opts["ucx.spin_us"])
        )
    return engine
