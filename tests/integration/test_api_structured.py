"""response_format through the official openai client with the bundled SmolLM2: json_object and json_schema give
JSON that parses (and follows the schema) on the colocated engine and on DistServe prefill -> decode, the same
text on both for greedy requests; a schema xgrammar cannot follow is a 400 naming response_format. (Every path's
tokens equal the reference engine's, R-workers and the S-worker included: test_api_sampling.)"""

import json

import openai
import pytest

from aiollm.model.loader import load
from aiollm.serving.colocated import ColocatedEngine, EngineConfig
from aiollm.serving.distserve.decode import DecodeConfig
from aiollm.serving.distserve.prefill import PrefillConfig
from aiollm.testing.serving_cluster import cluster
from tests.integration.test_api_sampling import _frontend

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
REQUESTS = [
    (
        "Give me a JSON object describing a person named Alice who is 30 and lives in Paris.",
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
    ),
    ("Reply with a JSON object with one key, ok, set to true.", {"type": "json_object"}),
]


@pytest.fixture(scope="module")
def smollm2():
    return load("smollm2")


async def _answers(client: openai.AsyncOpenAI) -> list[str]:
    texts = []
    for ask, fmt in REQUESTS:
        out = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": ask}],
            max_tokens=64,
            temperature=0,
            response_format=fmt,
        )
        assert out.choices[0].finish_reason == "stop"
        value = json.loads(out.choices[0].message.content)
        if fmt["type"] == "json_schema":
            assert set(value) == set(PERSON["required"]) and isinstance(value["age"], int)
            jsonschema = pytest.importorskip("jsonschema")
            jsonschema.validate(value, PERSON)
        texts.append(out.choices[0].message.content)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}}
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, response_format=bad
        )
    assert info.value.body["param"] == "response_format" and "invalid JSON schema" in info.value.body["message"]
    return texts


@pytest.mark.slow
async def test_json_on_the_colocated_engine_and_prefill_then_decode(smollm2):
    engine = ColocatedEngine(smollm2, EngineConfig(kv_blocks=64))
    await engine.start()
    try:
        async with _frontend(engine, smollm2) as client:
            colocated = await _answers(client)
    finally:
        await engine.stop()
    async with cluster(smollm2, prefill=PrefillConfig(kv_blocks=32), decode=DecodeConfig(kv_blocks=32)) as c:
        disaggregated = await _answers(c.client)
    assert disaggregated == colocated
