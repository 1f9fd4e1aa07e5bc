"""FastDecode: S-worker + R-worker processes vs transformers and the colocated engine; schedule trace; sizing.

What it runs, in one process tree on this machine (SmolLM2-135M, bf16 weights where the CPU multiplies bf16
natively, else fp32 (`fastest_cpu_dtype`), fp16 KV):
- tokens/s of decode steps at context S (default 1024) for B = 16, 64, 256, 512 with one and two R-worker
  processes. The sequences start with placeholder contexts spread evenly over [16, S) (the steady state the
  load-stabilising schedule keeps), so a step's attention covers ~B*S/2 entries without first generating
  them; the S-worker runs in this process (one torch thread), the R-workers in their own. At B >= 256 also
  time-shared rows: no pipeline and the S-part on every core, so the S-part and the attention each have the
  whole machine in turn instead of three processes competing for it (on these 2 vCPUs work slows by 30-50 %
  when all run at once).
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
  curve's prediction kept beside it. The sizing's B, P and mode are the ones it predicts the most tokens/s for.
  The throughput part runs in a process started with OMP_WAIT_POLICY=passive (libgomp reads it once).
Each section prints its wall time; `--parts` runs a subset (e.g. `--parts trace` while tuning the schedule).
"""
from __future__ import annotations

import asyncio
import copy
import hashlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import torch
import uvloop

from aiollm.actors.actor import Actor, handler
from aiollm.graph import Graph
from aiollm.kv import attention as kv_attention
from aiollm.kv.pool import KVConfig, KVPool
from aiollm.model.linear import fastest_cpu_dtype
from aiollm.model import load
from aiollm.model.loader import bundled_path
from aiollm.model.sampling import SamplingParams
from aiollm.planner.fastdecode import (
    AskCost,
    Overlap,
    TimeShared,
    balanced_context,
    balanced_seq_len,
    long_step_terms,
    measure_effective_cores,
    measure_overlap,
    predict_step,
    probe_step,
    schedule_gain,
    size,
    step_costs,
)
from aiollm.sched.sls import SLSConfig
from aiollm.workers import runner
from aiollm.workers.fastdecode_messages import GetRLoad, GetTrace, Synthetic
from aiollm.workers.messages import Generate, GetLoad, Sampling, Tokens
from aiollm.workers.s_worker import SWorker, SWorkerConfig
from bench.model import s_part_step
from bench.report import table
from bench.turns import TakingTurns, Turns, active_clock

PROMPT_LEN = 16
# seconds a turn of the interleaved schedule trace lasts (bench.turns): short beside the host's drift, which moves
# the step by a quarter over minutes, and long beside a handover (one event-loop wake-up)
TURN_S = 6.0
# libgomp (torch's OpenMP) reads OMP_WAIT_POLICY once, when torch loads: setting it later reaches the R-worker
# processes started afterwards but not this process's own S-part threads, which then spin ~20 ms after every
# parallel region (measured: a 2-thread bf16 GEMM loop with 5 ms sleeps used 0.55-0.65 s CPU without, 0.30 s
# with passive set before torch loaded), i.e. through every attention wait of a time-shared step, on the core the
# R-workers need. So the throughput part runs in a process started with it (`_throughput_in_child`).
OMP_PASSIVE_AT_START = os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive"
# the bundled model every part of this benchmark runs
MODEL = "smollm2"


