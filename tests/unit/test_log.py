import io
import sys

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
