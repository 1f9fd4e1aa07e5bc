"""SamplingParams validation and the sampler: greedy, temperature, top-k, top-p, seeds."""

import pytest
import torch

from aiollm.model.sampling import SamplingParams, filter_logits, new_draws, sample


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("stop", "abc"),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", (2**31,)),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 101.0),
        ("seed", -1),
        ("seed", 2**64),
        ("top_k", 2**64),
        ("max_tokens", 2**31),
        ("first_index", -1),
    ],
)
def test_params_reject_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_takes_argmax_per_row():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 4.9]])
    params = [SamplingParams()] * 2
    assert sample(logits, params, [None, None]) == [1, 0]


def test_top_k_and_top_p_keep_only_the_head():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(filter_logits(logits, top_k=2, top_p=1.0)).tolist() == [True, True, False, False]
    # nucleus 0.7: 0.5 alone is short of it, 0.5+0.3 reaches it
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.7)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_k=0, top_p=0.5)).tolist() == [True, False, False, False]
    params = SamplingParams(temperature=1.0, top_k=2, seed=0)
    generator = new_draws(params)
    drawn = {sample(logits[None], [params], [generator])[0] for _ in range(200)}
    assert drawn == {0, 1}


def test_seed_reproduces_and_temperature_spreads():
    logits = torch.zeros(1, 50)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = [sample(logits, [params], [g])[0] for g in [new_draws(params)] for _ in range(20)]
    again = [sample(logits, [params], [g])[0] for g in [new_draws(params)] for _ in range(20)]
    assert first == again
    assert len(set(first)) > 5  # uniform over 50 tokens: 20 draws are far from all equal


def test_low_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = SamplingParams(temperature=0.05, seed=3)
    generator = new_draws(cold)
    assert {sample(logits, [cold], [generator])[0] for _ in range(50)} == {0}


def test_a_tiny_temperature_samples_greedily_instead_of_overflowing():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 5.0, 1.0]])
    params = SamplingParams(temperature=1e-39, seed=1)
    assert params.greedy and new_draws(params) is None
    assert sample(logits, [params, params], [None, None]) == [0, 1]


def test_a_row_of_nan_logits_fails_only_itself():
    logits = torch.tensor([[float("nan")] * 4, [0.0, 0.0, 9.0, 0.0]])
    params = [SamplingParams(temperature=1.0, seed=5), SamplingParams(temperature=0.5, seed=5)]
    tokens = sample(logits, params, [new_draws(p) for p in params])
    assert tokens[1] == 2 and 0 <= tokens[0] < 4


def test_draws_are_keyed_by_token_index_so_a_resumed_request_draws_the_same():
    logits = torch.zeros(1, 1000)
    params = SamplingParams(temperature=1.0, seed=77)
    whole = new_draws(params)
    straight = [sample(logits, [params], [whole])[0] for _ in range(12)]
    resumed = SamplingParams(temperature=1.0, seed=77, first_index=5)
    again = new_draws(resumed)
    assert [sample(logits, [resumed], [again])[0] for _ in range(7)] == straight[5:]
    other = new_draws(SamplingParams(temperature=1.0, seed=78))
    assert [sample(logits, [params], [other])[0] for _ in range(12)] != straight
    # unseeded requests draw a seed of their own
    assert new_draws(SamplingParams(temperature=1.0)).seed != new_draws(SamplingParams(temperature=1.0)).seed
