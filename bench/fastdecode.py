"""FastDecode: S-worker + R-worker processes vs transformers and the colocated engine; schedule trace; sizing.

What it runs, in one process tree on this machine (SmolLM2-135M, bf16 weights where the CPU multiplies bf16
natively, else fp32 (`fastest_cpu_dtype`), fp16 KV):
- tokens/s of decode steps at context S (default 1024) for B = 16, 64, 256, 512 with one and two R-worker
  processes. The sequences start with placeholder contexts spread evenly over [16, S) (the steady state the
  load-stabilising schedule keeps), so a step's attention covers ~B*S/2 entries without first generating
  them; the S-worker runs in this process (one torch thread), the R-workers in their own. At B >= 256 also
  time-shared rows: no pipeline and the S-part on every core, so the S-part and the attention each have the
  whole machine in turn instead of three processes competing for it (on 2 vCPUs work slows by 30-50 % when
  all run at once).
- beside it transformers `generate` at its best batch and dtype and the colocated `generate()` engine,
  both decoding from prompts of S/2 tokens (the same mean context), prefill excluded from their rate, each
  at its best of 1 and all torch threads.
- the effect of thread counts and OpenMP wait policy when the processes share the cores.
- a per-step latency trace with and without the schedule (real requests, short prompts), plotted to PNG
  like FastDecode's Fig. 11, with max and median step latency and tokens/s after warm-up.
- the sizing model's predicted step time against the measured one for every row: aiollm.planner.fastdecode's
  predict_step from this run's T(B), R, the Attend round trip C(b) at each row's rows-per-ask and the
  effective cores (the largest of the S-worker's work, the busiest R-worker's, one mini-batch's chain, and
  all the work over the cores, plus the pipeline's overlap loss from a balanced probe per R-worker count),
  W being the KV entries a step attends over; each row's T(B) re-measured right before and after it (median of
  interleaved readings: the machine's speed drifts by up to 2x in phases of seconds), the first-measured
  curve's prediction kept beside it. The sizing's B, P and mode are the ones it predicts the most tokens/s for;
  that configuration is run as chosen, and also priced on every other input of its prediction (the ask cost, R in
  situ, the S-worker's CPU per streamed entry, the overlap loss) read again beside it on its own R-workers.
  The throughput part runs in a process started with OMP_WAIT_POLICY=passive (libgomp reads it once).
Each section prints its wall time; `--parts` runs a subset (e.g. `--parts trace` while tuning the schedule).

This module is the command line and the order of the parts; each part is a module of its own:
`bench.fastdecode_throughput`, `bench.fastdecode_baselines` and `bench.fastdecode_trace` (its two runs taking
turns in `bench.fastdecode_trace_runs`), all measuring with `bench.fastdecode_steps`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from aiollm.model import load
from aiollm.model.linear import fastest_cpu_dtype
from aiollm.native import attention as kv_attention
from bench.fastdecode_baselines import baselines_part
from bench.fastdecode_steps import MODEL
from bench.fastdecode_throughput import throughput_part
from bench.fastdecode_trace import trace_part

# libgomp (torch's OpenMP) reads OMP_WAIT_POLICY once, when torch loads: setting it later reaches the R-worker
# processes started afterwards but not this process's own S-part threads, which then spin ~20 ms after every
# parallel region (a 2-thread bf16 GEMM loop with 5 ms sleeps uses 0.55-0.65 s CPU that way, 0.30 s with
# passive set before torch loads), i.e. through every attention wait of a time-shared step, on the core the
# R-workers need. So the throughput part runs in a process started with it (`_throughput_in_child`).
OMP_PASSIVE_AT_START = os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive"

SECTIONS = ("throughput", "baselines", "trace")


def add_arguments(parser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="S=256, B=16,64, a shorter trace and one transformers batch (about 3 minutes)",
    )
    parser.add_argument("--seq-len", type=int, help="context S of the throughput runs (default 1024; quick 256)")
    parser.add_argument("--batches", help="comma-separated B (default 16,64,256,512; quick 16,64)")
    parser.add_argument("--trace-batch", type=int, help="B of the schedule trace (default 128; quick 64)")
    parser.add_argument(
        "--trace-seq-len",
        type=int,
        help="S of the schedule trace (default: where the gain peaks on pipelined steps measured at 8 "
        "contexts, fitted: fit_step_curve)",
    )
    parser.add_argument(
        "--trace-budget",
        type=float,
        help="seconds the trace runs may take by the step model; caps the balanced S (default 2000: "
        "enough for the balanced S of ~1850 at B=128 on a fast 2-core host, ~520-590 s a pair; where the "
        "S-part is ~2x slower the balance lies at ~2100-2400 and 1500 caps S at ~2048, ~950 s a pair, "
        "as the model's estimate is conservative; quick 120)",
    )
    parser.add_argument(
        "--trace-repeats",
        type=int,
        default=1,
        help="pairs of trace runs with and without the schedule (taking turns; which takes the first turn alternates)",
    )
    parser.add_argument(
        "--trace-micro-batch",
        type=int,
        default=8,
        help="M of the schedule trace; F = M*(S - prompt)/B steps between micro-batches",
    )
    parser.add_argument("--plot", type=Path, default=Path("fastdecode_sls_trace.png"), help="PNG of the trace")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the figures of the parts not run from the existing --json file (so the parts can "
        "run under separate holds of the bench lock); each part's seconds and run time stay",
    )
    parser.add_argument(
        "--parts",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (ratios need their parts)",
    )


def run(args) -> dict:
    quick = args.quick
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(SECTIONS))
    if unknown:
        raise ValueError(f"--parts: unknown {unknown}; sections are {', '.join(SECTIONS)}")
    seq_len = args.seq_len or (256 if quick else 1024)
    if args.trace_budget is None:
        args.trace_budget = 120.0 if quick else 2000.0
    batches = [int(b) for b in (args.batches or ("16,64" if quick else "16,64,256,512")).split(",")]
    cores = len(os.sched_getaffinity(0))
    # every process started from here inherits these: a waiting OpenMP thread sleeps instead of spinning
    os.environ["OMP_WAIT_POLICY"] = "passive"
    torch.set_num_threads(1)
    kv_attention.set_num_threads(1)
    print(
        f"context: {cores} cores shared by the S-worker (this process, 1 torch thread, or {cores} in the "
        f"time-shared rows) and the R-worker processes (1 attention thread each, OMP_WAIT_POLICY=passive); "
        f"baselines at their best of 1 and {cores} torch threads"
    )
    model = load(MODEL, dtype=fastest_cpu_dtype())
    figures: dict = {"cores": cores, "seq_len": seq_len, "quick": quick, "s_dtype": fastest_cpu_dtype()}
    if args.merge and args.json is not None and args.json.exists():
        # the parts run now overwrite their own keys; the ratios across parts are recomputed below
        figures = {**json.loads(args.json.read_text()), **figures}
        kept = [p for p in SECTIONS if p not in parts]
        print(
            f"merging into {args.json}: keeping its figures of "
            + ", ".join(f"{p} (finished {figures.get(f'finished_{p}', '?')})" for p in kept)
        )
    for part in parts:
        started = time.perf_counter()
        if part == "throughput" and not OMP_PASSIVE_AT_START:
            figures.update(_throughput_in_child(args))
        elif part == "throughput":
            throughput_part(model, batches, seq_len, cores, figures)
        elif part == "baselines":
            baselines_part(model, seq_len, cores, quick, args.no_transformers, figures)
        else:
            trace_part(model, args, quick, figures)
        figures[f"seconds_{part}"] = time.perf_counter() - started
        figures[f"finished_{part}"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        print(f"[{part}: {figures[f'seconds_{part}']:.0f} s]")
    if "transformers_best_tokens_per_s" in figures and "fastdecode_best_tokens_per_s" in figures:
        hf = figures["transformers_best_tokens_per_s"]
        figures.update(
            ratio_tokens_vs_transformers_best=figures["fastdecode_best_tokens_per_s"] / hf,
            ratio_tokens_vs_transformers_best_fp16_kv=figures["fastdecode_best_fp16_tokens_per_s"] / hf,
        )
    if "colocated_best_tokens_per_s" in figures and "fastdecode_best_tokens_per_s" in figures:
        figures["ratio_tokens_vs_colocated"] = (
            figures["fastdecode_best_tokens_per_s"] / figures["colocated_best_tokens_per_s"]
        )
    return figures


def _throughput_in_child(args) -> dict:
    """The throughput part's figures, measured by `python -m bench fastdecode --parts throughput` in a process
    started with OMP_WAIT_POLICY=passive (see OMP_PASSIVE_AT_START); the other parts stay in this one (the
    baselines at their own best policy)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "throughput.json"
        argv = [sys.executable, "-m", "bench", "fastdecode", "--parts", "throughput", "--json", str(out)]
        argv += ["--quick"] if args.quick else []
        argv += ["--seq-len", str(args.seq_len)] if args.seq_len else []
        argv += ["--batches", args.batches] if args.batches else []
        print("throughput part: in a process started with OMP_WAIT_POLICY=passive: " + " ".join(argv[1:]), flush=True)
        subprocess.run(argv, env={**os.environ, "OMP_WAIT_POLICY": "passive"}, check=True)
        figures = json.loads(out.read_text())
    return {k: v for k, v in figures.items() if not k.startswith(("seconds_", "finished_"))}
