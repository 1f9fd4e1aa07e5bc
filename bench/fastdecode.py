"""FastDecode: S-worker + R-worker processes vs transformers and the colocated engine; schedule trace; sizing.

What it runs, in one process tree on this machine (SmolLM2-135M, bf16 weights, fp16 KV):
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
  all the work over the cores), W being the KV entries a step attends over.
Each section prints its wall time; `--parts` runs a subset (e.g. `--parts trace` while tuning the schedule).
"""
from __future__ import annotations

import asyncio
import copy
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import uvloop

from aiollm.actors.actor import Actor, handler
from aiollm.graph import Graph
from aiollm.kv import attention as kv_attention
from aiollm.kv.pool import KVConfig, KVPool
from aiollm.model import load
from aiollm.model.loader import bundled_path
from aiollm.model.sampling import SamplingParams
from aiollm.planner.fastdecode import interpolate, predict_step, size, step_round_trip
from aiollm.sched.sls import SLSConfig
from aiollm.workers import runner
from aiollm.workers.fastdecode_messages import GetTrace, Synthetic
from aiollm.workers.messages import Generate, GetLoad, Sampling, Tokens
from aiollm.workers.s_worker import SWorker, SWorkerConfig
from bench.model import s_part_step
from bench.report import table

PROMPT_LEN = 16
# the bundled model every part of this benchmark runs
MODEL = "smollm2"


SECTIONS = ("throughput", "baselines", "trace")


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="S=256, B=16,64, a shorter trace and one transformers batch (about 3 minutes)")
    parser.add_argument("--seq-len", type=int, help="context S of the throughput runs (default 1024; quick 256)")
    parser.add_argument("--batches", help="comma-separated B (default 16,64,256,512; quick 16,64)")
    parser.add_argument("--trace-batch", type=int, help="B of the schedule trace (default 64; quick 32)")
    parser.add_argument("--trace-seq-len", type=int, help="S of the schedule trace (default 128; quick 96)")
    parser.add_argument("--trace-micro-batch", type=int, default=4,
                        help="M of the schedule trace; F = M*(S - prompt)/B steps between micro-batches")
    parser.add_argument("--plot", type=Path, default=Path("fastdecode_sls_trace.png"), help="PNG of the trace")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
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
    batches = [int(b) for b in (args.batches or ("16,64" if quick else "16,64,256,512")).split(",")]
    cores = len(os.sched_getaffinity(0))
    # every process started from here inherits these: a waiting OpenMP thread sleeps instead of spinning
    os.environ["OMP_WAIT_POLICY"] = "passive"
    torch.set_num_threads(1)
    kv_attention.set_num_threads(1)
    print(f"context: {cores} cores shared by the S-worker (this process, 1 torch thread, or {cores} in the "
          f"time-shared rows) and the R-worker processes (1 attention thread each, OMP_WAIT_POLICY=passive); "
          f"baselines at their best of 1 and {cores} torch threads")
    model = load(MODEL, dtype="bf16")
    figures: dict = {"cores": cores, "seq_len": seq_len, "quick": quick}
    for part in parts:
        started = time.perf_counter()
        if part == "throughput":
            _throughput_part(model, batches, seq_len, cores, figures)
        elif part == "baselines":
            _baselines_part(model, seq_len, cores, quick, args.no_transformers, figures)
        else:
            _trace_part(model, args, quick, figures)
        figures[f"seconds_{part}"] = time.perf_counter() - started
        print(f"[{part}: {figures[f'seconds_{part}']:.0f} s]")
    if "transformers_best_tokens_per_s" in figures and "fastdecode_best_tokens_per_s" in figures:
        hf = figures["transformers_best_tokens_per_s"]
        figures.update(ratio_tokens_vs_transformers_best=figures["fastdecode_best_tokens_per_s"] / hf,
                       ratio_tokens_vs_transformers_best_fp16_kv=figures["fastdecode_best_fp16_tokens_per_s"] / hf)
    if "colocated_best_tokens_per_s" in figures and "fastdecode_best_tokens_per_s" in figures:
        figures["ratio_tokens_vs_colocated"] = (figures["fastdecode_best_tokens_per_s"]
                                                / figures["colocated_best_tokens_per_s"])
    return figures


