"""Structured logging set-up: one call configures structlog for a process.

Logs go to stderr as key=value lines (or JSON with `json=True`), so a node's output can be
read by a person and parsed by a machine.
"""

import logging
import sys
from typing import Any

import structlog


def configure(level: str = "INFO", json: bool = False) -> None:
    """Configure structlog and the stdlib root logger for this process."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"log level: unknown level {level!r}")
    logging.basicConfig(stream=sys.stderr, level=numeric, format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.WriteLoggerFactory(file=_CurrentStderr()),
        # False: loggers made before this call (module-level `get_logger`) use this configuration too
        cache_logger_on_first_use=False,
    )


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at write time, not at configure time.

    Why: a stream captured when logging was configured may be closed later (a test's captured
    stderr, a redirected stream); writing to it then raises inside an actor's loop.

    A log line that cannot be written (the reading end of stderr is gone: a launcher's pipe whose
    process died) is dropped: logging never fails the work it describes.
    """

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
            return 0

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except (BrokenPipeError, ValueError):
            pass


def get_logger(name: str) -> Any:
    """A logger bound with the component name, that follows `configure` whenever it was called.

    Safe at module level (`_log = get_logger("x")`, created at import, before the process configured
    logging): structlog's lazy proxy assembles the logger from the configuration in force at each
    call (`cache_logger_on_first_use=False`), with `component=name` as its initial context.
    """
    return structlog.get_logger(component=name)
