"""Shared pytest set-up: structured logs at WARNING so failures show only what matters."""

from aiollm import log

log.configure("WARNING")
