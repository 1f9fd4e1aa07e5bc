"""Against the servers users would pick instead: aiollm (disaggregated, offloaded, colocated) beside vLLM's CPU
build and llama.cpp's server, each alone on the same cores, driven by one neutral client, in one run.

    make peers                       # once: vLLM CPU in .peers/vllm (LLAMA=1: llama.cpp's server as well)
    python -m bench peers --dtypes bf16,fp32 --json bench/results/peers.json

Every server is started alone, warmed with two requests, then measured with the same requests: random
prompts of `--input-len` tokens, `--output-len` output tokens with `ignore_eos`, temperature 0. The client is
`vllm bench serve` from the peers venv where it is installed (a client none of the servers wrote), else
aiollm's own (`aiollm.loadgen.replay`) with the same prompts' lengths and the same Poisson arrivals.

- saturation: all requests at once; output tokens/s;
- a rate sweep (`--rates`, stopped after the first rate >= 4 req/s where < 90 % of requests meet both SLOs, and
  raised x1.5 past the last one while they are met): TTFT p50 at
  1 req/s, TPOT p50 at 4 req/s, and goodput, DistServe's measure: the highest rate (interpolated) at which
  >= 90 % of requests meet both the TTFT and the TPOT SLO (`--slo-ttft-ms`, `--slo-tpot-ms`).

The ratios compare like with like (the same weight dtype): `ratio_tokens_vs_vllm_saturation_<dtype>` is
aiollm's best mode over vLLM, with each mode's own ratio beside it; `ratio_ttft_p50_vs_vllm_rate1` and
`ratio_tpot_p50_vs_vllm_rate4` are the default `serve` (`default_serve`: one prefill and one decode instance,
taking turns on every core where a split would leave each fewer than 2, else splitting them) over vLLM fp32,
with `_split` and `_turns` beside them for both ways; `ratio_goodput_disagg_vs_vllm` is the default serve's
disaggregated goodput over vLLM's in fp32 (`_bf16`, `_split`, `_turns` beside it);
`ratio_tokens_vs_llamacpp_saturation` is aiollm's best fp32 mode over llama.cpp (its GGUF as it comes, or
f32 where `.peers/model-f32.gguf` exists). Each run also records the cores the server's processes kept busy,
the measurement that says where a missed target's time went on a machine this small.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aiollm.deploy.local import answers
from aiollm.loadgen.cpu_meter import CoreMeter
from aiollm.loadgen.replay import BenchRequest, RequestResult, max_rate_at, run_rate
from aiollm.report import table
from bench.serve import rising

TARGET = 0.9
# the sweep goes on past --rates (x1.5 each) while a server meets both SLOs, up to this many rates in all
MAX_RATES = 12
READY_TIMEOUT_S = 600.0
SERVED = "smollm2"
# aiollm's serving modes
MODES = ("disagg", "turns", "offloaded", "colocated")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="aiollm's model (bundled name or path)")
    parser.add_argument("--peers", type=Path, default=Path(".peers"), help="where `make peers` installed them")
    parser.add_argument("--dtypes", default="bf16,fp32", help="weight dtypes to compare, comma list")
    parser.add_argument(
        "--servers",
        default="disagg,turns,offloaded,colocated,vllm,llamacpp",
        help="comma list; a peer that is not installed is skipped",
    )
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per rate (and at saturation: 2x)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rates", default="1,2,3,4,6,8,12", help="the sweep, req/s (must hold 1 and 4)")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18230)
    parser.add_argument("--plot", type=Path, default=Path("bench/results/peers.png"))


# --- the servers --------------------------------------------------------------------------------------------


@dataclass
class Server:
    """One server under test: how to start it and what it is."""

    name: str
    dtype: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    def start(self, port: int, log: Path) -> str:
        env = dict(os.environ, **self.env)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not answers(f"{base}/v1/models"):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; its log: {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer within {READY_TIMEOUT_S:g} s; its log: {log}")
            time.sleep(0.5)
        return base

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def servers(args, hf_dir: Path | None, gguf: Path | None, port: int) -> list[Server]:
    """Every server of `--servers` in every dtype of `--dtypes` that can run here."""
    wanted = [s for s in args.servers.split(",") if s]
    out = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        kv = "fp16" if dtype == "bf16" else "fp32"
        aiollm = [sys.executable, "-m", "aiollm", "serve", "--model", args.model, "--dtype", dtype, "--kv-dtype", kv]
        aiollm += ["--served-model-name", SERVED, "--port", str(port)]
        modes = {
            # the host's cores split between the instances
            "disagg": ["--prefill", "1", "--decode", "1", "--no-take-turns"],
            # the same instances taking turns on every core (aiollm.serving.turns)
            "turns": ["--prefill", "1", "--decode", "1", "--take-turns"],
            "offloaded": ["--prefill", "1", "--decode", "1", "--r-workers", "1", "--threads", "1"],
            "colocated": ["--colocated", "--threads", "2"],
        }
        for mode in [m for m in modes if m in wanted]:
            # disaggregated instances log their steps: where a TTFT's time went (prefill compute vs the rest)
            log = [] if mode == "colocated" else ["--step-log", str(Path(tempfile.mkdtemp(prefix="aiollm-steps-")))]
            out.append(Server(mode, dtype, aiollm + modes[mode] + log))
        vllm = args.peers / "vllm" / "bin" / "vllm"
        if "vllm" in wanted and vllm.exists() and hf_dir is not None:
            argv = [str(vllm), "serve", str(hf_dir), "--served-model-name", SERVED, "--port", str(port)]
            argv += ["--dtype", {"bf16": "bfloat16", "fp32": "float32"}[dtype], "--max-model-len", "2048"]
            env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}", "VLLM_CPU_KVCACHE_SPACE": "4"}
            out.append(Server("vllm", dtype, argv, env))
        server = args.peers / "llama.cpp" / "llama-server"
        if "llamacpp" in wanted and dtype == "fp32" and server.exists() and gguf is not None:
            argv = [str(server), "-m", str(gguf), "--port", str(port), "-t", str(os.cpu_count())]
            argv += ["-tb", str(os.cpu_count()), "-np", "16", "-c", "8192", "--no-webui", "-a", SERVED]
            out.append(Server("llamacpp", "fp32", argv))
    return out


def export_hf_dir(model: str, out: Path) -> Path:
    """The model as a Hugging Face directory (vLLM reads only that): transformers dequantises the GGUF and a
    plain LlamaForCausalLM saves it (a model loaded from GGUF refuses to save itself)."""
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from aiollm.model.loader import resolve

    path = resolve(model)
    if path.is_dir():
        return path
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF's: the saved weights are plain fp32
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


# --- the client ---------------------------------------------------------------------------------------------


def _requests(args, vocab: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(100, vocab - 100) for _ in range(args.input_len)], args.output_len)
        for _ in range(args.num_prompts * 2)
    ]


def drive(
    args, base_url: str, hf_dir: Path | None, rate: float, n: int, vocab: int, seed: int
) -> tuple[list[RequestResult], float]:
    """n requests at `rate` (inf: all at once), prompts drawn from `seed`; per-request results and the run's
    wall time. Every run of a server draws other prompts (its own seed), so no run finds its prompts in a prefix
    cache an earlier run filled; every server sees the same seeds in the same order."""
    client = args.peers / "vllm" / "bin" / "vllm"
    if client.exists() and hf_dir is not None:
        return _vllm_client(client, args, base_url, hf_dir, rate, n, seed)
    requests = _requests(args, vocab, seed)[:n]
    if rate == float("inf"):
        arrivals = np.zeros(n)
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
        arrivals = np.cumsum(gaps) - gaps[0]
    return asyncio.run(run_rate(base_url + "/v1", SERVED, requests, arrivals))


def _vllm_client(client: Path, args, base_url: str, hf_dir: Path, rate: float, n: int, seed: int) -> tuple[list, float]:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [str(client), "bench", "serve", "--backend", "openai", "--base-url", base_url]
        argv += ["--endpoint", "/v1/completions", "--model", SERVED, "--tokenizer", str(hf_dir)]
        argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
        argv += ["--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--num-prompts", str(n)]
        argv += [
            "--request-rate",
            "inf" if rate == float("inf") else str(rate),
            "--ignore-eos",
            "--seed",
            str(seed),
        ]
        argv += ["--temperature", "0", "--save-result", "--save-detailed", "--result-dir", tmp]
        argv += ["--result-filename", "run.json", "--disable-tqdm"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed: {done.stderr[-2000:]}")
        result = json.loads((Path(tmp) / "run.json").read_text())
    out = []
    for i in range(len(result["ttfts"])):
        error = result["errors"][i] if result.get("errors") else ""
        tokens = result["output_lens"][i]
        itls = result["itls"][i] or [0.0]
        ok = not error and tokens > 0
        out.append(RequestResult(ok, result["ttfts"][i], float(np.mean(itls)), 0.0, tokens, error))
    return out, float(result["duration"])


# --- one server, measured ------------------------------------------------------------------------------------


def measure(args, server: Server, hf_dir: Path | None, vocab: int, rates: list[float], log_dir: Path) -> dict:
    base = server.start(args.port, log_dir / f"{server.name}-{server.dtype}.log")
    try:
        drive(args, base, hf_dir, float("inf"), 2, vocab, args.seed + 1000)  # warm-up: one-time costs
        meter = CoreMeter([server.proc.pid])
        began = time.perf_counter()
        meter.start(began)
        results, duration = drive(args, base, hf_dir, float("inf"), args.num_prompts * 2, vocab, args.seed)
        ended = time.perf_counter()
        # the server's CPU seconds over the client's measured duration (the client's own start-up, in the
        # meter's interval, leaves the server idle)
        cores_busy = meter.stop(ended).ours * (ended - began) / duration
        ok = [r for r in results if r.ok]
        row = {
            "out_tok_s_saturation": sum(r.output_tokens for r in ok) / duration,
            "ttft_p50_ms_saturation": float(np.median([r.ttft for r in ok]) * 1e3) if ok else float("nan"),
            "failed": len(results) - len(ok),
            "cores_busy_saturation": round(cores_busy, 2),
            "rates": {},
        }
        _progress(server, f"saturation {row['out_tok_s_saturation']:.0f} tok/s, cores busy {cores_busy:.2f}")
        rates = list(rates)
        for rate in rising(rates):
            began = time.time()
            results, _ = drive(args, base, hf_dir, rate, args.num_prompts, vocab, args.seed + 1 + rates.index(rate))
            if rate == 1.0:
                row["prefill_compute_p50_ms_rate1"] = _prefill_compute_ms(server, began, time.time())
            ok = [r for r in results if r.ok]
            good = [r for r in ok if r.ttft * 1e3 <= args.slo_ttft_ms and r.tpot * 1e3 <= args.slo_tpot_ms]
            summary = {
                "ttft_p50_ms": float(np.median([r.ttft for r in ok]) * 1e3) if ok else float("nan"),
                "tpot_p50_ms": float(np.median([r.tpot for r in ok]) * 1e3) if ok else float("nan"),
                "attainment": len(good) / len(results),
                "failed": len(results) - len(ok),
            }
            row["rates"][str(rate)] = summary
            row["failed"] += summary["failed"]
            _progress(
                server,
                f"{rate:g} req/s: TTFT p50 {summary['ttft_p50_ms']:.0f} ms, TPOT p50 {summary['tpot_p50_ms']:.1f} ms, "
                f"both SLOs {summary['attainment']:.0%}",
            )
            if summary["attainment"] < TARGET and rate >= 4:
                break
            if rate == rates[-1] and len(rates) < MAX_RATES:  # still meets the SLOs: the goodput lies higher
                rates.append(round(rate * 1.5, 2))
        swept = [float(r) for r in row["rates"]]
        row["goodput_rps"] = max_rate_at(swept, [row["rates"][str(r)]["attainment"] for r in swept], TARGET)
        # False: every rate of the sweep met the SLOs, so the goodput is a lower bound
        row["goodput_measured"] = row["rates"][str(swept[-1])]["attainment"] < TARGET
        row["ttft_p50_ms_rate1"] = row["rates"].get("1.0", {}).get("ttft_p50_ms", float("nan"))
        row["tpot_p50_ms_rate4"] = row["rates"].get("4.0", {}).get("tpot_p50_ms", float("nan"))
        return row
    finally:
        server.stop()


def _prefill_compute_ms(server: Server, start: float, end: float) -> float | None:
    """Median wall time of the prefill batches the server's step log recorded in [start, end) (None: it keeps
    no step log)."""
    if "--step-log" not in server.argv:
        return None
    from aiollm.loadgen.step_logs import read_logs

    directory = Path(server.argv[server.argv.index("--step-log") + 1])
    times = [
        r["end"] - r["start"] for r in read_logs(directory) if r["kind"] == "prefill" and start <= r["start"] < end
    ]
    return float(np.median(times) * 1e3) if times else None


def _progress(server: Server, text: str) -> None:
    print(f"  {server.name:9} {server.dtype:4}  {text}", flush=True)


def default_mode() -> str:
    """The row that is the default `serve` (one prefill, one decode instance) on this host."""
    from aiollm.cli.serve import too_few_cores_to_split
    from aiollm.deploy.spec import ClusterSpec

    return "turns" if too_few_cores_to_split(ClusterSpec()) else "disagg"


def ratios(rows: dict[str, dict], default: str) -> dict:
    """The headline ratios (see the module's docstring); `default` is the row of the default `serve`; a side that
    did not run leaves its ratio out."""
    out: dict = {"default_serve": default}
    suffix = {"disagg": "_split", "turns": "_turns"}

    def get(name: str, dtype: str, key: str) -> float | None:
        row = rows.get(f"{name}_{dtype}")
        return None if row is None else row[key]

    for dtype in ("bf16", "fp32"):
        vllm = get("vllm", dtype, "out_tok_s_saturation")
        if not vllm:
            continue
        mine = {m: get(m, dtype, "out_tok_s_saturation") for m in MODES}
        for mode, tokens in mine.items():
            if tokens is not None:
                out[f"ratio_tokens_vs_vllm_saturation_{mode}_{dtype}"] = round(tokens / vllm, 3)
        if any(mine.values()):
            best = max((m for m in mine if mine[m]), key=lambda m: mine[m])
            out[f"ratio_tokens_vs_vllm_saturation_{dtype}"] = round(mine[best] / vllm, 3)
            if mine[best] < vllm:  # where the time went: the cores each server kept busy at saturation
                row, theirs = rows[f"{best}_{dtype}"], rows[f"vllm_{dtype}"]
                out[f"why_tokens_{dtype}"] = (
                    f"{best} {mine[best]:.0f} tokens/s with {row['cores_busy_saturation']:.2f} cores busy, vLLM "
                    f"{vllm:.0f} with {theirs['cores_busy_saturation']:.2f}"
                )
        theirs = get("vllm", dtype, "goodput_rps")
        for mode in ("disagg", "turns"):
            goodput = get(mode, dtype, "goodput_rps")
            if goodput is not None and theirs:
                dtype_tail = "" if dtype == "fp32" else f"_{dtype}"
                out[f"ratio_goodput{suffix[mode]}_vs_vllm{dtype_tail}"] = round(goodput / theirs, 3)
                if mode == default:  # the default serve's disaggregated instances
                    out[f"ratio_goodput_disagg_vs_vllm{dtype_tail}"] = round(goodput / theirs, 3)
    for key, rate_key in (
        ("ttft_p50_ms_rate1", "ratio_ttft_p50_vs_vllm_rate1"),
        ("tpot_p50_ms_rate4", "ratio_tpot_p50_vs_vllm_rate4"),
    ):
        theirs = get("vllm", "fp32", key)
        for mode in ("disagg", "turns"):
            mine = get(mode, "fp32", key)
            if mine is not None and theirs:
                out[rate_key + suffix[mode]] = round(mine / theirs, 3)
                if mode == default:
                    out[rate_key] = round(mine / theirs, 3)
    mine, theirs = rows.get(f"{default}_fp32"), rows.get("vllm_fp32")
    if mine and theirs and mine.get("prefill_compute_p50_ms_rate1") is not None:
        compute = mine["prefill_compute_p50_ms_rate1"]
        cores = "every core, by turns with the decode instance" if default == "turns" else "its own cores"
        out["why_ttft_rate1"] = (
            f"default serve ({default}) TTFT p50 {mine['ttft_p50_ms_rate1']:.0f} ms at 1 req/s (vLLM "
            f"{theirs['ttft_p50_ms_rate1']:.0f} ms): its prefill batch takes {compute:.0f} ms (p50, the wait for its "
            f"turn included) on {cores}; the other {mine['ttft_p50_ms_rate1'] - compute:.0f} ms are queueing and the "
            "hops (HTTP, controller, prefill instance and back)"
        )
    llama = get("llamacpp", "fp32", "out_tok_s_saturation")
    best = [get(m, "fp32", "out_tok_s_saturation") for m in MODES]
    if llama and any(best):
        out["ratio_tokens_vs_llamacpp_saturation"] = round(max(b for b in best if b) / llama, 3)
    return out


def _plot(path: Path, rows: dict[str, dict], slos: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(rows)
    bars.bar(names, [rows[n]["out_tok_s_saturation"] for n in names], color="tab:blue")
    bars.set_ylabel("output tokens/s at saturation")
    bars.tick_params(axis="x", rotation=45)
    for name in names:
        rates = [float(r) for r in rows[name]["rates"]]
        lines.plot(rates, [rows[name]["rates"][str(r)]["attainment"] * 100 for r in rates], marker="o", label=name)
    lines.axhline(TARGET * 100, color="grey", linestyle=":")
    lines.set_xlabel("request rate (req/s)")
    lines.set_ylabel(f"% of requests meeting both SLOs ({slos})")
    lines.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> dict:
    from aiollm.model.loader import load_tokenizer

    rates = sorted(float(r) for r in args.rates.split(","))
    if 1.0 not in rates or 4.0 not in rates:
        raise SystemExit("python -m bench peers: error: --rates must hold 1 and 4")
    tokenizer, _ = load_tokenizer(args.model)
    vocab = tokenizer.vocab_size
    work = Path(tempfile.mkdtemp(prefix="aiollm-peers-"))
    hf_dir = None
    if (args.peers / "vllm" / "bin" / "vllm").exists():
        hf_dir = export_hf_dir(args.model, args.peers / "model-hf")
    from aiollm.model.loader import resolve

    f32 = args.peers / "model-f32.gguf"
    gguf = f32 if f32.exists() else (resolve(args.model) if resolve(args.model).suffix == ".gguf" else None)
    todo = servers(args, hf_dir, gguf, args.port)
    client = "vllm bench serve" if hf_dir is not None else "aiollm.loadgen.replay"
    print(f"{len(todo)} servers, client: {client}, SLOs TTFT {args.slo_ttft_ms:g} ms / TPOT {args.slo_tpot_ms:g} ms")
    rows: dict[str, dict] = {}
    try:
        for server in todo:
            rows[f"{server.name}_{server.dtype}"] = measure(args, server, hf_dir, vocab, rates, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    columns = ["server", "tok/s saturation", "TTFT p50 @1 (ms)", "TPOT p50 @4 (ms)", "goodput (req/s)", "cores busy"]
    print(
        table(
            [
                dict(
                    zip(
                        columns,
                        [
                            name,
                            round(r["out_tok_s_saturation"]),
                            round(r["ttft_p50_ms_rate1"]),
                            round(r["tpot_p50_ms_rate4"], 1),
                            ("" if r["goodput_measured"] else ">= ") + f"{r['goodput_rps']:.2f}",
                            r["cores_busy_saturation"],
                        ],
                    )
                )
                for name, r in rows.items()
            ],
            columns,
        )
    )
    slos = f"TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms"
    if rows:
        _plot(args.plot, rows, slos)
    return {
        **ratios(rows, default_mode()),
        "servers": rows,
        "client": client,
        "slos": slos,
        "workload": f"random {args.input_len} in / {args.output_len} out tokens, ignore_eos, temperature 0, "
        f"{args.num_prompts} requests per rate, {args.num_prompts * 2} at saturation",
        "peers_installed": sorted({s.name for s in todo} - set(MODES)),
    }
