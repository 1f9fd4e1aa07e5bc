"""FastDecode: S-worker + R-worker processes vs transformers and the colocated engine; schedule trace; sizing.

What it runs, in one process tree on this machine (SmolLM2-135M, bf16 weights, fp16 KV):
- tokens/s of decode steps at context S (default 1024) for B = 16, 64, 256, 512 with one and two R-worker
  processes. The sequences start with placeholder contexts spread evenly over [16, S) (the steady state the
  load-stabilising schedule keeps), so a step's attention covers ~B*S/2 entries without first generating
  them; the S-worker runs in this process (one torch thread), the R-workers in their own.
- beside it transformers `generate` at its best batch and dtype and the colocated `generate()` engine,
  both decoding from prompts of S/2 tokens (the same mean context), prefill excluded from their rate, each
  at its best of 1 and all torch threads.
- the effect of thread counts and OpenMP wait policy when the processes share the cores.
- a per-step latency trace with and without the schedule (real requests, short prompts), plotted to PNG
  like FastDecode's Fig. 11, with max and median step latency and tokens/s after warm-up.
- the sizing model's predicted step time against the measured one: max(T(B), R*W/P, (T(B) + R*W)/cores)
  plus one measured ask round trip per layer, W being the KV entries a step attends over.
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
from aiollm.model.engine import ColocatedEngine
from aiollm.model.loader import bundled_path
from aiollm.model.sampling import SamplingParams
from aiollm.planner.fastdecode import interpolate, size
from aiollm.sched.sls import SLSConfig
from aiollm.workers.fastdecode_messages import GetRLoad, GetTrace, Synthetic
from aiollm.workers.messages import Generate, GetLoad, Sampling, Tokens
from aiollm.workers.s_worker import SWorker, SWorkerConfig
from bench.model import t_of_b
from bench.report import table

PROMPT_LEN = 16
# the bundled model every part of this benchmark runs
MODEL = "smollm2"
# the S-worker's default (--pipeline-min-batch): smaller batches run as one mini-batch
PIPELINE_MIN_BATCH = 64


def add_arguments(parser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="S=256, B=16,64, a shorter trace and one transformers batch (about 3 minutes)")
    parser.add_argument("--seq-len", type=int, help="context S of the throughput runs (default 1024; quick 256)")
    parser.add_argument("--batches", help="comma-separated B (default 16,64,256,512; quick 16,64)")
    parser.add_argument("--trace-batch", type=int, help="B of the schedule trace (default 64; quick 32)")
    parser.add_argument("--trace-seq-len", type=int, help="S of the schedule trace (default 256; quick 128)")
    parser.add_argument("--trace-micro-batch", type=int, default=4,
                        help="M of the schedule trace; F = M*(S - prompt)/B steps between micro-batches")
    parser.add_argument("--plot", type=Path, default=Path("fastdecode_sls_trace.png"), help="PNG of the trace")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")


class _Sink(Actor):
    """Receives the trace run's tokens (the S-worker tells them to a client) and counts finished requests."""

    def __init__(self) -> None:
        self.finished = 0

    @handler(Tokens)
    async def on_tokens(self, msg: Tokens) -> None:
        self.finished += sum(d.finish is not None or d.error is not None for d in msg.deltas)


