"""response_format by constrained decoding (aiollm.model.structured) on the bundled SmolLM2's tokenizer and model:
the bitmask allows exactly the tokens the grammar accepts, a stop id only once the JSON is complete; greedy
generation gives JSON that parses and follows its schema; a matcher rebuilt from the generated tokens (a decode
instance, a resume) continues as the original; a schema xgrammar refuses is a ValueError naming response_format."""

import json

import pytest
import torch

from aiollm.model.engine import generate
from aiollm.model.loader import load, load_tokenizer
from aiollm.model.sampling import Draws, SamplingParams
from aiollm.model.sequence import FINISH_LENGTH, FINISH_STOP, Sequence, constrain, new_sequence, sample_next
from aiollm.model.structured import GRAMMARS, JsonConstraint, apply_masks, check, grammar_key

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
ASK = "Give me a JSON object describing a person named Alice who is 30 and lives in Paris."


@pytest.fixture(scope="module")
def tokenizer():
    tok, config = load_tokenizer("smollm2")
    return tok, config.vocab


@pytest.fixture(scope="module")
def smollm2():
    return load("smollm2")


def _constraint(tokenizer, params: SamplingParams, generated=()) -> JsonConstraint:
    tok, vocab = tokenizer
    return JsonConstraint(GRAMMARS.compile(tok, vocab, grammar_key(params)), frozenset(tok.stop_ids), generated)


def _allowed(constraint: JsonConstraint, vocab: int) -> torch.Tensor:
    return torch.isfinite(apply_masks(torch.zeros(1, vocab), [0], [constraint])[0])


def test_the_bitmask_allows_what_the_grammar_accepts_and_a_stop_only_at_the_end(tokenizer):
    tok, vocab = tokenizer
    params = SamplingParams(json_schema=json.dumps(PERSON))
    start = _allowed(_constraint(tokenizer, params), vocab)
    eos = tok.stop_ids[0]
    assert not start[eos] and start[tok.encode("{", add_special_tokens=False)[0]]
    assert not start[tok.encode("[", add_special_tokens=False)[0]]
    inside = _constraint(tokenizer, params, tok.encode('{"name": "Al', add_special_tokens=False))
    allowed = _allowed(inside, vocab)
    assert not allowed[eos] and allowed.sum() > 1000  # most text may go in a string, never a stop id
    for token in torch.nonzero(allowed)[:200, 0].tolist():  # an allowed token is accepted...
        probe = _constraint(tokenizer, params, tok.encode('{"name": "Al', add_special_tokens=False))
        assert probe.accept(token)
    for token in torch.nonzero(~allowed)[:200, 0].tolist():  # ...a refused one is not
        assert not inside.accept(token)
    whole = tok.encode('{"name": "Al", "age": 3, "city": "X"}', add_special_tokens=False)
    done = _constraint(tokenizer, params, whole)
    assert torch.nonzero(_allowed(done, vocab))[:, 0].tolist() == sorted(tok.stop_ids)
    assert done.accept(eos) and done.done


def test_masked_rows_never_draw_a_refused_token(tokenizer):
    """Greedy and sampled rows over random logits, many steps: every token drawn is one the grammar accepts."""
    tok, vocab = tokenizer
    torch.manual_seed(0)
    for temperature in (0.0, 1.5):
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=3, json_object=True)
        seq = Sequence("r", [1], params, frozenset(tok.stop_ids), Draws(3) if not params.greedy else None, 4096)
        seq.grammar = GRAMMARS.compile(tok, vocab, grammar_key(params))
        while seq.finish is None:
            logits = torch.randn(1, vocab) * 5
            logits[0, tok.stop_ids[0]] = 100.0  # the model wants to stop at once: the grammar does not let it
            before = _constraint(tokenizer, params, seq.output)
            (token,) = sample_next([seq], logits)
            assert before.accept(token)
        assert seq.finish in (FINISH_STOP, FINISH_LENGTH)
        if seq.finish == FINISH_STOP:
            assert json.loads(tok.decode(seq.output)) is not None


