"""SamplingParams validation and the sampler: greedy, temperature, top-k, top-p, seeds."""

import pytest
import torch

from aiollm.model.sampling import SamplingParams, filter_logits, new_generator, sample


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
    generator = new_generator(params)
    drawn = {sample(logits[None], [params], [generator])[0] for _ in range(200)}
    assert drawn == {0, 1}


def test_seed_reproduces_and_temperature_spreads():
    logits = torch.zeros(1, 50)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = [sample(logits, [params], [g])[0] for g in [new_generator(params)] for _ in range(20)]
    again = [sample(logits, [params], [g])[0] for g in [new_generator(params)] for _ in range(20)]
    assert first == again
    assert len(set(first)) > 5  # uniform over 50 tokens: 20 draws are far from all equal


def test_low_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = SamplingParams(temperature=0.05, seed=3)
    generator = new_generator(cold)
    assert {sample(logits, [cold], [generator])[0] for _ in range(50)} == {0}
