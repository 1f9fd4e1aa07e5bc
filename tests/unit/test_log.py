import io
import json
import sys

import structlog

from aiollm import log


def test_logs_follow_the_current_stderr_even_after_the_configured_one_closed(monkeypatch):
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    log.configure("INFO")
    logger = log.get_logger("test")
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logger.info("still here", n=1)
    assert "still here" in second.getvalue() and "component=test" in second.getvalue()
    log.configure("WARNING")


def test_a_logger_made_before_configure_follows_it(monkeypatch):
    structlog.reset_defaults()  # as at import time, before the process configured logging
    logger = log.get_logger("early")  # what a module-level `_log = get_logger(...)` does
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    try:
        log.configure("WARNING", json=True)
        logger.info("filtered out")
        logger.warning("kept", n=1)
        log.configure("DEBUG")  # and again: the same logger follows the newer configuration
        logger.debug("now plain text", n=2)
    finally:
        log.configure("WARNING")
    first, second = out.getvalue().splitlines()
    assert "filtered out" not in out.getvalue()
    assert json.loads(first) | {"timestamp": None} == {
        "event": "kept",
        "n": 1,
        "component": "early",
        "level": "warning",
        "timestamp": None,
    }
    assert "now plain text" in second and "component=early" in second and "[debug" in second