def test_a_schema_xgrammar_refuses_names_response_format(tokenizer):
    tok, vocab = tokenizer
    for bad in ('{"type": 5}', '{"type": "object", "properties": {"a": {"$ref": "#/nope"}}}'):
        with pytest.raises(ValueError, match="^response_format: invalid JSON schema: "):
            check(SamplingParams(json_schema=bad))
        with pytest.raises(ValueError, match="^response_format: "):
            GRAMMARS.compile(tok, vocab, ("json_schema", bad))
    check(SamplingParams(json_object=True))
    check(SamplingParams(json_schema=json.dumps(PERSON)))
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_object=True, json_schema="{}")


def test_min_tokens_does_not_hold_back_a_complete_json(tokenizer):
    tok, vocab = tokenizer
    params = SamplingParams(max_tokens=30, min_tokens=25, json_schema='{"type": "boolean"}')
    seq = Sequence("r", [1], params, frozenset(tok.stop_ids), None, 4096)
    seq.grammar = GRAMMARS.compile(tok, vocab, grammar_key(params))
    while seq.finish is None:
        sample_next([seq], torch.zeros(1, vocab))
    assert seq.finish == FINISH_STOP and tok.decode(seq.output) in ("true", "false")


def _chat(model) -> list[int]:
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": ASK}]), add_special_tokens=False)


@pytest.mark.slow
def test_greedy_json_schema_output_parses_and_follows_the_schema(smollm2):
    prompt = _chat(smollm2)
    free = generate(smollm2, [prompt], SamplingParams(max_tokens=12))[0]
    out = generate(smollm2, [prompt], SamplingParams(max_tokens=96, json_schema=json.dumps(PERSON)))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smollm2.tokenizer.stop_ids
    value = json.loads(out.text)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, PERSON)
    assert value["name"] == "Alice" and value["age"] == 30
    assert free.text != out.text  # unconstrained, the model does not answer in this JSON
    # a request with too few tokens is cut by max_tokens, as vLLM's
    cut = generate(smollm2, [prompt], SamplingParams(max_tokens=5, json_schema=json.dumps(PERSON)))[0]
    assert cut.finish_reason == "length" and out.text.startswith(cut.text)


@pytest.mark.slow
def test_greedy_json_object_output_parses(smollm2):
    tok = smollm2.tokenizer
    ask = [{"role": "user", "content": "Reply with a JSON object with one key, ok, set to true."}]
    prompt = tok.encode(tok.apply_chat_template(ask), add_special_tokens=False)
    out = generate(smollm2, [prompt], SamplingParams(max_tokens=96, json_object=True))[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict | list)


@pytest.mark.slow
def test_a_matcher_rebuilt_from_the_generated_tokens_continues_the_same(smollm2):
    """A request resumed after k tokens (its prompt ends with them, first_index k) generates what the whole run
    generated after them; a decode instance's sequence (the prefill's token carried in its output) rebuilds the
    matcher the prefill instance had."""
    prompt, schema = _chat(smollm2), json.dumps(PERSON)
    whole = generate(smollm2, [prompt], SamplingParams(max_tokens=96, json_schema=schema))[0].token_ids
    k = 9
    resumed = generate(
        smollm2, [prompt + whole[:k]], SamplingParams(max_tokens=96 - k, json_schema=schema, first_index=k)
    )[0].token_ids
    assert resumed == whole[k:]
    params = SamplingParams(max_tokens=96 - k + 1, json_schema=schema, first_index=k)
    decoding = new_sequence("d", prompt + whole[: k - 1], params, smollm2)
    decoding.output.append(whole[k - 1])
    constrain(decoding)
    vocab = smollm2.config.vocab
    straight = JsonConstraint(decoding.grammar, decoding.stop_ids, whole[:k])
    assert torch.equal(_allowed(decoding.constraint, vocab), _allowed(straight, vocab))
    nope = smollm2.tokenizer.encode("nope", add_special_tokens=False)
    bad = new_sequence("b", prompt + nope, SamplingParams(json_schema=schema, first_index=len(nope)), smollm2)
    with pytest.raises(ValueError, match="does not follow the grammar"):
        constrain(bad)