def run(args) -> dict:
    quick = args.quick
    seq_len = args.seq_len or (256 if quick else 1024)
    batches = [int(b) for b in (args.batches or ("16,64" if quick else "16,64,256,512")).split(",")]
    trace_batch = args.trace_batch or (32 if quick else 64)
    trace_seq = args.trace_seq_len or (128 if quick else 256)
    cores = len(os.sched_getaffinity(0))
    # every process started from here inherits these: a waiting OpenMP thread sleeps instead of spinning
    os.environ["OMP_WAIT_POLICY"] = "passive"
    torch.set_num_threads(1)
    kv_attention.set_num_threads(1)
    print(f"context: {cores} cores shared by the S-worker (this process, 1 torch thread) and the R-worker "
          f"processes (1 attention thread each, OMP_WAIT_POLICY=passive); baselines use {cores} torch threads")
    model = load(MODEL, dtype="bf16")
    figures: dict = {"cores": cores, "seq_len": seq_len, "quick": quick}

    curve = {r["batch"]: r["seconds"] for r in t_of_b(model, sorted({1, *batches}), 0.3)}
    r_per_token = _measure_r(model, seq_len)
    r_of = {"fp16": r_per_token, "int8": _measure_r(model, seq_len, "int8")}
    sizing = size(curve, r_per_token, seq_len)
    print("\n-- sizing model (aiollm.planner.fastdecode)\n" + sizing.explain())
    figures.update(t_of_b={str(b): t for b, t in curve.items()}, r_per_token_s=r_per_token,
                   r_per_token_int8_s=r_of["int8"],
                   sizing_batch=sizing.batch, sizing_workers=sizing.workers)

    checked = max([b for b in batches if b <= max(sizing.batch, batches[0])])
    c_eff = _effective_cores(cores)
    print(f"\n-- effective cores: {c_eff:.2f} of {cores} (a fixed single-threaded job in {cores} processes at once "
          f"vs alone; other users of this machine lower it)")
    figures["effective_cores"] = c_eff
    rows, off = uvloop.run(_throughput(model, batches, seq_len, checked))
    print(f"\n-- S-worker + R-worker processes, decode at context S={seq_len} (placeholder contexts over "
          f"[{PROMPT_LEN}, S))\n{table(rows)}")
    figures["fastdecode"] = rows
    best = max(rows, key=lambda r: r["tokens_per_s"])
    best_fp16 = max((r for r in rows if r["kv"] == "fp16"), key=lambda r: r["tokens_per_s"])
    figures.update(fastdecode_best_tokens_per_s=best["tokens_per_s"], fastdecode_best_kv=best["kv"],
                   fastdecode_best_batch=best["batch"], fastdecode_best_fp16_tokens_per_s=best_fp16["tokens_per_s"])

    naive = uvloop.run(_naive_threads(model, min(64, max(batches)), seq_len, cores))
    deliberate = next(r for r in rows if r["batch"] == naive["batch"] and r["r_workers"] == 2)
    print(f"\n-- threads when sharing {cores} cores (B={naive['batch']}, 2 R-workers): deliberate "
          f"{deliberate['step_ms']:.1f} ms/step vs naive {naive['step_ms']:.1f} ms/step "
          f"(S-worker {cores} torch threads, R-workers {cores} attention threads each, OMP_WAIT_POLICY=active)")
    figures.update(naive_threads_step_ms=naive["step_ms"], deliberate_threads_step_ms=deliberate["step_ms"],
                   ratio_naive_vs_deliberate_threads_step=naive["step_ms"] / deliberate["step_ms"])

    # prediction: a step is bounded by its S-part (two half-batch S-parts when pipelined), by one R-worker's
    # share of the attention, and by all that work over the cores this run really got, plus one round trip
    # per layer (the two mini-batches' trips overlap each other); inputs: T(B), R, the KV entries a step
    # attends over, the measured round trip and effective cores
    layers = model.config.n_layers
    for row in rows + [off]:
        b = row["batch"]
        s_part = 2 * interpolate(curve, b / 2) if row["pipelined"] else curve[b]
        r_work = r_of[row.get("kv", "fp16")] * row["kv_tokens"]
        row["predicted_ms"] = (1e3 * max(s_part, r_work / row["r_workers"], (s_part + r_work) / c_eff)
                               + layers * row.get("rtt_ms", rows[-1]["rtt_ms"]))
    check = next(r for r in rows if r["batch"] == checked and r["r_workers"] == 2 and r["kv"] == "fp16")
    print(f"\n-- pipeline (B={checked}, 2 R-workers): {check['step_ms']:.1f} ms/step with, "
          f"{off['step_ms']:.1f} without")
    figures.update(pipeline_on_step_ms=check["step_ms"], pipeline_off_step_ms=off["step_ms"],
                   ratio_pipeline_step=check["step_ms"] / off["step_ms"])
    figures.update(predicted_step_ms=check["predicted_ms"], measured_step_ms=check["step_ms"],
                   predicted_batch=check["batch"],
                   ratio_predicted_vs_measured_step=check["predicted_ms"] / check["step_ms"])
    print(f"\n-- predicted vs measured step (B={check['batch']}, 2 R-workers): {check['predicted_ms']:.1f} ms "
          f"vs {check['step_ms']:.1f} ms; all rows:\n"
          + table([{k: r.get(k, "fp16") for k in ("batch", "r_workers", "kv", "pipelined", "predicted_ms", "step_ms")}
                   for r in rows + [off]]))

    # the baselines get their best thread count too: with other processes on the cores, 2 spinning OpenMP
    # threads can be slower than 1
    threads = sorted({1, cores})
    colocated_rows = []
    for n in threads:
        torch.set_num_threads(n)
        colocated_rows.append(_colocated(model, 16 if quick else 32, seq_len))
    colocated = max(colocated_rows, key=lambda r: r["tokens_per_s"])
    print(f"\n-- colocated generate (bf16, fp16 KV), prompts of S/2 tokens\n{table(colocated_rows)}")
    figures["colocated"] = colocated_rows
    if not args.no_transformers:
        configs = [("bf16", 16)] if quick else [("bf16", 16), ("bf16", 64), ("fp32", 64)]
        hf_rows = _transformers(seq_len, [(d, b, n) for d, b in configs for n in threads])
        print(f"\n-- transformers generate, prompts of S/2 tokens\n{table(hf_rows)}")
        figures["transformers"] = hf_rows
        hf_best = max(hf_rows, key=lambda r: r["tokens_per_s"])
        figures.update(transformers_best_tokens_per_s=hf_best["tokens_per_s"],
                       ratio_tokens_vs_transformers_best=best["tokens_per_s"] / hf_best["tokens_per_s"],
                       ratio_tokens_vs_transformers_best_fp16_kv=best_fp16["tokens_per_s"] / hf_best["tokens_per_s"])
    figures["ratio_tokens_vs_colocated"] = best["tokens_per_s"] / colocated["tokens_per_s"]
    torch.set_num_threads(1)

    schedule = _trace_schedule(trace_batch, trace_seq, args.trace_micro_batch)
    traces = {name: uvloop.run(_trace(model, trace_batch, trace_seq, sls))
              for name, sls in (("without", None), ("with", schedule))}
    summary = [_summarise(name, trace, trace_seq) for name, trace in traces.items()]
    title = (f"B={trace_batch}, S={trace_seq}, F={schedule.interval}, M={schedule.micro_batch_size}, "
             f"W_lim={schedule.limit}")
    print(f"\n-- load-stabilising schedule: {title}, prompts of {PROMPT_LEN} tokens, 2 R-workers; figures after "
          f"a warm-up of S steps; step latency = time between consecutive steps (prefills included)\n"
          f"{table(summary)}")
    _plot(traces, trace_seq, args.plot, title)
    print(f"wrote {args.plot}")
    without, with_ = summary
    figures.update(sls=summary, ratio_sls_max_step=with_["max_step_ms"] / without["max_step_ms"],
                   ratio_sls_tokens=with_["tokens_per_s"] / without["tokens_per_s"])
    return figures


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
                          warm: int = 1, steps: int = 3, pipeline: bool = True) -> dict:
    """Median step time of B sequences with contexts spread over [16, S - steps), after `warm` steps."""
    config = SWorkerConfig(max_batch=batch, pipeline=pipeline, pipeline_min_batch=PIPELINE_MIN_BATCH)
    s = await graph.driver.spawn(SWorker(model, urls, config), name)
    total = warm + steps
    span = seq_len - PROMPT_LEN - total - 1
    lens = [PROMPT_LEN + (i * span) // batch for i in range(batch)]
    await s.ask(Synthetic(lens, total), timeout=600)
    await _wait_steps(s, total)
    trace = await s.ask(GetTrace())
    while (await s.ask(GetLoad())).running:
        await asyncio.sleep(0.05)
    await graph.driver.stop_actor(name)
    step = statistics.median(trace.step_s[warm:total])
    return {"batch": batch, "r_workers": len(urls), "pipelined": pipeline and batch >= PIPELINE_MIN_BATCH,
            "step_ms": 1e3 * step, "tokens_per_s": batch / step,
            "kv_tokens": int(statistics.mean(trace.tokens[warm:total]))}


async def _wait_steps(s, steps: int) -> None:
    """Wait until the S-worker has run `steps` steps; RuntimeError if it stops working before."""
    while len((await s.ask(GetTrace())).step_s) < steps:
        load = await s.ask(GetLoad())
        if not load.running and not load.waiting and len((await s.ask(GetTrace())).step_s) < steps:
            raise RuntimeError(f"the S-worker stopped after fewer than {steps} steps (its log says why)")
        await asyncio.sleep(0.1)


async def _throughput(model, batches: list[int], seq_len: int, unpipelined: int) -> tuple[list[dict], dict]:
    """Rows for every (P, B), and with 2 R-workers one more run at B=`unpipelined` without the pipeline."""
    rows, off = [], {}
    for n in (1, 2):
        async with Graph(startup_timeout=120.0) as graph:
            urls = await _r_workers(graph, n)
            rtt = await _round_trip(graph, urls[0])
            for batch in batches:
                row = await _synthetic_step(graph, model, urls, batch, seq_len, f"s-{n}-{batch}")
                rows.append({**row, "rtt_ms": 1e3 * rtt, "kv": "fp16"})
            if n == 2:
                off = await _synthetic_step(graph, model, urls, unpipelined, seq_len, "s-off", pipeline=False)
    async with Graph(startup_timeout=120.0) as graph:  # int8 KV halves the bytes the R-part reads
        urls = await _r_workers(graph, 2, kv_dtype="int8")
        rtt = await _round_trip(graph, urls[0])
        for batch in [b for b in batches if b >= 256] or batches[-1:]:
            row = await _synthetic_step(graph, model, urls, batch, seq_len, f"s-int8-{batch}")
            rows.append({**row, "rtt_ms": 1e3 * rtt, "kv": "int8"})
    return rows, off


async def _round_trip(graph: Graph, url: str, n: int = 200) -> float:
    """Median seconds of one small ask to an R-worker process and back (the per-layer communication floor)."""
    ref = graph.ref(url)
    times = []
    for _ in range(n):
        started = time.perf_counter()
        await ref.ask(GetRLoad())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


async def _naive_threads(model, batch: int, seq_len: int, cores: int) -> dict:
    """The same run with every process using all cores and spinning OpenMP waits."""
    os.environ["OMP_WAIT_POLICY"] = "active"
    torch.set_num_threads(cores)
    try:
        async with Graph(startup_timeout=120.0) as graph:
            urls = await _r_workers(graph, 2, threads=cores)
            return await _synthetic_step(graph, model, urls, batch, seq_len, "s-naive")
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


def _colocated(model, batch: int, seq_len: int) -> dict:
    """Decode tokens/s of the colocated engine: (generate n+1 tokens - generate 1 token) / (B*n)."""
    prompts = _prompts(model, batch, seq_len // 2)
    n = 16
    engine = ColocatedEngine(model, kv_dtype="fp16", n_blocks=batch * (-(-(seq_len // 2 + n + 1) // 16)))
    times = []
    for max_tokens in (1, n + 1):
        started = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        times.append(time.perf_counter() - started)
    step = (times[1] - times[0]) / n
    return {"threads": torch.get_num_threads(), "batch": batch, "prompt_len": seq_len // 2, "step_ms": 1e3 * step,
            "tokens_per_s": batch / step}


def _transformers(seq_len: int, configs: list[tuple[str, int, int]]) -> list[dict]:
    """transformers `generate` (greedy, KV cache, SDPA), each step timed by a logits processor."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class Clock(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    path = bundled_path(MODEL)
    base = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    rows = []
    n = 17
    bf16 = copy.deepcopy(base).to(torch.bfloat16)
    for dtype, batch, threads in configs:
        torch.set_num_threads(threads)
        hf = base if dtype == "fp32" else bf16
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(100, base.config.vocab_size, (batch, seq_len // 2), generator=gen)
        clock = Clock()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
        step = (clock.stamps[-1] - clock.stamps[0]) / (len(clock.stamps) - 1)  # decode steps only
        rows.append({"dtype": dtype, "threads": threads, "batch": batch, "prompt_len": seq_len // 2,
                     "step_ms": 1e3 * step,
                     "tokens_per_s": batch / step})
    return rows


def _trace_schedule(batch: int, seq_len: int, micro_batch: int) -> SLSConfig:
    """The schedule for requests of PROMPT_LEN + (S - PROMPT_LEN) tokens: a sequence decodes for S' = S - PROMPT_LEN
    steps, so F = M*S'/B keeps B sequences active, and W_lim = B*(PROMPT_LEN + (S'+F)/2) is the paper's
    B*(S+F)/2 plus the prompts every sequence holds from its first step."""
    life = seq_len - PROMPT_LEN
    interval = max(1, micro_batch * life // batch)
    return SLSConfig(batch, life, interval, workload_limit=batch * (PROMPT_LEN + (life + interval + 1) // 2))


async def _trace(model, batch: int, seq_len: int, schedule: SLSConfig | None) -> dict:
    """Real requests (short prompts, completions to S) through 2 R-workers for 2*S steps; the S-worker's trace."""
    steps = 2 * seq_len
    async with Graph(startup_timeout=120.0) as graph:
        urls = await _r_workers(graph, 2)
        config = SWorkerConfig(max_batch=batch, pipeline_min_batch=PIPELINE_MIN_BATCH, schedule=schedule)
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
            "ended": trace.ended[:steps]}


def _summarise(name: str, trace: dict, warm: int) -> dict:
    """Step latency = time between consecutive steps' ends (prefills of new requests included)."""
    ended = trace["ended"]
    gaps = np.diff(ended)[warm - 1:]
    tokens = sum(trace["batch"][warm:])
    return {"schedule": name, "steps": len(gaps), "max_step_ms": 1e3 * float(gaps.max()),
            "median_step_ms": 1e3 * float(np.median(gaps)), "tokens_per_s": tokens / (ended[-1] - ended[warm - 1]),
            "max_kv_tokens": max(trace["tokens"][warm:]), "mean_batch": float(np.mean(trace["batch"][warm:]))}


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
