"""Shared pytest set-up: structured logs at WARNING so failures show only what matters, and the
`inline_steps` fixture that runs an actor-runtime test on both of the runtime's paths."""

import sys

import pytest

from aiollm import log
from aiollm.actors import inline

log.configure("WARNING")


@pytest.fixture(params=[True, False], ids=["inline", "plain"])
def inline_steps(request, monkeypatch) -> bool:
    """True: a request that finds its actor idle runs from the transport's callback (`aiollm.actors.inline`);
    False: the plain path, where the actor's own task runs every handler (unverified Pythons,
    AIOLLM_INLINE_STEPS=0). Use it with `pytestmark = pytest.mark.usefixtures("inline_steps")`."""
    if request.param and not inline.VERIFIED:
        pytest.skip(f"the inline path is not verified on Python {sys.version_info[0]}.{sys.version_info[1]}")
    monkeypatch.setattr(inline, "enabled", request.param)
    return request.param
