"""bench peers' headline ratios: like with like, the default serve's row under the unsuffixed keys."""

from bench.peers import ratios


def _row(tokens, ttft, tpot, goodput, compute=None):
    return {
        "cores_busy_saturation": 1.5,
        "out_tok_s_saturation": tokens,
        "ttft_p50_ms_rate1": ttft,
        "tpot_p50_ms_rate4": tpot,
        "goodput_rps": goodput,
        "prefill_compute_p50_ms_rate1": compute,
    }


ROWS = {
    "disagg_fp32": _row(300, 200, 30, 4.0, 180),
    "turns_fp32": _row(340, 120, 40, 3.0, 100),
    "colocated_fp32": _row(380, 110, 30, 4.0),
    "vllm_fp32": _row(400, 100, 50, 2.0),
    "llamacpp_fp32": _row(100, 200, 80, 1.0),
}


def test_the_default_serve_row_names_the_unsuffixed_ratios():
    turns = ratios(ROWS, "turns")
    assert turns["default_serve"] == "turns"
    assert turns["ratio_ttft_p50_vs_vllm_rate1"] == 1.2 and turns["ratio_ttft_p50_vs_vllm_rate1_split"] == 2.0
    assert turns["ratio_tpot_p50_vs_vllm_rate4"] == 0.8 and turns["ratio_tpot_p50_vs_vllm_rate4_split"] == 0.6
    assert turns["ratio_goodput_disagg_vs_vllm"] == 1.5 and turns["ratio_goodput_split_vs_vllm"] == 2.0
    assert "by turns" in turns["why_ttft_rate1"] and "100 ms" in turns["why_ttft_rate1"]
    split = ratios(ROWS, "disagg")
    assert split["ratio_ttft_p50_vs_vllm_rate1"] == 2.0 and split["ratio_goodput_disagg_vs_vllm"] == 2.0
    assert "180 ms" in split["why_ttft_rate1"]


def test_best_mode_over_each_peer_in_the_same_dtype():
    out = ratios(ROWS, "turns")
    assert out["ratio_tokens_vs_vllm_saturation_fp32"] == 0.95  # colocated, the best
    assert out["ratio_tokens_vs_vllm_saturation_turns_fp32"] == 0.85
    assert out["ratio_tokens_vs_llamacpp_saturation"] == 3.8
    assert out["why_tokens_fp32"].startswith("colocated 380 tokens/s with 1.50 cores busy, vLLM 400")
    assert not any(k.endswith("_bf16") for k in out)  # no bf16 rows, no bf16 ratios