def _throughput_part(model, batches: list[int], seq_len: int, cores: int, figures: dict) -> None:
    """Sizing inputs, tokens/s per (P, B, KV dtype), the pipeline and thread-policy effects, predicted steps."""
    sizes = {max(1, b // 2) for b in batches} | {max(1, b // 4) for b in batches}
    curve = _t_of_b(model, sorted({1, *batches, *sizes}))
    torch.set_num_threads(cores)  # T(B) of the time-shared rows' S-part, on every core
    curve_shared = _t_of_b(model, sorted({1, *batches}))
    torch.set_num_threads(1)
    r_of = {"fp16": _measure_r(model, seq_len), "int8": _measure_r(model, seq_len, "int8")}
    c_eff = _effective_cores(cores)
    print(f"\n-- effective cores: {c_eff:.2f} of {cores} (a fixed single-threaded job in {cores} processes at once "
          f"vs alone; other users of this machine lower it)")
    figures.update(t_of_b={str(b): t for b, t in curve.items()},
                   t_of_b_all_cores={str(b): t for b, t in curve_shared.items()}, r_per_token_s=r_of["fp16"],
                   r_per_token_int8_s=r_of["int8"], effective_cores=c_eff)
    check_batch = max([b for b in batches if b <= 256] or batches[:1])
    rows, off, trips, ramp, r_situ = uvloop.run(_throughput(model, batches, seq_len, check_batch, curve, r_of,
                                                            c_eff))
    # the kernel alone on a fresh pool vs a real R-worker: the step model uses the latter (int8 scaled alike)
    r_of = {"fp16": r_situ, "int8": r_situ * r_of["int8"] / r_of["fp16"]}
    print(f"\n-- R, attention per KV entry (all layers): kernel alone {figures['r_per_token_s']*1e9:.0f} ns, in a "
          f"real R-worker step {r_situ*1e9:.0f} ns (used below)")
    figures["r_per_token_in_situ_s"] = r_situ
    figures["round_trip_ms"] = {str(p): {str(b): 1e3 * t for b, t in c.items()} for p, c in trips.items()}
    sizing = size(curve, r_of["fp16"], seq_len, round_trip=trips, n_layers=model.config.n_layers, cores=c_eff)
    print("\n-- sizing model (aiollm.planner.fastdecode, fed this run's T(B), R, C(b) and effective cores)\n"
          + sizing.explain())
    figures.update(sizing_batch=sizing.batch, sizing_workers=sizing.workers)
    # every row's step predicted from the inputs measured above (no fitting to the measured steps)
    for row in rows + [off]:
        p = predict_step(curve if row["s_threads"] == 1 else curve_shared, r_of[row["kv"]], trips[row["r_workers"]],
                         model.config.n_layers, row["batch"], row["kv_tokens"], row["r_workers"], row["pipelined"],
                         c_eff)
        row["predicted_ms"] = 1e3 * p.step
        row["binding"] = max((("S", p.s_worker), ("R", p.r_worker), ("chain", p.chain),
                              ("cores", p.all_over_cores)), key=lambda kv: kv[1])[0]
    print(f"\n-- S-worker + R-worker processes, decode at context S={seq_len} (placeholder contexts over "
          f"[{PROMPT_LEN}, S)); pipelined or not as predict_step said faster (last row: the other way); "
          f"rows with s_threads={cores} are time-shared (unpipelined, the S-part on every core, then the attention); "
          f"predicted = aiollm.planner.fastdecode.predict_step (T(B) on s_threads), binding = its largest bound\n"
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
          f"(S-worker {cores} torch threads, R-workers {cores} attention threads each, OMP_WAIT_POLICY=active)")
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
    _steady_state_schedule_gain(check, ramp, seq_len, figures, lambda w, n_cores, pipe: predict_step(
        curve, r_of["fp16"], trips[2], model.config.n_layers, check["batch"], w, 2, pipe, n_cores).step, c_eff)
    ratios = [r["predicted_ms"] / r["step_ms"] for r in rows + [off]]
    figures.update(predicted_step_ms=check["predicted_ms"], measured_step_ms=check["step_ms"],
                   predicted_batch=check["batch"],
                   ratio_predicted_vs_measured_step=check["predicted_ms"] / check["step_ms"],
                   predicted_vs_measured_worst=max(ratios, key=lambda x: abs(x - 1)),
                   predicted_within_15pct=sum(abs(x - 1) <= 0.15 for x in ratios) / len(ratios))
    print(f"\n-- predicted vs measured step (B={check['batch']}, 2 R-workers): {check['predicted_ms']:.1f} ms vs "
          f"{check['step_ms']:.1f} ms; over all {len(ratios)} rows: worst ratio {figures['predicted_vs_measured_worst']:.2f}, "
          f"{100 * figures['predicted_within_15pct']:.0f} % within 15 %")


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
    for label, n_cores, pipe in (("here", c_eff, spread["pipelined"]), ("dedicated", 3.0, True)):
        ramp_steps = [price(spread["batch"] * r["context"], n_cores, pipe) for r in ramp]
        predicted[label] = float(np.mean(ramp_steps)) / price(spread["kv_tokens"], n_cores, pipe)
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
    print(f"\n-- colocated decode (aiollm.workers.runner, bf16, fp16 KV), prompts of S/2 tokens, both thread "
          f"counts after one prefill\n{table(colocated_rows)}")
    figures.update(colocated=colocated_rows, colocated_best_tokens_per_s=colocated["tokens_per_s"])
    if no_transformers:
        return
    # fp32 at B=16 only: at B=64 it ran 1.4x slower than bf16 (its prefill of 64 x 512 tokens alone took ~1 min)
    configs = [("bf16", 16)] if quick else [("bf16", 16), ("bf16", 64), ("fp32", 16)]
    hf_rows = _transformers(seq_len, configs, threads)
    torch.set_num_threads(1)
    print(f"\n-- transformers generate, prompts of S/2 tokens (each generate times its first half of decode "
          f"steps at one thread count and the second half at the other)\n{table(hf_rows)}")
    hf_best = max(hf_rows, key=lambda r: r["tokens_per_s"])
    figures.update(transformers=hf_rows, transformers_best_tokens_per_s=hf_best["tokens_per_s"])


def _trace_part(model, args, quick: bool, figures: dict) -> None:
    """Per-step latency with and without the load-stabilising schedule (real requests), the PNG, and what the
    step model says the schedule's throughput gain is here and on dedicated cores."""
    batch = args.trace_batch or (32 if quick else 64)
    seq = args.trace_seq_len or (96 if quick else 128)
    # both runs split every step into two mini-batches: with the schedule the batch dips a few sequences below
    # B between micro-batches, and a pipeline threshold at B would turn exactly those steps unpipelined
    pipeline_min = max(2, batch // 2)
    schedule = _trace_schedule(batch, seq, args.trace_micro_batch)
    sizes = sorted({1, batch, *(max(1, batch // d) for d in (2, 4, 8, 16))})
    curve = _t_of_b(model, sizes)
    r_per_token = figures.get("r_per_token_s") or _measure_r(model, 1024)
    per_ask = [b for b in sizes if 1 < b <= batch // 4]
    runs = {name: uvloop.run(_trace(model, batch, seq, sls, pipeline_min, (curve, r_per_token, per_ask)))
            for name, sls in (("without", None), ("with", schedule))}
    traces = {name: trace for name, (trace, _) in runs.items()}
    trips = runs["without"][1]
    summary = [_summarise(name, trace, seq, pipeline_min) for name, trace in traces.items()]
    title = f"B={batch}, S={seq}, F={schedule.interval}, M={schedule.micro_batch_size}, W_lim={schedule.limit}"
    print(f"\n-- load-stabilising schedule: {title}, prompts of {PROMPT_LEN} tokens, 2 R-workers, pipeline from "
          f"{pipeline_min} sequences; figures after a warm-up of S steps; step latency = time between consecutive "
          f"steps (prefills included)\n{table(summary)}")
    _plot(traces, seq, args.plot, title)
    print(f"wrote {args.plot}")
    without, with_ = summary
    figures.update(sls=summary, ratio_sls_max_step=with_["max_step_ms"] / without["max_step_ms"],
                   ratio_sls_tokens=with_["tokens_per_s"] / without["tokens_per_s"])
    _sls_gain_explained(model, traces, seq, curve, r_per_token, trips, figures)


def _sls_gain_explained(model, traces: dict, warm: int, curve: dict[int, float], r_per_token: float,
                        trips: dict[int, float], figures: dict) -> None:
    """The schedule's throughput gain as the step model predicts it from each trace's per-step (batch, W).

    The gain comes from the pipeline's max(S-part, R-part): an unscheduled batch's W swings from ~B*prompt
    to ~B*S, so R binds late in its life and S early, and the mean of that max exceeds the max at the mean W
    the schedule holds. On shared cores a step is ~(S-part + R-part)/cores, linear in W: the same mean W
    gives the same mean step, so no gain is possible. The same traces are priced both ways."""
    cores = figures.get("effective_cores") or _effective_cores(len(os.sched_getaffinity(0)))
    layers = model.config.n_layers
    out = {}
    for label, n_cores in (("here", cores), ("dedicated", 3.0)):
        mean_step = {}
        for name, trace in traces.items():
            steps = [predict_step(curve, r_per_token, trips, layers, b, w, 2, b >= 2, n_cores).step
                     for b, w in zip(trace["batch"][warm:], trace["tokens"][warm:])]
            mean_step[name] = sum(trace["batch"][warm:]) / sum(steps)
        out[label] = mean_step["with"] / mean_step["without"]
    # the attention a dedicated core could hide: where R binds, the step grows with W, so flattening W pays
    figures.update(sls_predicted_tokens_ratio_here=out["here"], sls_predicted_tokens_ratio_dedicated=out["dedicated"])
    print(f"\n-- schedule gain by the step model (aiollm.planner.fastdecode.predict_step) over these traces' "
          f"(batch, W): tokens/s with/without {out['here']:.3f} on {cores:.2f} effective cores shared by the 3 "
          f"processes (a step costs ~the sum of S-part, attention and communication over the cores, linear in "
          f"W, so a flatter W with the same mean cannot pay), {out['dedicated']:.3f} with a core per process "
          f"(the max of S-part and attention is convex in W); measured here: "
          f"{figures['ratio_sls_tokens']:.3f}")


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


async def _r_workers(graph: Graph, n: int, threads: int = 1, kv_dtype: str = "fp16") -> list[str]:
    args = ("--model", MODEL, "--kv-memory", "8GiB", "--kv-dtype", kv_dtype, "--threads", str(threads))
    nodes = await asyncio.gather(*(graph.start_node("r-worker", process=True, args=args) for _ in range(n)))
    return [node.actors["r-worker"] for node in nodes]


async def _synthetic_step(graph: Graph, model, urls: list[str], batch: int, seq_len: int, name: str,
                          warm: int = 1, steps: int = 3, pipeline: bool = True, context: int = 0,
                          s_threads: int = 1) -> dict:
    """Median step time of B sequences with contexts spread over [16, S - steps) (or all at `context`), after
    `warm` steps; the S-worker (this process) runs its S-part on `s_threads` torch threads."""
    config = SWorkerConfig(max_batch=batch, pipeline=pipeline, pipeline_min_batch=2)
    torch.set_num_threads(s_threads)
    try:
        s = await graph.driver.spawn(SWorker(model, urls, config), name)
        total = warm + steps
        span = seq_len - PROMPT_LEN - total - 1
        lens = [context or PROMPT_LEN + (i * span) // batch for i in range(batch)]
        await s.ask(Synthetic(lens, total), timeout=600)
        await _wait_steps(s, total)
        trace = await s.ask(GetTrace())
        while (await s.ask(GetLoad())).running:
            await asyncio.sleep(0.05)
        await graph.driver.stop_actor(name)
    finally:
        torch.set_num_threads(1)
    step = statistics.median(trace.step_s[warm:total])
    return {"batch": batch, "r_workers": len(urls), "s_threads": s_threads, "pipelined": pipeline and batch >= 2,
            "step_ms": 1e3 * step, "tokens_per_s": batch / step,
            "kv_tokens": int(statistics.mean(trace.tokens[warm:total]))}


async def _wait_steps(s, steps: int) -> None:
    """Wait until the S-worker has run `steps` steps; RuntimeError if it stops working before."""
    while len((await s.ask(GetTrace())).step_s) < steps:
        load = await s.ask(GetLoad())
        if not load.running and not load.waiting and len((await s.ask(GetTrace())).step_s) < steps:
            raise RuntimeError(f"the S-worker stopped after fewer than {steps} steps (its log says why)")
        await asyncio.sleep(0.1)


async def _throughput(model, batches: list[int], seq_len: int, check: int, curve: dict[int, float],
                      r_of: dict[str, float], cores: float
                      ) -> tuple[list[dict], dict, dict[int, dict[int, float]], list[dict], float]:
    """Rows for every (P, B), each with or without the pipeline as the step model predicts faster; with 2
    R-workers B=`check` once more the other way, and the same B at equal contexts from the prompt to S (an
    unscheduled batch's life). First, in the same processes: {P: C(b)} at every rows-per-ask either mode uses
    (aiollm.planner.fastdecode.step_round_trip: real steps at short contexts) and R in situ (a real unpipelined
    step at context S minus its S-part and C(b), per KV entry; the kernel alone on a fresh pool is a floor)."""
    rows, off, trips, ramp, r_situ = [], {}, {}, [], r_of["fp16"]
    layers = model.config.n_layers
    # time-shared rows: no pipeline, the S-part on every core while the R-workers wait, then the R-workers' attention
    # on every core while the S-worker waits (each phase alone on the machine instead of all three competing)
    cores_n = len(os.sched_getaffinity(0))
    shared = [b for b in batches if b >= 256] or batches[-1:]
    mean_w = (PROMPT_LEN + seq_len) / 2

    def pipelined(batch: int, n: int, r: float) -> bool:
        def step(pipe: bool) -> float:
            return predict_step(curve, r, trips[n], layers, batch, batch * mean_w, n, pipe, cores).step
        return batch >= 2 and step(True) < step(False)

    for n in (1, 2):
        async with Graph(startup_timeout=120.0) as graph:
            urls = await _r_workers(graph, n)
            per_ask = {max(1, b // d) for b in batches for d in (n, 2 * n)}
            trips[n] = await step_round_trip(graph.driver, model, urls, sorted(per_ask), curve, r_of["fp16"])
            if n == 1:  # R as a real R-worker attends (its allocator's blocks, its per-step work), not the kernel alone
                b = min(64, max(batches))
                long = await _synthetic_step(graph, model, urls, b, seq_len, "s-r-probe", pipeline=False,
                                             context=seq_len - 8)
                rest = interpolate(curve, b) + layers * interpolate(trips[1], b)
                r_situ = max(r_of["fp16"], (long["step_ms"] / 1e3 - rest) / long["kv_tokens"])
            for batch in batches:
                pipe = pipelined(batch, n, r_situ)
                rows.append({**await _synthetic_step(graph, model, urls, batch, seq_len, f"s-{n}-{batch}",
                                                     pipeline=pipe), "kv": "fp16"})
            if n == 2:
                for batch in shared:
                    rows.append({**await _synthetic_step(graph, model, urls, batch, seq_len, f"s-shared-{batch}",
                                                         pipeline=False, s_threads=cores_n), "kv": "fp16"})
                pipe = pipelined(check, n, r_situ)
                off = {**await _synthetic_step(graph, model, urls, check, seq_len, "s-other", pipeline=not pipe),
                       "kv": "fp16"}
                # without the schedule a batch that starts together holds equal contexts that grow from the
                # prompt to S: the same B at equal contexts over that life
                for i, context in enumerate(np.linspace(PROMPT_LEN, seq_len - 8, 4).astype(int).tolist()):
                    ramp.append({**await _synthetic_step(graph, model, urls, check, seq_len, f"s-ramp-{i}",
                                                         pipeline=pipe, context=context), "context": context})
    r_int8 = r_situ * r_of["int8"] / r_of["fp16"]
    async with Graph(startup_timeout=120.0) as graph:  # int8 KV halves the bytes the R-part reads
        urls = await _r_workers(graph, 2, kv_dtype="int8")
        for batch in [b for b in batches if b >= 256] or batches[-1:]:
            rows.append({**await _synthetic_step(graph, model, urls, batch, seq_len, f"s-int8-{batch}",
                                                 pipeline=pipelined(batch, 2, r_int8)), "kv": "int8"})
        for batch in shared:
            rows.append({**await _synthetic_step(graph, model, urls, batch, seq_len, f"s-int8-shared-{batch}",
                                                 pipeline=False, s_threads=cores_n), "kv": "int8"})
        # and one R-worker at the largest batch (the other process idles: S-worker and R-worker get a core each)
        batch = max(batches)
        rows.append({**await _synthetic_step(graph, model, urls[:1], batch, seq_len, "s-int8-p1",
                                             pipeline=pipelined(batch, 1, r_int8)), "kv": "int8"})
    return rows, off, trips, ramp, r_situ


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


def _effective_cores(cores: int) -> float:
    """cores * t(one job alone) / t(`cores` copies at once): how many cores this run gets right now."""
    job = ("import time, numpy as np; a = np.ones((192, 192), np.float32); t = time.perf_counter()\n"
           "for _ in range(3000): a = (a @ a) * (1.0 / 192)\nprint(time.perf_counter() - t)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}

    def wall(n: int) -> float:
        started = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", job], env=env, stdout=subprocess.DEVNULL) for _ in range(n)]
        for proc in procs:
            proc.wait()
        return time.perf_counter() - started

    alone = wall(1)
    return min(float(cores), cores * alone / wall(cores))


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
    steps, so F = M*S'/B keeps B sequences active, and W_lim = B*(PROMPT_LEN + (S'+F)/2) is the paper's
    B*(S+F)/2 plus the prompts every sequence holds from its first step."""
    life = seq_len - PROMPT_LEN
    interval = max(1, micro_batch * life // batch)
    return SLSConfig(batch, life, interval, workload_limit=batch * (PROMPT_LEN + (life + interval + 1) // 2))


async def _trace(model, batch: int, seq_len: int, schedule: SLSConfig | None, pipeline_min: int,
                 probe: tuple[dict[int, float], float, list[int]]) -> tuple[dict, dict[int, float]]:
    """Real requests (short prompts, completions to S) through 2 R-workers for 2*S steps: the S-worker's trace,
    and C(b) at the rows-per-ask the step model needs (probe: T(B), R and those rows; measured first)."""
    steps = 2 * seq_len
    async with Graph(startup_timeout=120.0) as graph:
        urls = await _r_workers(graph, 2)
        curve, r_per_token, rows = probe
        trips = await step_round_trip(graph.driver, model, urls, rows, curve, r_per_token)
        config = SWorkerConfig(max_batch=batch, pipeline_min_batch=pipeline_min, schedule=schedule)
        s = await graph.driver.spawn(SWorker(model, urls, config), "s-trace")
        sink = _Sink()
        sink_ref = await graph.driver.spawn(sink, "sink")
        sampling = Sampling(max_tokens=seq_len - PROMPT_LEN, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                            ignore_eos=True)
        for i, prompt in enumerate(_prompts(model, 4 * batch, PROMPT_LEN)):
            await s.tell(Generate(f"trace-{i}", prompt, sampling, sink_ref))
        await _wait_steps(s, steps)
        trace = await s.ask(GetTrace())
        await graph.driver.stop_actor("s-trace")
    return {"step_s": trace.step_s[:steps], "batch": trace.batch[:steps], "tokens": trace.tokens[:steps],
            "ended": trace.ended[:steps]}, trips


def _summarise(name: str, trace: dict, warm: int, pipeline_min: int) -> dict:
    """Step latency = time between consecutive steps' ends (prefills of new requests included)."""
    ended = trace["ended"]
    gaps = np.diff(ended)[warm - 1:]
    tokens = sum(trace["batch"][warm:])
    return {"schedule": name, "steps": len(gaps), "max_step_ms": 1e3 * float(gaps.max()),
            "median_step_ms": 1e3 * float(np.median(gaps)), "tokens_per_s": tokens / (ended[-1] - ended[warm - 1]),
            "max_kv_tokens": max(trace["tokens"][warm:]), "mean_kv_tokens": float(np.mean(trace["tokens"][warm:])),
            "mean_batch": float(np.mean(trace["batch"][warm:])),
            "pipelined_steps": float(np.mean(np.array(trace["batch"][warm:]) >= pipeline_min))}


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
    top.set_title(f"FastDecode load-stabilising schedule (Fig. 11): {title}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