SECTIONS = ("throughput", "baselines", "trace")


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="S=256, B=16,64, a shorter trace and one transformers batch (about 3 minutes)")
    parser.add_argument("--seq-len", type=int, help="context S of the throughput runs (default 1024; quick 256)")
    parser.add_argument("--batches", help="comma-separated B (default 16,64,256,512; quick 16,64)")
    parser.add_argument("--trace-batch", type=int, help="B of the schedule trace (default 128; quick 64)")
    parser.add_argument("--trace-seq-len", type=int,
                        help="S of the schedule trace (default: where the step model balances S-part and R-part)")
    parser.add_argument("--trace-budget", type=float,
                        help="seconds the trace runs may take by the step model; caps the balanced S (default 900: "
                             "on the Zen 5 host the balanced S=1856 at B=128 took ~520-590 s a pair, and in a slower "
                             "phase 700 s capped S at 1856 while the model balanced at 2048; quick 120)")
    parser.add_argument("--trace-repeats", type=int, default=1,
                        help="pairs of trace runs with and without the schedule (taking turns; which takes the "
                             "first turn alternates)")
    parser.add_argument("--trace-micro-batch", type=int, default=8,
                        help="M of the schedule trace; F = M*(S - prompt)/B steps between micro-batches")
    parser.add_argument("--plot", type=Path, default=Path("fastdecode_sls_trace.png"), help="PNG of the trace")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    parser.add_argument("--merge", action="store_true",
                        help="keep the figures of the parts not run from the existing --json file (so the parts can "
                             "run under separate holds of the bench lock); each part's seconds and run time stay")
    parser.add_argument("--parts", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (ratios need their parts)")


class _Sink(Actor):
    """Receives the trace run's tokens (the S-worker tells them to a client) and counts finished requests."""

    def __init__(self) -> None:
        self.finished = 0

    @handler(Tokens)
    async def on_tokens(self, msg: Tokens) -> None:
        self.finished += sum(d.finish is not None or d.error is not None for d in msg.deltas)


def run(args) -> dict:
    quick = args.quick
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(SECTIONS))
    if unknown:
        raise ValueError(f"--parts: unknown {unknown}; sections are {', '.join(SECTIONS)}")
    seq_len = args.seq_len or (256 if quick else 1024)
    if args.trace_budget is None:
        args.trace_budget = 120.0 if quick else 900.0
    batches = [int(b) for b in (args.batches or ("16,64" if quick else "16,64,256,512")).split(",")]
    cores = len(os.sched_getaffinity(0))
    # every process started from here inherits these: a waiting OpenMP thread sleeps instead of spinning
    os.environ["OMP_WAIT_POLICY"] = "passive"
    torch.set_num_threads(1)
    kv_attention.set_num_threads(1)
    print(f"context: {cores} cores shared by the S-worker (this process, 1 torch thread, or {cores} in the "
          f"time-shared rows) and the R-worker processes (1 attention thread each, OMP_WAIT_POLICY=passive); "
          f"baselines at their best of 1 and {cores} torch threads")
    model = load(MODEL, dtype=fastest_cpu_dtype())
    figures: dict = {"cores": cores, "seq_len": seq_len, "quick": quick, "s_dtype": fastest_cpu_dtype()}
    if args.merge and args.json is not None and args.json.exists():
        # the parts run now overwrite their own keys; the ratios across parts are recomputed below
        figures = {**json.loads(args.json.read_text()), **figures}
        kept = [p for p in SECTIONS if p not in parts]
        print(f"merging into {args.json}: keeping its figures of " + ", ".join(
            f"{p} (finished {figures.get(f'finished_{p}', '?')})" for p in kept))
    for part in parts:
        started = time.perf_counter()
        if part == "throughput" and not OMP_PASSIVE_AT_START:
            figures.update(_throughput_in_child(args))
        elif part == "throughput":
            _throughput_part(model, batches, seq_len, cores, figures)
        elif part == "baselines":
            _baselines_part(model, seq_len, cores, quick, args.no_transformers, figures)
        else:
            _trace_part(model, args, quick, figures)
        figures[f"seconds_{part}"] = time.perf_counter() - started
        figures[f"finished_{part}"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        print(f"[{part}: {figures[f'seconds_{part}']:.0f} s]")
    if "transformers_best_tokens_per_s" in figures and "fastdecode_best_tokens_per_s" in figures:
        hf = figures["transformers_best_tokens_per_s"]
        figures.update(ratio_tokens_vs_transformers_best=figures["fastdecode_best_tokens_per_s"] / hf,
                       ratio_tokens_vs_transformers_best_fp16_kv=figures["fastdecode_best_fp16_tokens_per_s"] / hf)
    if "colocated_best_tokens_per_s" in figures and "fastdecode_best_tokens_per_s" in figures:
        figures["ratio_tokens_vs_colocated"] = (figures["fastdecode_best_tokens_per_s"]
                                                / figures["colocated_best_tokens_per_s"])
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


def _throughput_part(model, batches: list[int], seq_len: int, cores: int, figures: dict) -> None:
    """Sizing inputs, tokens/s per (P, B, KV dtype), the pipeline and thread-policy effects, predicted steps."""
    sizes = {max(1, b // 2) for b in batches} | {max(1, b // 4) for b in batches}
    curve = _t_median(model, sorted({1, *batches, *sizes}))
    torch.set_num_threads(cores)  # T(B) of the time-shared rows' S-part, on every core
    curve_shared = _t_median(model, sorted({1, *batches}))
    torch.set_num_threads(1)
    r_of = {"fp16": _measure_r(model, seq_len), "int8": _measure_r(model, seq_len, "int8")}
    c_eff = measure_effective_cores(cores)
    print(f"\n-- effective cores: {c_eff:.2f} of {cores} (aiollm.planner.fastdecode.measure_effective_cores: a fixed "
          f"single-threaded GEMM loop as {cores} processes at once vs alone, median of 3 paired rounds; other users "
          f"of this machine lower it)")
    figures.update(t_of_b={str(b): t for b, t in curve.items()},
                   t_of_b_all_cores={str(b): t for b, t in curve_shared.items()}, r_per_token_s=r_of["fp16"],
                   r_per_token_int8_s=r_of["int8"], effective_cores=c_eff)
    check_batch = max([b for b in batches if b <= 256] or batches[:1])
    rows, off, trips, ramp, situ, overlap = uvloop.run(_throughput(model, batches, seq_len, check_batch, curve,
                                                                   r_of, c_eff))
    # the kernel alone on a fresh pool vs real R-workers (per R-worker count: peers attending at once share the
    # memory bus): the step model uses the latter (int8 scaled alike)
    kernel = dict(r_of)
    r_of = {p: {"fp16": r, "int8": {w: x * kernel["int8"] / kernel["fp16"] for w, x in r.items()}}
            for p, (r, _) in situ.items()}
    s_tok = {p: s for p, (_, s) in situ.items()}
    print(f"\n-- R, attention CPU per KV entry (all layers): kernel alone {kernel['fp16']*1e9:.0f} ns, in real "
          f"R-worker steps " + "; ".join(f"with {p} R-worker(s) attending at once " + ", ".join(
              f"{x*1e9:.0f} ns at {w} entries each" for w, x in sorted(r.items())) for p, (r, _) in situ.items())
          + "; the S-worker's CPU per KV entry the R-workers stream: "
          + ", ".join(f"{s*1e9:.2f} ns with {p}" for p, (_, s) in situ.items()) + " (used below)")
    figures["r_per_token_in_situ_s"] = {str(p): {str(w): x for w, x in r.items()} for p, (r, _) in situ.items()}
    figures["s_cpu_per_kv_token_s"] = {str(p): s for p, (_, s) in situ.items()}
    figures["ask_cost_ms"] = {f"{p}{'_pipelined' if pipe else ''}": {
        str(b): {"s": 1e3 * t.s, "r": 1e3 * t.r, "wait": 1e3 * t.wait} for b, t in c.items()}
        for pipe, by_p in trips.items() for p, c in by_p.items()}
    figures["overlap"] = {str(p): {**vars(o)} for p, o in overlap.items()}
    print("\n-- the pipeline's overlap loss: " + "; ".join(o.explain() for o in overlap.values()))
    loss = {p: o.loss for p, o in overlap.items()}
    # the sizing's cores: the median of every reading so far (the first and one per group of rows): one reading in a
    # slow phase (0.89 at 23:50 UTC while the groups read 1.7-2.0) priced every pipelined option a core short
    readings = [c_eff, *sorted({r["cores_local"] for r in rows})]
    c_size = statistics.median(readings)

    def pooled(first: dict[int, float], threads: int) -> dict[int, float]:
        """The first curve with each row's readings around it (on the same threads): per B the median of all, so one
        disturbed phase of the first curve (H1 chose B=512 P=3 from T(256) 231, T(512) 320 ms) decides less."""
        seen = {b: [t] for b, t in first.items()}
        for r in rows:
            for b, t in r["t_local_ms"].items():
                if r["s_threads"] == threads and int(b) in seen:
                    seen[int(b)].append(t / 1e3)
        return {b: statistics.median(ts) for b, ts in seen.items()}

    sizing = size(pooled(curve, 1), r_of[1]["fp16"], seq_len, round_trip=trips[True], n_layers=model.config.n_layers,
                  cores=c_size, s_per_token=s_tok, time_shared=TimeShared(pooled(curve_shared, cores), trips[False]),
                  overlap=overlap)
    print("\n-- sizing model (aiollm.planner.fastdecode, fed this run's T(B) on one core and on all, R in situ, the "
          "pipelined and unpipelined steps' ask costs and effective cores: median of the readings "
          + ", ".join(f"{c:.2f}" for c in readings) + ")\n" + sizing.explain())
    figures.update(sizing_batch=sizing.batch, sizing_workers=sizing.workers, sizing_mode=sizing.mode,
                   sizing_cores=c_size)
    # the configuration it chose, run as chosen (its mode, spread contexts over [16, S)): the honest check
    chosen = uvloop.run(_chosen_row(model, sizing.batch, sizing.workers, seq_len, sizing.mode == "time-shared"))
    rows.append(chosen)
    # every row's step predicted from the inputs measured above (no fitting to the measured steps)
    def at(by_workers: dict, n: int):  # inputs measured with the most R-workers up to n
        return by_workers[max(k for k in by_workers if k <= n)]

    for row in rows + [off]:
        n = row["r_workers"]

        def price(t_of_b: dict[int, float]):
            return predict_step(t_of_b, at(r_of, n)[row["kv"]], at(trips[row["pipelined"]], n),
                                model.config.n_layers, row["batch"], row["kv_tokens"], n, row["pipelined"],
                                row["cores_local"],
                                s_per_token=at(s_tok, n), overlap=at(loss, n))
        first = curve if row["s_threads"] == 1 else curve_shared
        p = price({**first, **{int(b): t / 1e3 for b, t in row["t_local_ms"].items()}})
        row["predicted_ms"] = 1e3 * p.step
        row["predicted_first_curve_ms"] = 1e3 * price(first).step
        row["overlap_loss_ms"] = 1e3 * p.idle
        row["binding"] = max((("S", p.s_worker), ("R", p.r_worker), ("chain", p.chain),
                              ("cores", p.all_over_cores)), key=lambda kv: kv[1])[0]
    print(f"\n-- S-worker + R-worker processes, decode at context S={seq_len} (placeholder contexts over "
          f"[{PROMPT_LEN}, S)); pipelined or not as predict_step said faster (last row: the other way); "
          f"rows with s_threads={cores} are time-shared (unpipelined, the S-part on every core, then the attention); "
          f"predicted = aiollm.planner.fastdecode.predict_step (T(B) on s_threads), binding = its largest bound, "
          f"s_cpu_ms / r_cpu_ms = each side's CPU per step (R summed over R-workers), busy = their sum over the step "
          f"(cores kept busy)\n"
          f"{table(rows + [off])}")
    figures["fastdecode"] = rows + [off]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    best_fp16 = max((r for r in rows if r["kv"] == "fp16"), key=lambda r: r["tokens_per_s"])
    figures.update(fastdecode_best_tokens_per_s=best["tokens_per_s"], fastdecode_best_kv=best["kv"],
                   fastdecode_best_batch=best["batch"], fastdecode_best_r_workers=best["r_workers"],
                   fastdecode_best_s_threads=best["s_threads"], fastdecode_best_pipelined=best["pipelined"],
                   fastdecode_best_fp16_tokens_per_s=best_fp16["tokens_per_s"])

    deliberate = next(r for r in rows if r["batch"] == min(64, max(batches)) and r["r_workers"] == 2
                      and r["s_threads"] == 1
                      and r["kv"] == "fp16")
    naive = uvloop.run(_naive_threads(model, deliberate["batch"], seq_len, cores, deliberate["pipelined"]))
    print(f"\n-- threads when sharing {cores} cores (B={naive['batch']}, 2 R-workers): deliberate "
          f"{deliberate['step_ms']:.1f} ms/step vs naive {naive['step_ms']:.1f} ms/step "
          f"(S-worker {cores} torch threads, R-workers {cores} attention threads each, OMP_WAIT_POLICY=active; the "
          f"S-worker's own torch threads keep the policy its process started with, passive: libgomp reads it once)")
    figures.update(naive_threads_step_ms=naive["step_ms"], deliberate_threads_step_ms=deliberate["step_ms"],
                   ratio_naive_vs_deliberate_threads_step=naive["step_ms"] / deliberate["step_ms"])

    check = next(r for r in rows if r["batch"] == off["batch"] and r["r_workers"] == 2 and r["kv"] == "fp16"
                 and r["s_threads"] == 1)
    on, without = (check, off) if check["pipelined"] else (off, check)
    print(f"\n-- pipeline (B={check['batch']}, 2 R-workers): {on['step_ms']:.1f} ms/step with, "
          f"{without['step_ms']:.1f} without (predicted {on['predicted_ms']:.1f} and {without['predicted_ms']:.1f}); "
          f"the step model chose {'with' if check['pipelined'] else 'without'}")
    figures.update(pipeline_on_step_ms=on["step_ms"], pipeline_off_step_ms=without["step_ms"],
                   ratio_pipeline_step=on["step_ms"] / without["step_ms"])
    _steady_state_schedule_gain(check, ramp, seq_len, figures, lambda w, n_cores, r_cores, pipe: predict_step(
        curve, r_of[2]["fp16"], trips[pipe][2], model.config.n_layers, check["batch"], w, 2, pipe, n_cores, r_cores,
        s_tok[2], loss[2]).step, c_eff)
    ratios = [r["predicted_ms"] / r["step_ms"] for r in rows + [off]]
    figures.update(predicted_step_ms=chosen["predicted_ms"], measured_step_ms=chosen["step_ms"],
                   predicted_batch=chosen["batch"], predicted_r_workers=chosen["r_workers"],
                   ratio_predicted_vs_measured_step=chosen["predicted_ms"] / chosen["step_ms"],
                   predicted_vs_measured_check_row=check["predicted_ms"] / check["step_ms"],
                   predicted_vs_measured_worst=max(ratios, key=lambda x: abs(x - 1)),
                   predicted_within_15pct=sum(abs(x - 1) <= 0.15 for x in ratios) / len(ratios),
                   predicted_first_curve_within_15pct=sum(abs(r["predicted_first_curve_ms"] / r["step_ms"] - 1) <= 0.15
                                                          for r in rows + [off]) / len(ratios))
    print(f"\n-- predicted vs measured step for the sizing model's choice (B={chosen['batch']}, "
          f"{chosen['r_workers']} R-worker(s), {sizing.mode}): "
          f"{chosen['predicted_ms']:.1f} ms vs {chosen['step_ms']:.1f} ms (its CPU: S-worker {chosen['s_cpu_ms']:.0f} "
          f"ms, R-workers {chosen['r_cpu_ms']:.0f} ms, {chosen['busy']:.2f} of {c_eff:.2f} cores busy over the step; "
          f"effective cores read {' and '.join(f'{c:.2f}' for c in chosen['cores_before_after'])} before and after it, "
          f"the mean priced; "
          f"the model's bounds price CPU, so a step that leaves cores idle is under-predicted by that idle time); "
          f"B={check['batch']} with 2 R-workers "
          f"{check['predicted_ms']:.1f} vs {check['step_ms']:.1f} ms; over all {len(ratios)} rows: worst ratio "
          f"{figures['predicted_vs_measured_worst']:.2f}, {100 * figures['predicted_within_15pct']:.0f} % within 15 % "
          f"({100 * figures['predicted_first_curve_within_15pct']:.0f} % from the first-measured T(B) alone)")


async def _chosen_row(model, batch: int, workers: int, seq_len: int, time_shared: bool) -> dict:
    """The sizing model's configuration (B, P, pipelined or time-shared), run as it chose it."""
    async with Graph(startup_timeout=120.0) as graph:
        urls = await _r_workers(graph, workers)
        threads = len(os.sched_getaffinity(0)) if time_shared else 1
        n_cpus = len(os.sched_getaffinity(0))
        before = await asyncio.to_thread(measure_effective_cores, n_cpus)
        # median of 6 steps and T(B) of 8 readings around them, and the effective cores read before and after: this
        # row is the sizing's check, and the machine's slow phases last seconds (one reading of 1.6 before it, where
        # the other rows read 1.8-2.0, priced its "cores" bound a quarter high)
        row = await _synthetic_step(graph, model, urls, batch, seq_len, "s-chosen", steps=6, t_rounds=4,
                                    pipeline=not time_shared and batch >= 2, s_threads=threads)
        after = await asyncio.to_thread(measure_effective_cores, n_cpus)
        return {"cores_local": (before + after) / 2, "cores_before_after": [before, after], **row, "kv": "fp16",
                "sizing": True}


def _steady_state_schedule_gain(spread: dict, ramp: list[dict], seq_len: int, figures: dict, price, c_eff: float
                                ) -> None:
    """The schedule's tokens/s gain at context S, measured in steady state: a batch started together lives
    through equal contexts from the prompt to S (mean step over that life), the schedule keeps it spread over
    [prompt, S) (one step). Equal mean W; only a step time convex in W (the pipeline's max(S, R) on cores of
    their own) makes the spread batch faster."""
    life = float(np.mean([r["step_ms"] for r in ramp]))
    ends = (ramp[0]["step_ms"] + ramp[-1]["step_ms"]) / 2
    middle = float(np.mean([r["step_ms"] for r in ramp[1:-1]]))
    print(f"\n-- schedule in steady state (B={spread['batch']}, 2 R-workers, S={seq_len}): equal contexts "
          + ", ".join(f"{r['context']}: {r['step_ms']:.1f} ms" for r in ramp)
          + f" (mean over the life {life:.1f} ms; middle points {middle:.1f} vs the ends' mean {ends:.1f}: "
            f"{'linear' if abs(middle / ends - 1) < 0.05 else 'convex' if middle < ends else 'concave'} in W) vs "
            f"spread contexts {spread['step_ms']:.1f} ms -> tokens/s with/without {life / spread['step_ms']:.3f}")
    predicted = {}
    # here as run; on a core per process with the two-minibatch pipeline, as FastDecode runs
    for label, n_cores, r_cores, pipe in (("here", c_eff, 0.0, spread["pipelined"]), ("dedicated", 3.0, 2.0, True)):
        ramp_steps = [price(spread["batch"] * r["context"], n_cores, r_cores, pipe) for r in ramp]
        predicted[label] = float(np.mean(ramp_steps)) / price(spread["kv_tokens"], n_cores, r_cores, pipe)
    print(f"   step model over the same W: with/without {predicted['here']:.3f} on {c_eff:.2f} shared cores, "
          f"{predicted['dedicated']:.3f} with a core per process (S-worker, 2 R-workers): the gain needs the "
          f"R-part to bind late in an unscheduled batch's life and the S-part early, which shared cores never let "
          f"happen (every bound there is the sum of the work)")
    figures.update(sls_steady_ramp=ramp, sls_steady_spread_step_ms=spread["step_ms"],
                   ratio_sls_tokens_steady_state=life / spread["step_ms"],
                   sls_steady_predicted_ratio_here=predicted["here"],
                   sls_steady_predicted_ratio_dedicated=predicted["dedicated"])


def _baselines_part(model, seq_len: int, cores: int, quick: bool, no_transformers: bool, figures: dict) -> None:
    """transformers `generate` at its best batch, dtype and thread count, and the colocated `generate()`."""
    threads = sorted({1, cores})
    colocated_rows = _colocated(model, 16 if quick else 32, seq_len, threads)
    colocated = max(colocated_rows, key=lambda r: r["tokens_per_s"])
    print(f"\n-- colocated decode (aiollm.workers.runner, {fastest_cpu_dtype()}, fp16 KV), prompts of S/2 tokens, both thread "
          f"counts after one prefill\n{table(colocated_rows)}")
    figures.update(colocated=colocated_rows, colocated_best_tokens_per_s=colocated["tokens_per_s"])
    if no_transformers:
        return
    # both dtypes at both batches: which is faster depends on the host (bf16 1.4x faster at B=64 with AMX; on an
    # AVX-512 host without AMX fp32 led bf16 at B=16 by 1.2x, 80 vs 67 tokens/s)
    configs = [(fastest_cpu_dtype(), 16)] if quick else [("bf16", 16), ("bf16", 64), ("fp32", 16), ("fp32", 64)]
    hf_rows = _transformers(seq_len, configs, threads)
    torch.set_num_threads(1)
    print(f"\n-- transformers generate, prompts of S/2 tokens (each generate times its first half of decode "
          f"steps at one thread count and the second half at the other)\n{table(hf_rows)}")
    hf_best = max(hf_rows, key=lambda r: r["tokens_per_s"])
    figures.update(transformers=hf_rows, transformers_best_tokens_per_s=hf_best["tokens_per_s"])


def _trace_part(model, args, quick: bool, figures: dict) -> None:
    """Per-step latency and tokens/s with and without the load-stabilising schedule (real requests), placed as
    FastDecode deploys: the S-worker (this process) on a core of its own, the R-worker on the other, the
    two-minibatch pipeline on, so a step costs ~max(S-part, R-part) and not their sum. B is given; S is the
    one at which the step model (fed T(B), C(b) and R measured in this placement first) balances the S-part
    against the R-part at the unscheduled life's mean W. The runs with and without the schedule take turns of
    ~TURN_S seconds (bench.turns), `--trace-repeats` pairs, so that both sample the same minutes of the host;
    tokens/s is pooled per mode over whole periods in steady state, on each run's own clock."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError("the schedule trace places the S-worker and the R-worker on cores of their own: "
                           f"it needs 2 cores, this process may use {cpus}")
    s_cpus, r_cpus = set(cpus[:1]), cpus[1:]
    batch = args.trace_batch or (64 if quick else 128)
    # runs of an earlier invocation merged in (--merge) with the same B, S and M and the same code pool with these:
    # repeats across holds of the bench lock, which must be short; this invocation's pairs start with the other order
    code = _code_stamp()
    earlier = [r for r in figures.get("sls", []) if args.trace_seq_len and figures.get("sls_batch") == batch
               and figures.get("sls_seq_len") == args.trace_seq_len
               and figures.get("sls_micro_batch_arg") == args.trace_micro_batch and code is not None
               and r.get("code") == code]
    previous = _pin(s_cpus)
    try:
        curve = _t_of_b(model, sorted({1, batch, *(max(1, batch // d) for d in (2, 4))}))
        beside_read = _s_part_beside_read(model, max(1, batch // 2), r_cpus)
        # the longest S searched: at B=128 and S=2048 the R-worker holds ~6 GiB of fp16 KV (a given S may lie past it)
        longest = max(512 if quick else 2048, args.trace_seq_len or 0)
        out = uvloop.run(_traces(model, batch, args, curve, r_cpus, longest, len(earlier) // 2))
    finally:
        _pin(previous)
    traces, trips, r_situ, seq, balance, schedule, price, windows, overlap, price_perfect, ceilings, s_per_token = out
    stamp = time.strftime("%H:%M UTC", time.gmtime())
    summary = earlier + [{**_summarise(name, trace, *window), "run": stamp, "code": code}
                         for (name, trace), window in zip(traces, windows)]
    if earlier:
        print(f"pooling with {len(earlier)} runs of an earlier invocation at the same B, S, M "
              f"({', '.join(sorted({str(r.get('run')) for r in earlier}))})")
    pooled = {}
    for name in ("without", "with"):
        rows = [r for r in summary if r["schedule"] == name]
        pooled[name] = {"tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows),
                        "max_step_ms": max(r["max_step_ms"] for r in rows)}
    pairs = [summary[i + 1]["tokens_per_s"] / summary[i]["tokens_per_s"] if summary[i]["schedule"] == "without"
             else summary[i]["tokens_per_s"] / summary[i + 1]["tokens_per_s"] for i in range(0, len(summary) - 1, 2)]
    life = seq - PROMPT_LEN
    title = (f"B={batch}, S={seq}, F={schedule.interval}, M={schedule.micro_batch_size}, W_lim={schedule.limit}, "
             f"S-worker on cpu {sorted(s_cpus)}, an R-worker per run on cpu {r_cpus}, runs taking turns")
    print(f"\n-- load-stabilising schedule as FastDecode places it: the S-worker (this process, 1 torch thread) "
          f"pinned to cpu {sorted(s_cpus)}, R-worker processes (1 attention thread each) pinned to cpu {r_cpus}, "
          f"OMP_WAIT_POLICY=passive, two-minibatch pipeline on; {title}; prompts of {PROMPT_LEN} tokens, "
          f"completions to S ({life} tokens); the runs with and without take turns of ~{TURN_S:.0f} s on these "
          f"cores, each S-worker with an R-worker of its own (both on cpu {r_cpus}), {len(pairs)} pair(s) "
          f"(--trace-repeats; more by running "
          f"the trace part again with --merge and this --trace-seq-len, on the same committed code); figures over steady-state "
          f"windows (without: one whole life from the second step to the next batch's first, its prefill "
          f"included; with: after {life + schedule.interval} steps of ramp-up, whole F-periods); step latency = "
          f"time between consecutive steps' ends on the run's own clock, the other run's turns cut out (prefills "
          f"included)\n{table(summary)}")
    print(f"   pooled: tokens/s with {pooled['with']['tokens_per_s']:.1f} / without "
          f"{pooled['without']['tokens_per_s']:.1f} = {pooled['with']['tokens_per_s'] / pooled['without']['tokens_per_s']:.3f}"
          f"; per pair " + ", ".join(f"{x:.3f}" for x in pairs)
          + f"; max step {pooled['with']['max_step_ms']:.0f} / {pooled['without']['max_step_ms']:.0f} ms")
    _plot(dict(traces[:2]), windows[0][0], args.plot, title)
    print(f"wrote {args.plot}")
    figures.update(sls=summary, sls_pairs_tokens_ratio=pairs, sls_batch=batch, sls_seq_len=seq,
                   sls_micro_batch_arg=args.trace_micro_batch, sls_balanced_seq_len=balance,
                   sls_interval=schedule.interval, sls_micro_batch=schedule.micro_batch_size,
                   sls_workload_limit=schedule.limit, sls_s_cpus=sorted(s_cpus), sls_r_cpus=r_cpus,
                   sls_r_per_token_s=r_situ, sls_ask_cost_ms={str(b): {"s": 1e3 * t.s, "r": 1e3 * t.r, "wait": 1e3 * t.wait}
                                                                  for b, t in trips.items()},
                   sls_t_of_b={str(b): t for b, t in curve.items()},
                   ratio_sls_max_step=pooled["with"]["max_step_ms"] / pooled["without"]["max_step_ms"],
                   ratio_sls_tokens=pooled["with"]["tokens_per_s"] / pooled["without"]["tokens_per_s"])
    figures.update(sls_overlap={**vars(overlap)},
                   sls_predicted_gain_perfect_overlap=schedule_gain(price_perfect, batch, PROMPT_LEN, seq))
    _sls_gain_explained(traces, windows, price, batch, seq, figures)
    _sls_ceiling(ceilings, r_situ, s_per_token, trips[max(1, batch // 2)], model.config.n_layers, batch, figures)
    alone, beside = (float(np.median(x)) for x in zip(*beside_read))
    figures.update(sls_s_part_alone_ms=1e3 * alone, sls_s_part_beside_read_ms=1e3 * beside,
                   sls_s_part_slowdown_beside_read=beside / alone)
    print(f"   the sides share memory: T({max(1, batch // 2)}) alone {1e3 * alone:.1f} ms, beside the library's "
          f"1-thread read kernel on cpu {r_cpus} {1e3 * beside:.1f} ms ({beside / alone:.2f}x; medians of "
          f"{len(beside_read)} alternations): what an R-worker streaming its KV costs the S-part")


def _sls_ceiling(ceilings: dict, r_situ: float, s_per_token: float, ask: AskCost, layers: int, batch: int,
                 figures: dict) -> None:
    """The most the schedule can give here by the step model: its gain at the best S (up to 8192) with a perfect
    pipeline overlap, and again without the S-worker's CPU per KV entry. FastDecode's gain needs a step flat in W
    while the S-part binds; here the S-worker's CPU also rises with W (`long_step_terms`' residue beyond T(B) and
    the asks: the two sides share this host's memory, which the paper's GPU S-part does not), and the R-worker's
    fixed per-ask cost fills part of the S-bound floor, so the max of the two sides is blunter than the paper's."""
    perfect, uncoupled = ceilings["perfect_overlap"], ceilings["perfect_overlap_uncoupled"]
    figures.update(sls_gain_ceiling_perfect_overlap=perfect["gain"], sls_gain_ceiling_seq_len=perfect["seq_len"],
                   sls_gain_ceiling_uncoupled=uncoupled["gain"], sls_gain_ceiling_uncoupled_seq_len=uncoupled["seq_len"])
    reach = "within reach" if perfect["gain"] >= 1.08 else "out of reach on this host by the step model"
    print(f"\n-- the schedule's ceiling by the step model (B={batch}): with a perfect overlap at its best S = "
          f"{perfect['seq_len']}: {perfect['gain']:.3f} (target 1.08: {reach}); without the S-worker's CPU per KV "
          f"entry ({s_per_token * 1e9:.0f} ns, against the R-worker's {r_situ * 1e9:.0f} ns) at S = "
          f"{uncoupled['seq_len']}: {uncoupled['gain']:.3f}; the R-worker's fixed cost per step "
          f"{2 * layers * ask.r * 1e3:.1f} ms ({2 * layers} asks of {ask.r * 1e3:.2f} ms) sits under the S-bound floor too")


def _code_stamp() -> str | None:
    """An id of the code a trace measures (aiollm/, native/ and the bench's modules at HEAD; not bench/results),
    or None when those have uncommitted changes or git is unavailable: runs pool across invocations only when they
    measured the same code."""
    root = Path(__file__).resolve().parent.parent
    paths = ["aiollm", "native", *sorted(str(p.relative_to(root)) for p in (root / "bench").glob("*.py"))]
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
        listing = subprocess.run(["git", "ls-tree", "HEAD", "--", *paths], cwd=root, capture_output=True,
                                 text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return None if dirty or not listing else hashlib.sha1(listing.encode()).hexdigest()[:12]


def _pin(cpus: set[int]) -> set[int]:
    """Confine every thread of this process (the event loop, torch's and the attention pool's) to `cpus`;
    returns the set it had before. Processes started afterwards inherit it."""
    previous = os.sched_getaffinity(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return previous


async def _traces(model, batch: int, args, curve: dict[int, float], r_cpus: list[int], longest: int, offset: int):
    """In one graph with two R-workers pinned to `r_cpus`: C(b) and R in this placement (on the first), the
    balanced S, then the traces with and without the schedule, taking turns (one R-worker each)."""
    layers = model.config.n_layers
    async with Graph(startup_timeout=120.0) as graph:
        # two R-workers on the same core: the probes and the run without the schedule use the first, the run with
        # it the second, and the two runs take turns (bench.turns); one waits idle while the other runs
        runs = await _r_workers(graph, 2, prefix=("taskset", "-c", ",".join(map(str, r_cpus))))
        urls = runs[:1]
        r_kernel = _measure_r(model, 1024)
        plain = await step_costs(graph.driver, model, urls, [batch], curve, r_kernel)
        # the median of 3 probes, as the throughput part takes: one probe read 1274 ns per entry where the traces
        # around it read 770-836, and the trace then ran at an S far below the balance it went on to show
        r_situ, s_per_token = await long_step_terms(graph.driver, model, urls, batch, longest // 2, curve, plain,
                                                    r_kernel, repeats=3)
        trips = await step_costs(graph.driver, model, urls, [max(1, batch // 2)], curve, r_kernel, pipeline=True)
        cores, r_cores = 1 + len(r_cpus), len(r_cpus)

        def priced(w: float, b: int = batch, loss: float = 0.0, per_entry: float = s_per_token):
            return predict_step(curve, r_situ, trips, layers, b, w, 1, b >= 2, cores, r_cores, per_entry, loss)

        # the pipeline's overlap loss in this placement, from a balanced probe of the trace's own batch: holding W
        # pays most where the sides balance, which is where the two mini-batches' chains overlap worst
        context = balanced_context(lambda c: priced(batch * c), longest - 8)
        overlap = await measure_overlap(graph.driver, model, urls, batch, context, trips, cores)

        def price(w: float, b: int = batch) -> float:
            return priced(w, b, overlap.loss).step

        def price_perfect(w: float, b: int = batch) -> float:
            return priced(w, b).step

        def price_uncoupled(w: float, b: int = batch) -> float:  # perfect overlap, no S-worker CPU per entry
            return priced(w, b, per_entry=0.0).step

        ceilings = {}
        for key, fn in (("perfect_overlap", price_perfect), ("perfect_overlap_uncoupled", price_uncoupled)):
            best = balanced_seq_len(fn, batch, PROMPT_LEN, 8192)
            ceilings[key] = {"seq_len": best, "gain": schedule_gain(fn, batch, PROMPT_LEN, best)}

        # the longest S whose pair of runs (without: a life; with: ramp-up and a quarter life) the step model
        # expects to fit the trace's time budget: a bench-lock hold must stay short
        affordable = max((s for s in range(64, longest + 1, 16)
                          if 2.3 * (s - PROMPT_LEN) * price(batch * (PROMPT_LEN + s) / 2) * args.trace_repeats
                          <= args.trace_budget), default=64)
        seq = args.trace_seq_len or balanced_seq_len(price, batch, PROMPT_LEN, affordable)
        balance = balanced_seq_len(price, batch, PROMPT_LEN, 8192)  # where the gain peaks, whatever it costs
        schedule = _trace_schedule(batch, seq, args.trace_micro_batch)
        life = seq - PROMPT_LEN
        ask = trips[max(1, batch // 2)]
        print(f"\n-- schedule trace sizing (S-worker on its own core, 1 R-worker on cpu {r_cpus}): pipelined "
              f"steps' cost per ask at {batch // 2} rows S {ask.s * 1e3:.2f} + R {ask.r * 1e3:.2f} + wait {ask.wait * 1e3:.2f} "
              f"ms, R in situ {r_situ * 1e9:.0f} ns/entry (kernel alone {r_kernel * 1e9:.0f}), S-worker "
              f"{s_per_token * 1e9:.2f} ns per streamed entry; predicted step at W=0 {price(0) * 1e3:.0f} ms -> S = "
              f"{seq} (predicted gain {schedule_gain(price, batch, PROMPT_LEN, seq):.3f} with the measured "
              f"{overlap.explain()}; {schedule_gain(price_perfect, batch, PROMPT_LEN, seq):.3f} with a perfect "
              f"overlap; the balanced S searched up to {affordable}, the longest whose runs fit --trace-budget "
              f"{args.trace_budget:.0f} s; unbounded, the step model balances at S = {balance}"
              + ("" if balance <= affordable else ", beyond the budget: this trace cannot show the schedule's gain")
              + ")", flush=True)
        window = schedule.interval * max(1, round(life / 4 / schedule.interval))
        ramp = life + schedule.interval  # steps until the schedule's batch is full
        needs = {"without": life + 2, "with": ramp + window}
        # turns of ~TURN_S seconds by the step model over the interleaved stretch (the life, and the held window)
        rounds = max(1, round(((life + 2) * price(batch * (PROMPT_LEN + seq) / 2)
                               + window * price(schedule.limit)) / TURN_S))
        touched = [await _touch_kv(graph, model, url, batch, seq) for url in runs]
        print("   both R-workers wrote zeros over the runs' whole reservation first (fresh memory here costs ~20 ms "
              "per 2 MiB on its first touch): " + ", ".join(f"{t:.1f} s" for t in touched), flush=True)
        traces, windows = [], []
        for rep in range(args.trace_repeats):
            order = ("without", "with") if (rep + offset) % 2 == 0 else ("with", "without")
            pair = await _interleaved_traces(graph, model, {"without": runs[0], "with": runs[1]}, batch, seq,
                                             schedule, max(2, batch // 2), ramp, needs, order, rounds, f"{rep}")
            for name in order:
                trace = pair[name]
                if name == "without":  # one whole life: from the first batch's second step to the next batch's first
                    first = 0
                    last = next(i for i in range(1, len(trace["started"])) if trace["started"][i])
                else:
                    first, last = ramp - 1, ramp + window - 1
                traces.append((name, trace))
                windows.append((first, last))
                print(f"   trace {name} the schedule: {needs[name]} steps in {trace['ended'][-1] - trace['ended'][0]:.0f} s "
                      f"of its own ({trace['turns']} turns)", flush=True)
    return traces, trips, r_situ, seq, balance, schedule, price, windows, overlap, price_perfect, ceilings, s_per_token


def _sls_gain_explained(traces: list, windows: list, price, batch: int, seq: int, figures: dict) -> None:
    """The schedule's tokens/s gain as the step model (aiollm.planner.fastdecode.predict_step in this placement)
    prices each measured window's per-step (batch, W), beside the measured one, and the model's own
    `schedule_gain` at this B and S: where the model and the measurement part, the print says which steps did."""
    predicted = {"with": [0.0, 0.0], "without": [0.0, 0.0]}
    for (name, trace), (first, last) in zip(traces, windows):
        for b, w in zip(trace["batch"][first + 1:last + 1], trace["tokens"][first + 1:last + 1]):
            predicted[name][0] += b
            predicted[name][1] += price(w, b)
    ratio = (predicted["with"][0] / predicted["with"][1]) / (predicted["without"][0] / predicted["without"][1])
    ideal = schedule_gain(price, batch, PROMPT_LEN, seq)
    measured = {}
    for name in ("with", "without"):
        steps = [(trace["step_s"][first + 1:last + 1], trace["tokens"][first + 1:last + 1])
                 for (n, trace), (first, last) in zip(traces, windows) if n == name]
        measured[name] = (np.concatenate([s for s, _ in steps]), np.concatenate([w for _, w in steps]))
    # the measured decode step (prefills excluded) by W quartile of the unscheduled life, beside the model
    step_s, held = measured["without"]
    edges = np.quantile(held, [0, 0.25, 0.5, 0.75, 1])
    quartiles = [(float(held[(held >= lo) & (held <= hi)].mean()), float(np.median(step_s[(held >= lo) & (held <= hi)])))
                 for lo, hi in itertools.pairwise(edges)]
    with_w, with_step = float(measured["with"][1].mean()), float(np.median(measured["with"][0]))
    floor, life_mean = quartiles[0][1], float(np.mean(step_s))
    figures.update(sls_predicted_tokens_ratio=ratio, sls_predicted_gain_balanced=ideal,
                   sls_step_by_w_without=[{"w": w, "step_ms": 1e3 * t, "predicted_ms": 1e3 * price(w)}
                                          for w, t in quartiles],
                   sls_step_with={"w": with_w, "step_ms": 1e3 * with_step, "predicted_ms": 1e3 * price(with_w)})
    print(f"\n-- schedule gain by the step model (predict_step with the measured overlap loss, S-worker and R-worker on cores of their own) over "
          f"these windows' (batch, W): with/without {ratio:.3f} (its schedule_gain at B={batch}, S={seq}: {ideal:.3f});"
          f" measured {figures['ratio_sls_tokens']:.3f}\n   decode step (median, prefills excluded) vs W: without, by "
          f"quartile of its life: " + ", ".join(f"W={w:.0f}: {1e3 * t:.0f} ms (model {1e3 * price(w):.0f})"
                                                   for w, t in quartiles)
          + f"; with: W={with_w:.0f}: {1e3 * with_step:.0f} ms (model {1e3 * price(with_w):.0f}) - the gain is the "
            f"unscheduled life's mean step over the held one, so it needs the step flat in the early quartiles "
            f"(S-part binds) and rising in the late ones (R-part binds)\n   measured: the unscheduled life's mean "
            f"decode step {1e3 * life_mean:.0f} ms is {life_mean / floor:.3f}x its S-bound first quartile; the held W's "
            f"step is {with_step / floor:.3f}x that floor (where S-part and R-part balance, the two mini-batches' "
            f"chains do not fully overlap), so decode steps alone give {life_mean / with_step:.3f}; the rest of the "
            f"tokens/s ratio is the prefills (one of B prompts per life without, one of M every F steps with)")
    figures.update(sls_life_mean_over_floor=life_mean / floor, sls_held_over_floor=with_step / floor,
                   sls_decode_step_ratio=life_mean / with_step)


_READ_LOOP = """import sys, numpy as np
from aiollm.kv import attention
buf = np.ones(2**28 // 8)  # 256 MiB: read from DRAM
attention.read_sum(buf, n_threads=1)
print("reading", flush=True)
while True:
    attention.read_sum(buf, n_threads=1)
"""


def _s_part_beside_read(model, batch: int, cpus: list[int], rounds: int = 3) -> list[tuple[float, float]]:
    """(T(batch) alone, T(batch) while the library's read kernel streams DRAM on `cpus`) per round, alternating:
    how much the R-worker's KV reads slow the S-part through the memory the two sides share (the residue
    `long_step_terms` prices as the S-worker's CPU per KV entry)."""
    pairs = []
    for _ in range(rounds):
        alone = _t_of_b(model, [batch])[batch]
        reader = subprocess.Popen(["taskset", "-c", ",".join(map(str, cpus)), sys.executable, "-c", _READ_LOOP],
                                  cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.PIPE, text=True)
        try:
            if reader.stdout.readline().strip() != "reading":
                raise RuntimeError("the read kernel's process did not start (its stderr says why)")
            beside = _t_of_b(model, [batch])[batch]
        finally:
            reader.kill()
            reader.wait()
        pairs.append((alone, beside))
    return pairs


def _t_of_b(model, sizes: list[int], repeats: int = 5) -> dict[int, float]:
    """T(B): the S-part step (bench.model.s_part_step) per batch size, the fastest of `repeats` after a warm-up
    (the least disturbed by the other processes on these cores; the mean let one spike double a point)."""
    curve = {}
    with torch.inference_mode():
        for b in sizes:
            ids = torch.randint(0, model.config.vocab, (b,))
            rope = model.rope(torch.arange(b) % 1024 + 64)
            times = []
            for _ in range(repeats + 1):
                started = time.perf_counter()
                s_part_step(model, model.embed(ids), rope)
                times.append(time.perf_counter() - started)
            curve[b] = min(times[1:])
    return curve


def _t_runs(model, sizes: list[int], rounds: int, warm: bool, out: dict[int, list[float]]):
    """S-part step times (bench.model.s_part_step) per batch size into `out`, `rounds` rounds over all sizes (after
    a warm-up of each unless `warm` is False): interleaved, so a slow phase of this machine (up to 2x, lasting
    seconds) falls on every size alike. Yields after each run (see `_t_samples_async`)."""
    with torch.inference_mode():
        inputs = {b: (torch.randint(0, model.config.vocab, (b,)), model.rope(torch.arange(b) % 1024 + 64))
                  for b in sizes}
        for rnd in range(rounds + warm):
            for b, (ids, rope) in inputs.items():
                started = time.perf_counter()
                s_part_step(model, model.embed(ids), rope)
                if rnd >= warm:
                    out.setdefault(b, []).append(time.perf_counter() - started)
                yield


def _t_samples(model, sizes: list[int], rounds: int, warm: bool = True) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for _ in _t_runs(model, sizes, rounds, warm, out):
        pass
    return out


async def _t_samples_async(model, sizes: list[int], rounds: int, warm: bool = True) -> dict[int, list[float]]:
    """`_t_samples` giving the event loop a turn after each run: the R-worker connections' heartbeats time out after
    5 s, which a few runs at B=512 in a slow phase exceed."""
    out: dict[int, list[float]] = {}
    for _ in _t_runs(model, sizes, rounds, warm, out):
        await asyncio.sleep(0)
    return out


def _t_median(model, sizes: list[int], rounds: int = 5) -> dict[int, float]:
    """T(B) as the median of interleaved rounds (`_t_samples`): the min of one size's back-to-back repeats took
    the fastest phase, or a whole slow one, while a row's median step sits at the typical speed."""
    return {b: statistics.median(t) for b, t in _t_samples(model, sizes, rounds).items()}


def _measure_r(model, seq_len: int, dtype: str = "fp16", batch: int = 16) -> float:
    """R: seconds of attention per context entry, all layers, one thread (one R-worker)."""
    c = model.config
    per_seq = -(-seq_len // 16)
    pool = KVPool(KVConfig(n_layers=c.n_layers, n_blocks=batch * per_seq, n_kv_heads=c.n_kv_heads,
                           head_dim=c.head_dim, dtype=dtype))
    for arr in (pool.k, pool.v, pool.k_scale, pool.v_scale):  # touch the memory (untouched pages all read
        if arr is not None:                                    # as the one shared zero page)
            arr.fill(1)
    tables = np.arange(batch * per_seq, dtype=np.int32).reshape(batch, per_seq)
    lens = np.full(batch, seq_len, np.int32)
    q = np.random.default_rng(0).standard_normal((batch, c.n_heads, c.head_dim)).astype(np.float32)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for layer in range(c.n_layers):
            pool.attend(layer, q, tables, lens, n_threads=1)
        best = min(best, time.perf_counter() - started)
    return best / (batch * seq_len)


async def _r_workers(graph: Graph, n: int, threads: int = 1, kv_dtype: str = "fp16",
                     prefix: tuple[str, ...] = ()) -> list[str]:
    args = ("--model", MODEL, "--kv-memory", "8GiB", "--kv-dtype", kv_dtype, "--threads", str(threads))
    nodes = await asyncio.gather(*(graph.start_node("r-worker", process=True, args=args, prefix=prefix)
                                   for _ in range(n)))
    return [node.actors["r-worker"] for node in nodes]


async def _synthetic_step(graph: Graph, model, urls: list[str], batch: int, seq_len: int, name: str,
                          steps: int = 5, pipeline: bool = True, context: int = 0, s_threads: int = 1,
                          t_rounds: int = 2) -> dict:
    """Median step time of B sequences with contexts spread over [16, S - steps) (or all at `context`), of 5 steps
    by default (of 3, one configuration read 403 and 635 ms in one run) after a warm-up step
    (aiollm.planner.fastdecode.probe_step); the S-worker (this process) runs its S-part on
    `s_threads` torch threads. With each side's CPU per step: where a step is longer than its CPU over the
    cores, cores sat idle (a side waiting on the other), which no bound of the step model prices."""
    torch.set_num_threads(s_threads)
    try:
        # the S-part alone at this row's batch and half-batch, right before and right after it (median of both):
        # the model's T(B) at this moment, bracketing the row against the machine's drift
        sizes = sorted({batch, max(1, batch // 2)})
        before = await _t_samples_async(model, sizes, t_rounds)
        span = seq_len - PROMPT_LEN - steps - 3
        lens = [context or PROMPT_LEN + (i * span) // batch for i in range(batch)]
        step, s_cpu, r_cpus, held = await probe_step(graph.driver, model, urls, lens, steps, pipeline and batch >= 2,
                                                     name)
        after = await _t_samples_async(model, sizes, t_rounds, warm=False)
        local = {b: statistics.median(before[b] + after[b]) for b in sizes}
    finally:
        torch.set_num_threads(1)
    return {"batch": batch, "r_workers": len(urls), "s_threads": s_threads, "pipelined": pipeline and batch >= 2,
            "step_ms": 1e3 * step, "tokens_per_s": batch / step, "kv_tokens": int(held),
            "s_cpu_ms": 1e3 * s_cpu, "r_cpu_ms": 1e3 * sum(r_cpus), "busy": (s_cpu + sum(r_cpus)) / step,
            "t_local_ms": {str(b): 1e3 * t for b, t in local.items()}}


async def _wait_steps(s, steps: int) -> None:
    """Wait until the S-worker has run `steps` steps; RuntimeError if it stops working before."""
    while len((await s.ask(GetTrace())).step_s) < steps:
        load = await s.ask(GetLoad())
        if not load.running and not load.waiting and len((await s.ask(GetTrace())).step_s) < steps:
            raise RuntimeError(f"the S-worker stopped after fewer than {steps} steps (its log says why)")
        await asyncio.sleep(0.1)


async def _throughput(model, batches: list[int], seq_len: int, check: int, curve: dict[int, float],
                      r_of: dict[str, float], cores: float
                      ) -> tuple[list[dict], dict, dict[bool, dict[int, dict[int, AskCost]]], list[dict], dict[int, tuple],
                                 dict[int, Overlap]]:
    """Rows for every (P, B), each with or without the pipeline as the step model predicts faster; with 2
    R-workers B=`check` once more the other way, and the same B at equal contexts from the prompt to S (an
    unscheduled batch's life). First, in the same processes, each side timed by its own CPU clock: {P: ask costs}
    at every rows-per-ask either mode uses (aiollm.planner.fastdecode.step_costs: real steps at short contexts)
    and {P: (R in situ, the S-worker's CPU per streamed KV entry)} (long_step_terms: a real unpipelined step of
    B=`check` at context S/2; R in situ as measured, the kernel alone only where it reads no positive value), and {P: the pipeline's overlap loss}
    (measure_overlap: a pipelined step of B=`check`/2 at the context where the model prices its sides equal)."""
    rows, off, trips, trips_pipe, ramp, situ, overlap = [], {}, {}, {}, [], {}, {}
    layers = model.config.n_layers
    # time-shared rows: no pipeline, the S-part on every core while the R-workers wait, then the R-workers' attention
    # on every core while the S-worker waits (each phase alone on the machine instead of all three competing)
    cores_n = len(os.sched_getaffinity(0))
    shared = [b for b in batches if b >= 256] or batches[-1:]
    mean_w = (PROMPT_LEN + seq_len) / 2

    def pipelined(batch: int, n: int, r: float) -> bool:
        def step(pipe: bool) -> float:
            return predict_step(curve, r, (trips_pipe if pipe else trips)[n], layers, batch, batch * mean_w, n, pipe,
                                cores, s_per_token=situ[n][1], overlap=overlap[n].loss).step
        return batch >= 2 and step(True) < step(False)

    def here(row: dict) -> dict:  # the effective cores measured next to the row, for its prediction
        return {**row, "cores_local": cores}

    def s_part_now(b: int) -> float:  # T(b) read around each cost probe (step_costs)
        return _t_samples(model, [b], 1)[b][0]

    for n in (1, 2):
        async with Graph(startup_timeout=120.0) as graph:
            urls = await _r_workers(graph, n)
            # effective cores again next to this group's probes and rows (the machine drifts over minutes)
            cores = await asyncio.to_thread(measure_effective_cores, cores_n)
            per_ask = {max(1, b // n) for b in batches}  # unpipelined rows, time-shared ones and R in situ ask B/P
            trips[n] = await step_costs(graph.driver, model, urls, sorted(per_ask), curve, r_of["fp16"],
                                        s_part_now=s_part_now)
            trips_pipe[n] = await step_costs(graph.driver, model, urls, sorted({max(1, b // (2 * n)) for b in batches}),
                                             curve, r_of["fp16"], pipeline=True, s_part_now=s_part_now)
            # R in situ at two loads per R-worker (the check batch and the largest at context S/2, as the rows'
            # spread contexts hold): per KV entry it rises with the KV an R-worker holds
            terms = {b: await long_step_terms(graph.driver, model, urls, b, seq_len // 2, curve, trips[n],
                                              r_of["fp16"], floor=False, s_part_now=s_part_now, repeats=3)
                     for b in sorted({check, max(batches)})}
            situ[n] = ({b * (seq_len // 2 + 3) // n: r for b, (r, _) in terms.items()}, terms[check][1])
            r_situ = situ[n][0]
            probe = max(2, check // 2)
            context = balanced_context(lambda c: predict_step(curve, r_situ, trips_pipe[n], layers, probe, probe * c, n,
                                                              True, cores, s_per_token=situ[n][1]), seq_len - 8)
            overlap[n] = await measure_overlap(graph.driver, model, urls, probe, context, trips_pipe[n], cores)
            for batch in batches:
                pipe = pipelined(batch, n, r_situ)
                rows.append(here({**await _synthetic_step(graph, model, urls, batch, seq_len, f"s-{n}-{batch}",
                                                          pipeline=pipe), "kv": "fp16"}))
            if n == 2:
                for batch in shared:
                    rows.append(here({**await _synthetic_step(graph, model, urls, batch, seq_len, f"s-shared-{batch}",
                                                              pipeline=False, s_threads=cores_n), "kv": "fp16"}))
                pipe = pipelined(check, n, r_situ)
                off = here({**await _synthetic_step(graph, model, urls, check, seq_len, "s-other",
                                                    pipeline=not pipe), "kv": "fp16"})
                # without the schedule a batch that starts together holds equal contexts that grow from the
                # prompt to S: the same B at equal contexts over that life
                for i, context in enumerate(np.linspace(PROMPT_LEN, seq_len - 8, 4).astype(int).tolist()):
                    ramp.append({**await _synthetic_step(graph, model, urls, check, seq_len, f"s-ramp-{i}", steps=3,
                                                         pipeline=pipe, context=context), "context": context})
    r_int8 = {w: r * r_of["int8"] / r_of["fp16"] for w, r in situ[2][0].items()}
    async with Graph(startup_timeout=120.0) as graph:  # int8 KV halves the bytes the R-part reads
        urls = await _r_workers(graph, 2, kv_dtype="int8")
        cores = await asyncio.to_thread(measure_effective_cores, cores_n)
        for batch in [b for b in batches if b >= 256] or batches[-1:]:
            rows.append(here({**await _synthetic_step(graph, model, urls, batch, seq_len, f"s-int8-{batch}",
                                                      pipeline=pipelined(batch, 2, r_int8)), "kv": "int8"}))
        for batch in shared:
            rows.append(here({**await _synthetic_step(graph, model, urls, batch, seq_len, f"s-int8-shared-{batch}",
                                                      pipeline=False, s_threads=cores_n), "kv": "int8"}))
        # and one R-worker at the largest batch (the other process idles: S-worker and R-worker get a core each)
        batch = max(batches)
        rows.append(here({**await _synthetic_step(graph, model, urls[:1], batch, seq_len, "s-int8-p1",
                                                  pipeline=pipelined(batch, 1, r_int8)), "kv": "int8"}))
    return rows, off, {False: trips, True: trips_pipe}, ramp, situ, overlap


async def _naive_threads(model, batch: int, seq_len: int, cores: int, pipeline: bool) -> dict:
    """The same run with every process using all cores and spinning OpenMP waits."""
    os.environ["OMP_WAIT_POLICY"] = "active"
    torch.set_num_threads(cores)
    try:
        async with Graph(startup_timeout=120.0) as graph:
            urls = await _r_workers(graph, 2, threads=cores)
            return await _synthetic_step(graph, model, urls, batch, seq_len, "s-naive", pipeline=pipeline)
    finally:
        os.environ["OMP_WAIT_POLICY"] = "passive"
        torch.set_num_threads(1)


def _prompts(model, batch: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(100, model.config.vocab, (batch, length), generator=gen).tolist()


def _colocated(model, batch: int, seq_len: int, threads: list[int], steps: int = 8) -> list[dict]:
    """Decode steps of the colocated path (aiollm.workers.runner: prefill into a paged fp16 KV cache, then
    `decode_step`, S-part and attention in this process), timed one by one after a single prefill: `steps` at
    each thread count in turn (torch and attention threads alike), the median of each phase.

    (Subtracting a 1-token generate from an (n+1)-token one instead put the prefill's run-to-run noise, about
    a second at B=32 x 512 tokens, into every step.)"""
    prompts = _prompts(model, batch, seq_len // 2)
    params = SamplingParams(max_tokens=2 + steps * len(threads), ignore_eos=True)
    seqs = [runner.new_sequence(f"colocated-{i}", p, params, model) for i, p in enumerate(prompts)]
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
        rows.append({"threads": n, "batch": batch, "prompt_len": seq_len // 2, "step_ms": 1e3 * step,
                     "tokens_per_s": batch / step})
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
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
        gaps = np.diff(clock.stamps)  # decode steps only: stamps[0] is the prefill's logits
        for phase, count in enumerate(threads):
            step = float(np.median(gaps[phase * steps:(phase + 1) * steps]))
            rows.append({"dtype": dtype, "threads": count, "batch": batch, "prompt_len": seq_len // 2,
                         "step_ms": 1e3 * step, "tokens_per_s": batch / step})
    return rows


def _trace_schedule(batch: int, seq_len: int, micro_batch: int) -> SLSConfig:
    """The schedule for requests of PROMPT_LEN + (S - PROMPT_LEN) tokens: a sequence decodes for S' = S - PROMPT_LEN
    steps, so F = M*S'/B keeps B sequences active. W_lim is the paper's B*(S'+F)/2 plus the prompts every sequence
    holds from its first step, plus one micro-batch at its longest (M*S): at an admission slot Algorithm 1 still
    counts the oldest micro-batch for its last steps beside the new one, so with the paper's bound alone it
    delays micro-batches and the batch runs ~10 % short of B (115.8 of 128 in a trace at S=544)."""
    life = seq_len - PROMPT_LEN
    interval = max(1, micro_batch * life // batch)
    config = SLSConfig(batch, life, interval)
    return SLSConfig(batch, life, interval, workload_limit=batch * (PROMPT_LEN + (life + interval + 1) // 2)
                     + config.micro_batch_size * seq_len)


async def _touch_kv(graph: Graph, model, url: str, batch: int, seq_len: int) -> float:
    """Have the R-worker at `url` write zeros over what `batch` sequences of `seq_len` entries reserve, then release
    them; the seconds it took. On this VM a page a process touches for the first time is slow (1 GiB page by page
    11 s, the same again 0.21 s), so without this the run whose R-worker grows into fresh memory pays seconds
    the other does not: on a fresh R-worker each admission of 8 prompts took ~1 s instead of 0.1."""
    started = time.perf_counter()
    s = await graph.driver.spawn(SWorker(model, [url], SWorkerConfig(max_batch=batch)), "s-touch")
    await s.ask(Synthetic([PROMPT_LEN] * batch, seq_len - PROMPT_LEN - 1), timeout=600.0)
    await graph.driver.stop_actor("s-touch")  # releases them on the R-worker (a tell)
    while (await graph.ref(url).ask(GetRLoad())).sequences:
        await asyncio.sleep(0.05)
    return time.perf_counter() - started


async def _interleaved_traces(graph: Graph, model, urls: dict[str, str], batch: int, seq_len: int,
                              schedule: SLSConfig, pipeline_min: int, ramp: int, steps: dict[str, int],
                              order: tuple[str, str], rounds: int, tag: str) -> dict[str, dict]:
    """Real requests (prompts of PROMPT_LEN, completions to `seq_len`) through two S-workers, "with" the schedule
    and "without", each on its own R-worker (`urls[name]`), taking turns on this core (bench.turns): "with" ramps up
    alone for `ramp` iterations, then they alternate in `order`, `rounds` turns each, until each has run
    `steps[name]` steps. Their traces, each step's end on its worker's own clock."""
    cycle = [(name, math.ceil((steps[name] - (ramp if name == "with" else 0)) / rounds)) for name in order]
    turns = Turns(cycle, lead=("with", ramp))
    workers = {}
    for name in ("with", "without"):
        config = SWorkerConfig(max_batch=batch, pipeline_min_batch=pipeline_min,
                               schedule=schedule if name == "with" else None)
        actor = f"s-trace-{name}-{tag}"
        workers[name] = (actor, await graph.driver.spawn(TakingTurns(model, [urls[name]], config, turns=turns,
                                                                     turn_name=name), actor))
    sink_name = f"sink-trace-{tag}"
    sink_ref = await graph.driver.spawn(_Sink(), sink_name)
    sampling = Sampling(max_tokens=seq_len - PROMPT_LEN, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                        ignore_eos=True)
    prompts = _prompts(model, 4 * batch, PROMPT_LEN)  # the same prompts for both runs
    for name, (_, ref) in workers.items():
        for i, prompt in enumerate(prompts):
            await ref.tell(Generate(f"trace-{name}-{tag}-{i}", prompt, sampling, sink_ref))
    out = {}
    for name, (actor, ref) in workers.items():
        await _wait_steps(ref, steps[name])
        trace = await ref.ask(GetTrace())
        n = steps[name]
        out[name] = {"step_s": trace.step_s[:n], "batch": trace.batch[:n], "tokens": trace.tokens[:n],
                     "ended": active_clock(trace.ended[:n], turns.starts[name]), "started": trace.started[:n],
                     "turns": len(turns.starts[name])}
    for actor, _ in workers.values():
        await graph.driver.stop_actor(actor)
    await graph.driver.stop_actor(sink_name)
    return out


def _summarise(name: str, trace: dict, first: int, last: int) -> dict:
    """The window of steps first+1..last (from the end of step `first` to the end of step `last`); step latency =
    time between consecutive steps' ends (prefills of new requests included)."""
    ended = trace["ended"]
    gaps = np.diff(ended)[first:last]
    tokens = sum(trace["batch"][first + 1:last + 1])
    seconds = ended[last] - ended[first]
    held = trace["tokens"][first + 1:last + 1]
    return {"schedule": name, "steps": len(gaps), "max_step_ms": 1e3 * float(gaps.max()),
            "median_step_ms": 1e3 * float(np.median(gaps)), "tokens_per_s": tokens / seconds, "tokens": tokens,
            "seconds": seconds, "max_kv_tokens": max(held), "mean_kv_tokens": float(np.mean(held)),
            "mean_batch": float(np.mean(trace["batch"][first + 1:last + 1]))}


def _plot(traces: dict, warm: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for name, trace in traces.items():
        gaps = 1e3 * np.diff(trace["ended"])
        top.plot(np.arange(1, len(trace["ended"])), gaps, label=f"{name} schedule", linewidth=0.8)
        bottom.plot(trace["tokens"], label=f"{name} schedule", linewidth=0.8)
    for ax in (top, bottom):
        ax.axvline(warm, color="grey", linestyle=":", linewidth=0.8)
        ax.legend()
    top.set_ylabel("step latency (ms)")
    bottom.set_ylabel("KV entries held (R-part work)")
    bottom.set_xlabel("decode step")
    top.set_title(textwrap.fill(f"FastDecode load-stabilising schedule (Fig. 11): {title}", 110), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
