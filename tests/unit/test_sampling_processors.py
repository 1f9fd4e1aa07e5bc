"""The logits processors and raw logprobs against small reference implementations on fixed logits: logit_bias,
min_tokens, presence/frequency/repetition penalties, min_p (greedy rows too), and logprobs against float64."""

import math

import pytest
import torch

from aiollm.model.logits_processors import RowHistory, apply_min_p, process
from aiollm.model.logprobs import token_logprobs
from aiollm.model.sampling import SamplingParams, choice_seed, new_draws, sample

VOCAB = 8
LOGITS = torch.tensor([1.0, 3.0, -2.0, 0.5, 2.9, -0.1, 0.0, 2.0])


def reference(logits, p: SamplingParams, prompt, output, stop_ids=()):
    """Plain-Python vLLM order: bias, min_tokens mask, repetition, frequency, presence."""
    row = [float(x) for x in logits]
    for token, bias in p.logit_bias:
        row[token] += bias
    if len(output) < p.min_tokens:
        for token in stop_ids:
            row[token] = -math.inf
    for token in set(prompt) | set(output):
        row[token] = row[token] / p.repetition_penalty if row[token] > 0 else row[token] * p.repetition_penalty
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


CASES = [
    SamplingParams(logit_bias=((2, 10.0), (1, -5.0))),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=0.3),
    SamplingParams(repetition_penalty=1.8),
    SamplingParams(repetition_penalty=0.5),
    SamplingParams(min_tokens=5),
    SamplingParams(min_tokens=5, repetition_penalty=1.3, presence_penalty=0.2, logit_bias=((6, 4.0),)),
]


@pytest.mark.parametrize("params", CASES)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_processed_rows_match_the_reference(params, temperature):
    prompt, output, stops = [1, 3, 3], [4, 4, 1, 7], frozenset({4, 1})
    p = SamplingParams(**{**params.__dict__, "temperature": temperature, "seed": 3})
    expected = reference(LOGITS, p, prompt, output, stops)
    got = process(LOGITS, p, RowHistory(prompt + output, len(output), stops))
    assert got.tolist() == pytest.approx(expected)
    assert LOGITS.tolist()[1] == 3.0  # never in place
    tokens = sample(
        LOGITS[None].repeat(2, 1),
        [p, SamplingParams()],
        [new_draws(p), None],
        [RowHistory(prompt + output, len(output), stops), None],
    )
    assert tokens[1] == 1  # the unprocessed greedy row keeps the plain argmax
    if temperature == 0.0:
        assert tokens[0] == max(range(VOCAB), key=lambda t: expected[t])


def test_penalties_count_tokens_generated_before_a_resume():
    # the prompt's last two tokens were generated before the request resumed: they count as output
    p = SamplingParams(frequency_penalty=1.0)
    got = process(LOGITS, p, RowHistory([1, 3, 4, 4], 2))
    assert got.tolist() == pytest.approx(reference(LOGITS, p, [1, 3], [4, 4]))


def test_min_tokens_masks_the_stop_ids_only_until_reached():
    p = SamplingParams(min_tokens=2)
    masked = process(LOGITS, p, RowHistory([0, 5], 1, frozenset({1})))
    assert masked[1] == -math.inf and sample(LOGITS[None], [p], [None], [RowHistory([0, 5], 1, frozenset({1}))]) == [4]
    free = process(LOGITS, p, RowHistory([0, 5, 6], 2, frozenset({1})))
    assert free.tolist() == LOGITS.tolist()


def test_min_p_keeps_tokens_near_the_most_likely():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(apply_min_p(logits, 0.35)).tolist()
    assert kept == [True, True, False, False]  # 0.15 < 0.35 * 0.5
    p = SamplingParams(temperature=1.0, min_p=0.35, seed=1)
    draws = new_draws(p)
    assert {sample(logits[None], [p], [draws])[0] for _ in range(200)} == {0, 1}


def test_greedy_with_a_bias_takes_the_biased_argmax():
    p = SamplingParams(logit_bias=((0, 100.0),))
    assert sample(LOGITS[None], [p], [None]) == [0]
    assert sample(LOGITS[None], [SamplingParams()], [None]) == [1]


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # more than max_tokens (16)
        ("min_p", 1.5),
        ("logit_bias", ((1, 101.0),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logprobs", 21),
        ("logprobs", -1),
    ],
)
def test_new_params_reject_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_logprobs_are_the_float64_log_softmax_of_the_raw_logits():
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 4
    tokens = [7, 0, 49]
    entries = token_logprobs(logits, tokens, [0, 5, 20])
    exact = torch.log_softmax(logits.double(), dim=-1)
    for row, (token, entry, n) in enumerate(zip(tokens, entries, [0, 5, 20])):
        assert entry.logprob == pytest.approx(float(exact[row, token]), abs=1e-5)
        assert len(entry.top) == n
        order = torch.argsort(exact[row], descending=True)[:n].tolist()
        assert [t for t, _ in entry.top] == order
        assert [lp for _, lp in entry.top] == pytest.approx(exact[row, order].tolist(), abs=1e-5)


def test_choice_seeds_are_distinct_and_reproducible():
    seeds = [choice_seed(42, i) for i in range(8)]
    assert seeds[0] == 42 and len(set(seeds)) == 8 and seeds == [choice_seed(42, i) for i in range(8)]
    assert all(0 <= s < 2**63 for s in seeds)
