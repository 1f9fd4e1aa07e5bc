"""`bench fastdecode`'s baselines: transformers `generate` at its best batch, dtype and thread count, and the
colocated `generate()` engine (S-part and attention in one process), decoding from prompts of S/2 tokens."""

from __future__ import annotations

import copy
import os
import statistics
import time

import numpy as np
import torch

from aiollm.model.linear import fastest_cpu_dtype
from aiollm.model.loader import bundled_path
from aiollm.model.sampling import SamplingParams
from aiollm.model.sequence import new_sequence
from aiollm.report import table
from aiollm.serving import runner
from bench.fastdecode_steps import MODEL, random_prompts


def baselines_part(model, seq_len: int, cores: int, quick: bool, no_transformers: bool, figures: dict) -> None:
    """transformers `generate` at its best batch, dtype and thread count, and the colocated `generate()`."""
    threads = sorted({1, cores})
    colocated_rows = _colocated(model, 16 if quick else 32, seq_len, threads)
    colocated = max(colocated_rows, key=lambda r: r["tokens_per_s"])
    print(
        f"\n-- colocated decode (aiollm.serving.runner, {fastest_cpu_dtype()}, fp16 KV), prompts of S/2 tokens, both thread "
        f"counts after one prefill\n{table(colocated_rows)}"
    )
    figures.update(colocated=colocated_rows, colocated_best_tokens_per_s=colocated["tokens_per_s"])
    if no_transformers:
        return
    # both dtypes at both batches: which is faster depends on the host (with AMX bf16 is 1.4x faster at B=64; on an
    # AVX-512 host without AMX fp32 leads bf16 at B=16 by 1.2x)
    configs = [(fastest_cpu_dtype(), 16)] if quick else [("bf16", 16), ("bf16", 64), ("fp32", 16), ("fp32", 64)]
    hf_rows = _transformers(seq_len, configs, threads)
    torch.set_num_threads(1)
    print(
        f"\n-- transformers generate, prompts of S/2 tokens (each generate times its first half of decode "
        f"steps at one thread count and the second half at the other)\n{table(hf_rows)}"
    )
    hf_best = max(hf_rows, key=lambda r: r["tokens_per_s"])
    figures.update(transformers=hf_rows, transformers_best_tokens_per_s=hf_best["tokens_per_s"])


def _colocated(model, batch: int, seq_len: int, threads: list[int], steps: int = 8) -> list[dict]:
    """Decode steps of the colocated path (aiollm.serving.runner: prefill into a paged fp16 KV cache, then
    `decode_step`, S-part and attention in this process), timed one by one after a single prefill: `steps` at
    each thread count in turn (torch and attention threads alike), the median of each phase.

    (Subtracting a 1-token generate from an (n+1)-token one instead put the prefill's run-to-run noise, about
    a second at B=32 x 512 tokens, into every step.)"""
    prompts = random_prompts(model, batch, seq_len // 2)
    params = SamplingParams(max_tokens=2 + steps * len(threads), ignore_eos=True)
    seqs = [new_sequence(f"colocated-{i}", p, params, model) for i, p in enumerate(prompts)]
    cache = runner.PagedCache(model, batch * -(-seqs[0].max_length // 16), 16, "fp16")
    for seq in seqs:
        cache.reserve(seq)
    torch.set_num_threads(max(threads))
    runner.prefill_into(model, cache, seqs)
    rows = []
    for n in threads:
        torch.set_num_threads(n)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            runner.decode_step(model, cache, seqs, n)
            times.append(time.perf_counter() - started)
        step = statistics.median(times)
        rows.append(
            {
                "threads": n,
                "batch": batch,
                "prompt_len": seq_len // 2,
                "step_ms": 1e3 * step,
                "tokens_per_s": batch / step,
            }
        )
    torch.set_num_threads(1)
    return rows


def _transformers(seq_len: int, configs: list[tuple[str, int]], threads: list[int], steps: int = 8) -> list[dict]:
    """transformers `generate` (greedy, KV cache, SDPA), each decode step timed by a logits processor.

    One generate per (dtype, batch): the prompt is prefilled once (with the most threads), then `steps` decode
    steps run at each thread count in turn (the processor switches between steps); a row's step is the median
    of its phase (the context grows by `steps` tokens over ~S/2, so the phases see the same work)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            phase, at = divmod(len(self.stamps) - 1, steps)
            if at == 0 and phase < len(threads):
                torch.set_num_threads(threads[phase])
            return scores

    path = bundled_path(MODEL)
    base = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    rows = []
    n = 1 + steps * len(threads)
    bf16 = copy.deepcopy(base).to(torch.bfloat16)
    for dtype, batch in configs:
        torch.set_num_threads(max(threads))
        hf = base if dtype == "fp32" else bf16
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(100, base.config.vocab_size, (batch, seq_len // 2), generator=gen)
        clock = Clock()
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([clock]),
            )
        gaps = np.diff(clock.stamps)  # decode steps only: stamps[0] is the prefill's logits
        for phase, count in enumerate(threads):
            step = float(np.median(gaps[phase * steps : (phase + 1) * steps]))
            rows.append(
                {
                    "dtype": dtype,
                    "threads": count,
                    "batch": batch,
                    "prompt_len": seq_len // 2,
                    "step_ms": 1e3 * step,
                    "tokens_per_s": batch / step,
                }
            )
    return rows
