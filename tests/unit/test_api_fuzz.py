"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis, a bounded budget): whatever a client sends to
any endpoint, the frontend answers it without a 5xx and without crashing (the backend here is the frontend
tests' scripted one, so every 5xx would be the frontend's own)."""

import schemathesis
from hypothesis import HealthCheck, settings

from aiollm.frontend.app import Frontend, FrontendConfig
from aiollm.serving.backend import ModelInfo
from tests.unit.test_frontend import CharTokenizer, ScriptedBackend

APP = Frontend(
    ScriptedBackend(),
    CharTokenizer(),
    ModelInfo("tiny", max_context=64),
    FrontendConfig(port=0, max_in_flight=64, vocab_size=256, default_max_tokens=8),
).app
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


@SCHEMA.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx(case):
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
