"""`bench fastdecode`'s trace part: per-step latency and tokens/s with and without the load-stabilising schedule
(real requests), placed as FastDecode deploys it, sized by pipelined steps measured in that placement, explained
by the step model window by window, and plotted like the paper's Fig. 11."""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import uvloop

from aiollm.calibrate.fastdecode_probes import long_step_terms, measure_overlap, step_costs, step_curve
from aiollm.deploy.graph import Graph
from aiollm.planner.fastdecode import (
    AskCost,
    balanced_context,
    balanced_seq_len,
    fit_step_curve,
    predict_step,
    schedule_gain,
)
from aiollm.report import table
from bench.fastdecode_steps import PROMPT_LEN, kernel_r, start_r_workers, t_fastest
from bench.fastdecode_trace_runs import TURN_S, interleaved_traces, touch_kv, trace_schedule


def trace_part(model, args, quick: bool, figures: dict) -> None:
    """Per-step latency and tokens/s with and without the load-stabilising schedule (real requests), placed as
    FastDecode deploys: the S-worker (this process) on a core of its own, the R-worker on the other, the
    two-minibatch pipeline on, so a step costs ~max(S-part, R-part) and not their sum. B is given; S is the
    one whose schedule gain is largest on the step curve fitted to pipelined steps of B sequences measured at 8
    contexts in this placement first (`fit_step_curve`): where the S-part binds early in an unscheduled life and
    the R-part late. The step model, fed T(B), C(b) and R measured here too, prices the same windows beside it.
    The runs with and without the schedule take turns of ~TURN_S seconds (aiollm.calibrate.turns), `--trace-repeats` pairs,
    so that both sample the same minutes of the host; tokens/s is pooled per mode over whole periods in steady
    state, on each run's own clock."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise RuntimeError(
            "the schedule trace places the S-worker and the R-worker on cores of their own: "
            f"it needs 2 cores, this process may use {cpus}"
        )
    s_cpus, r_cpus = set(cpus[:1]), cpus[1:]
    batch = args.trace_batch or (64 if quick else 128)
    # runs of an earlier invocation merged in (--merge) with the same B, S and M and the same code pool with these:
    # repeats across holds of the bench lock, which must be short; this invocation's pairs start with the other order
    code = _code_stamp()
    earlier = [
        r
        for r in figures.get("sls", [])
        if args.trace_seq_len
        and figures.get("sls_batch") == batch
        and figures.get("sls_seq_len") == args.trace_seq_len
        and figures.get("sls_micro_batch_arg") == args.trace_micro_batch
        and code is not None
        and r.get("code") == code
    ]
    previous = _pin(s_cpus)
    try:
        curve = t_fastest(model, sorted({1, batch, *(max(1, batch // d) for d in (2, 4))}))
        beside_read = _s_part_beside_read(model, max(1, batch // 2), r_cpus)
        # the longest S searched: at B=128 and S=2560 the R-worker holds ~7 GiB of fp16 KV of its 8 GiB (a given S may
        # lie past it); where the S-part is slow the balance lies at ~2100-2400, so the search goes past 2048
        longest = max(512 if quick else 2560, args.trace_seq_len or 0)
        out = uvloop.run(_traces(model, batch, args, curve, r_cpus, longest, len(earlier) // 2))
    finally:
        _pin(previous)
    (
        traces,
        trips,
        r_situ,
        seq,
        balance,
        schedule,
        price,
        windows,
        overlap,
        price_perfect,
        ceilings,
        s_per_token,
        points,
        measured,
        model_balance,
    ) = out
    stamp = time.strftime("%H:%M UTC", time.gmtime())
    summary = earlier + [
        {**_summarise(name, trace, *window), "run": stamp, "code": code}
        for (name, trace), window in zip(traces, windows)
    ]
    if earlier:
        print(
            f"pooling with {len(earlier)} runs of an earlier invocation at the same B, S, M "
            f"({', '.join(sorted({str(r.get('run')) for r in earlier}))})"
        )
    pooled = {}
    for name in ("without", "with"):
        rows = [r for r in summary if r["schedule"] == name]
        pooled[name] = {
            "tokens_per_s": sum(r["tokens"] for r in rows) / sum(r["seconds"] for r in rows),
            "max_step_ms": max(r["max_step_ms"] for r in rows),
        }
    pairs = [
        summary[i + 1]["tokens_per_s"] / summary[i]["tokens_per_s"]
        if summary[i]["schedule"] == "without"
        else summary[i]["tokens_per_s"] / summary[i + 1]["tokens_per_s"]
        for i in range(0, len(summary) - 1, 2)
    ]
    life = seq - PROMPT_LEN
    title = (
        f"B={batch}, S={seq}, F={schedule.interval}, M={schedule.micro_batch_size}, W_lim={schedule.limit}, "
        f"S-worker on cpu {sorted(s_cpus)}, an R-worker per run on cpu {r_cpus}, runs taking turns"
    )
    print(
        f"\n-- load-stabilising schedule as FastDecode places it: the S-worker (this process, 1 torch thread) "
        f"pinned to cpu {sorted(s_cpus)}, R-worker processes (1 attention thread each) pinned to cpu {r_cpus}, "
        f"OMP_WAIT_POLICY=passive, two-minibatch pipeline on; {title}; prompts of {PROMPT_LEN} tokens, "
        f"completions to S ({life} tokens); the runs with and without take turns of ~{TURN_S:.0f} s on these "
        f"cores, each S-worker with an R-worker of its own (both on cpu {r_cpus}), {len(pairs)} pair(s) "
        f"(--trace-repeats; more by running "
        f"the trace part again with --merge and this --trace-seq-len, on the same committed code); figures over steady-state "
        f"windows (without: one whole life from the second step to the next batch's first, its prefill "
        f"included; with: after {life + schedule.interval} steps of ramp-up, whole F-periods); step latency = "
        f"time between consecutive steps' ends on the run's own clock, the other run's turns cut out (prefills "
        f"included)\n{table(summary)}"
    )
    print(
        f"   pooled: tokens/s with {pooled['with']['tokens_per_s']:.1f} / without "
        f"{pooled['without']['tokens_per_s']:.1f} = {pooled['with']['tokens_per_s'] / pooled['without']['tokens_per_s']:.3f}"
        f"; per pair "
        + ", ".join(f"{x:.3f}" for x in pairs)
        + f"; max step {pooled['with']['max_step_ms']:.0f} / {pooled['without']['max_step_ms']:.0f} ms"
    )
    _plot(dict(traces[:2]), windows[0][0], args.plot, title)
    print(f"wrote {args.plot}")
    figures.update(
        sls=summary,
        sls_pairs_tokens_ratio=pairs,
        sls_batch=batch,
        sls_seq_len=seq,
        sls_micro_batch_arg=args.trace_micro_batch,
        sls_balanced_seq_len=balance,
        sls_interval=schedule.interval,
        sls_micro_batch=schedule.micro_batch_size,
        sls_workload_limit=schedule.limit,
        sls_s_cpus=sorted(s_cpus),
        sls_r_cpus=r_cpus,
        sls_r_per_token_s=r_situ,
        sls_ask_cost_ms={str(b): {"s": 1e3 * t.s, "r": 1e3 * t.r, "wait": 1e3 * t.wait} for b, t in trips.items()},
        sls_t_of_b={str(b): t for b, t in curve.items()},
        ratio_sls_max_step=pooled["with"]["max_step_ms"] / pooled["without"]["max_step_ms"],
        ratio_sls_tokens=pooled["with"]["tokens_per_s"] / pooled["without"]["tokens_per_s"],
    )
    figures.update(
        sls_overlap={**vars(overlap)},
        sls_predicted_gain_perfect_overlap=schedule_gain(price_perfect, batch, PROMPT_LEN, seq),
        sls_model_balanced_seq_len=model_balance,
        sls_step_curve=[{"w": w, "step_ms": 1e3 * t} for w, t in points],
        sls_step_fit={**vars(measured)},
        sls_fitted_gain=schedule_gain(measured, batch, PROMPT_LEN, seq),
    )
    _sls_gain_explained(traces, windows, price, batch, seq, figures)
    _sls_ceiling(ceilings, r_situ, s_per_token, trips[max(1, batch // 2)], model.config.n_layers, batch, figures)
    alone, beside = (float(np.median(x)) for x in zip(*beside_read))
    figures.update(
        sls_s_part_alone_ms=1e3 * alone,
        sls_s_part_beside_read_ms=1e3 * beside,
        sls_s_part_slowdown_beside_read=beside / alone,
    )
    print(
        f"   the sides share memory: T({max(1, batch // 2)}) alone {1e3 * alone:.1f} ms, beside the library's "
        f"1-thread read kernel on cpu {r_cpus} {1e3 * beside:.1f} ms ({beside / alone:.2f}x; medians of "
        f"{len(beside_read)} alternations): what an R-worker streaming its KV costs the S-part"
    )


def _sls_ceiling(
    ceilings: dict, r_situ: float, s_per_token: float, ask: AskCost, layers: int, batch: int, figures: dict
) -> None:
    """The most the schedule can give here by the step model: its gain at the best S (up to 8192) with a perfect
    pipeline overlap, and again without the S-worker's CPU per KV entry. FastDecode's gain needs a step flat in W
    while the S-part binds; here the S-worker's CPU also rises with W (`long_step_terms`' residue beyond T(B) and
    the asks: the two sides share this host's memory, which the paper's GPU S-part does not), and the R-worker's
    fixed per-ask cost fills part of the S-bound floor, so the max of the two sides is blunter than the paper's."""
    perfect, uncoupled = ceilings["perfect_overlap"], ceilings["perfect_overlap_uncoupled"]
    figures.update(
        sls_gain_ceiling_perfect_overlap=perfect["gain"],
        sls_gain_ceiling_seq_len=perfect["seq_len"],
        sls_gain_ceiling_uncoupled=uncoupled["gain"],
        sls_gain_ceiling_uncoupled_seq_len=uncoupled["seq_len"],
    )
    reach = "within reach" if perfect["gain"] >= 1.08 else "out of reach on this host by the step model"
    print(
        f"\n-- the schedule's ceiling by the step model (B={batch}): with a perfect overlap at its best S = "
        f"{perfect['seq_len']}: {perfect['gain']:.3f} (target 1.08: {reach}); without the S-worker's CPU per KV "
        f"entry ({s_per_token * 1e9:.0f} ns, against the R-worker's {r_situ * 1e9:.0f} ns) at S = "
        f"{uncoupled['seq_len']}: {uncoupled['gain']:.3f}; the R-worker's fixed cost per step "
        f"{2 * layers * ask.r * 1e3:.1f} ms ({2 * layers} asks of {ask.r * 1e3:.2f} ms) sits under the S-bound floor too"
    )


def _code_stamp() -> str | None:
    """An id of the code a trace measures (aiollm/, native/ and the bench's modules at HEAD; not bench/results),
    or None when those have uncommitted changes or git is unavailable: runs pool across invocations only when they
    measured the same code."""
    root = Path(__file__).resolve().parent.parent
    paths = ["aiollm", "native", *sorted(str(p.relative_to(root)) for p in (root / "bench").glob("*.py"))]
    try:
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", *paths], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        listing = subprocess.run(
            ["git", "ls-tree", "HEAD", "--", *paths], cwd=root, capture_output=True, text=True, check=True
        ).stdout
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
        # it the second, and the two runs take turns (aiollm.calibrate.turns); one waits idle while the other runs
        runs = await start_r_workers(graph, 2, prefix=("taskset", "-c", ",".join(map(str, r_cpus))))
        urls = runs[:1]
        r_kernel = kernel_r(model, 1024)
        plain = await step_costs(graph.driver, model, urls, [batch], curve, r_kernel)
        # the median of 3 probes, as the throughput part takes: a single probe can read 1274 ns per entry where the
        # traces around it read 770-836, and would put the trace at an S far below the balance its steps show
        r_situ, s_per_token = await long_step_terms(
            graph.driver, model, urls, batch, longest // 2, curve, plain, r_kernel, repeats=3
        )
        trips = await step_costs(graph.driver, model, urls, [max(1, batch // 2)], curve, r_kernel, pipeline=True)
        cores, r_cores = 1 + len(r_cpus), len(r_cpus)

        def priced(w: float, b: int = batch, loss: float = 0.0, per_entry: float = s_per_token):
            return predict_step(curve, r_situ, trips, layers, b, w, 1, b >= 2, cores, r_cores, per_entry, loss)

        # the pipeline's overlap loss in this placement, from a balanced probe of the trace's own batch: holding W
        # pays most where the sides balance, which is where the two mini-batches' chains overlap worst
        context = balanced_context(lambda c: priced(batch * c), longest - 8)
        overlap = await measure_overlap(graph.driver, model, urls, batch, context, trips, cores, longest=longest - 8)

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
        affordable = max(
            (
                s
                for s in range(64, longest + 1, 16)
                if 2.3 * (s - PROMPT_LEN) * price(batch * (PROMPT_LEN + s) / 2) * args.trace_repeats
                <= args.trace_budget
            ),
            default=64,
        )
        # S from the unscheduled steps themselves: pipelined steps at 8 contexts over the longest life, fitted
        points = await step_curve(
            graph.driver, model, urls, batch, [16 * round(longest * (2 * i + 1) / 256) for i in range(8)]
        )
        measured = fit_step_curve(points)
        seq = args.trace_seq_len or balanced_seq_len(measured, batch, PROMPT_LEN, affordable)
        balance = balanced_seq_len(measured, batch, PROMPT_LEN, longest)
        model_balance = balanced_seq_len(price, batch, PROMPT_LEN, 8192)  # where the model's gain peaks, at any cost
        schedule = trace_schedule(batch, seq, args.trace_micro_batch)
        life = seq - PROMPT_LEN
        ask = trips[max(1, batch // 2)]
        print(
            f"\n-- schedule trace sizing (S-worker on its own core, 1 R-worker on cpu {r_cpus}): pipelined "
            f"steps' cost per ask at {batch // 2} rows S {ask.s * 1e3:.2f} + R {ask.r * 1e3:.2f} + wait {ask.wait * 1e3:.2f} "
            f"ms, R in situ {r_situ * 1e9:.0f} ns/entry (kernel alone {r_kernel * 1e9:.0f}), S-worker "
            f"{s_per_token * 1e9:.2f} ns per streamed entry; predicted step at W=0 {price(0) * 1e3:.0f} ms; "
            f"the step model's gain at this S {schedule_gain(price, batch, PROMPT_LEN, seq):.3f} with the measured "
            f"{overlap.explain()}, {schedule_gain(price_perfect, batch, PROMPT_LEN, seq):.3f} with a perfect "
            f"overlap; unbounded, the step model balances at S = {model_balance})\n"
            f"   pipelined steps measured at B={batch}: "
            + ", ".join(f"W={w:.0f}: {t * 1e3:.1f} ms" for w, t in points)
            + f"; fitted: {measured.explain()} -> "
            f"S = {seq} (the fit's gain {schedule_gain(measured, batch, PROMPT_LEN, seq):.3f}; "
            f"the balanced S searched up to {affordable}, the longest whose runs fit --trace-budget "
            f"{args.trace_budget:.0f} s, and by the step model; up to {longest}, the fit balances at S = {balance}"
            + ("" if balance <= affordable else ", beyond the budget: this trace cannot show the schedule's gain")
            + ")",
            flush=True,
        )
        window = schedule.interval * max(1, round(life / 4 / schedule.interval))
        ramp = life + schedule.interval  # steps until the schedule's batch is full
        needs = {"without": life + 2, "with": ramp + window}
        # turns of ~TURN_S seconds by the step model over the interleaved stretch (the life, and the held window)
        rounds = max(
            1, round(((life + 2) * price(batch * (PROMPT_LEN + seq) / 2) + window * price(schedule.limit)) / TURN_S)
        )
        touched = [await touch_kv(graph, model, url, batch, seq) for url in runs]
        print(
            "   both R-workers wrote zeros over the runs' whole reservation first (on a VM fresh memory can cost "
            "~20 ms per 2 MiB on its first touch): " + ", ".join(f"{t:.1f} s" for t in touched),
            flush=True,
        )
        traces, windows = [], []
        for rep in range(args.trace_repeats):
            order = ("without", "with") if (rep + offset) % 2 == 0 else ("with", "without")
            pair = await interleaved_traces(
                graph,
                model,
                {"without": runs[0], "with": runs[1]},
                batch,
                seq,
                schedule,
                max(2, batch // 2),
                ramp,
                needs,
                order,
                rounds,
                f"{rep}",
            )
            for name in order:
                trace = pair[name]
                if name == "without":  # one whole life: from the first batch's second step to the next batch's first
                    first = 0
                    last = next(i for i in range(1, len(trace["started"])) if trace["started"][i])
                else:
                    first, last = ramp - 1, ramp + window - 1
                traces.append((name, trace))
                windows.append((first, last))
                print(
                    f"   trace {name} the schedule: {needs[name]} steps in {trace['ended'][-1] - trace['ended'][0]:.0f} s "
                    f"of its own ({trace['turns']} turns)",
                    flush=True,
                )
    return (
        traces,
        trips,
        r_situ,
        seq,
        balance,
        schedule,
        price,
        windows,
        overlap,
        price_perfect,
        ceilings,
        s_per_token,
        points,
        measured,
        model_balance,
    )


def _sls_gain_explained(traces: list, windows: list, price, batch: int, seq: int, figures: dict) -> None:
    """The schedule's tokens/s gain as the step model (aiollm.planner.fastdecode.predict_step in this placement)
    prices each measured window's per-step (batch, W), beside the measured one, and the model's own
    `schedule_gain` at this B and S: where the model and the measurement part, the print says which steps did."""
    predicted = {"with": [0.0, 0.0], "without": [0.0, 0.0]}
    for (name, trace), (first, last) in zip(traces, windows):
        for b, w in zip(trace["batch"][first + 1 : last + 1], trace["tokens"][first + 1 : last + 1]):
            predicted[name][0] += b
            predicted[name][1] += price(w, b)
    ratio = (predicted["with"][0] / predicted["with"][1]) / (predicted["without"][0] / predicted["without"][1])
    ideal = schedule_gain(price, batch, PROMPT_LEN, seq)
    measured = {}
    for name in ("with", "without"):
        steps = [
            (trace["step_s"][first + 1 : last + 1], trace["tokens"][first + 1 : last + 1])
            for (n, trace), (first, last) in zip(traces, windows)
            if n == name
        ]
        measured[name] = (np.concatenate([s for s, _ in steps]), np.concatenate([w for _, w in steps]))
    # the measured decode step (prefills excluded) by W quartile of the unscheduled life, beside the model
    step_s, held = measured["without"]
    edges = np.quantile(held, [0, 0.25, 0.5, 0.75, 1])
    quartiles = [
        (float(held[(held >= lo) & (held <= hi)].mean()), float(np.median(step_s[(held >= lo) & (held <= hi)])))
        for lo, hi in itertools.pairwise(edges)
    ]
    with_w, with_step = float(measured["with"][1].mean()), float(np.median(measured["with"][0]))
    with_mean = float(np.mean(measured["with"][0]))
    floor, life_mean = quartiles[0][1], float(np.mean(step_s))
    figures.update(
        sls_predicted_tokens_ratio=ratio,
        sls_predicted_gain_balanced=ideal,
        sls_step_by_w_without=[{"w": w, "step_ms": 1e3 * t, "predicted_ms": 1e3 * price(w)} for w, t in quartiles],
        sls_step_with={"w": with_w, "step_ms": 1e3 * with_step, "predicted_ms": 1e3 * price(with_w)},
    )
    print(
        f"\n-- schedule gain by the step model (predict_step with the measured overlap loss, S-worker and R-worker on cores of their own) over "
        f"these windows' (batch, W): with/without {ratio:.3f} (its schedule_gain at B={batch}, S={seq}: {ideal:.3f});"
        f" measured {figures['ratio_sls_tokens']:.3f}\n   decode step (median, prefills excluded) vs W: without, by "
        f"quartile of its life: "
        + ", ".join(f"W={w:.0f}: {1e3 * t:.0f} ms (model {1e3 * price(w):.0f})" for w, t in quartiles)
        + f"; with: W={with_w:.0f}: {1e3 * with_step:.0f} ms (model {1e3 * price(with_w):.0f}; its mean "
        f"{1e3 * with_mean:.0f} ms, so its spread alone costs {with_mean / with_step - 1:.1%}) - the gain is the "
        f"unscheduled life's mean step over the held one, so it needs the step flat in the early quartiles "
        f"(S-part binds) and rising in the late ones (R-part binds)\n   measured: the unscheduled life's mean "
        f"decode step {1e3 * life_mean:.0f} ms is {life_mean / floor:.3f}x its S-bound first quartile; the held W's "
        f"step is {with_step / floor:.3f}x that floor (where S-part and R-part balance, the two mini-batches' "
        f"chains do not fully overlap), so decode steps alone give {life_mean / with_step:.3f}; the rest of the "
        f"tokens/s ratio is the prefills (one of B prompts per life without, one of M every F steps with)"
    )
    figures.update(
        sls_life_mean_over_floor=life_mean / floor,
        sls_held_over_floor=with_step / floor,
        sls_held_mean_over_median=with_mean / with_step,
        sls_decode_step_ratio=life_mean / with_step,
    )


_READ_LOOP = """import sys, numpy as np
from aiollm.native import attention
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
        alone = t_fastest(model, [batch])[batch]
        reader = subprocess.Popen(
            ["taskset", "-c", ",".join(map(str, cpus)), sys.executable, "-c", _READ_LOOP],
            cwd=Path(__file__).resolve().parent.parent,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if reader.stdout.readline().strip() != "reading":
                raise RuntimeError("the read kernel's process did not start (its stderr says why)")
            beside = t_fastest(model, [batch])[batch]
        finally:
            reader.kill()
            reader.wait()
        pairs.append((alone, beside))
    return pairs


def _summarise(name: str, trace: dict, first: int, last: int) -> dict:
    """The window of steps first+1..last (from the end of step `first` to the end of step `last`); step latency =
    time between consecutive steps' ends (prefills of new requests included)."""
    ended = trace["ended"]
    gaps = np.diff(ended)[first:last]
    tokens = sum(trace["batch"][first + 1 : last + 1])
    seconds = ended[last] - ended[first]
    held = trace["tokens"][first + 1 : last + 1]
    return {
        "schedule": name,
        "steps": len(gaps),
        "max_step_ms": 1e3 * float(gaps.max()),
        "median_step_ms": 1e3 * float(np.median(gaps)),
        "mean_step_ms": 1e3 * float(gaps.mean()),
        "p90_step_ms": 1e3 * float(np.quantile(gaps, 0.9)),
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": seconds,
        "max_kv_tokens": max(held),
        "mean_kv_tokens": float(np.mean(held)),
        "mean_batch": float(np.mean(trace["batch"][first + 1 : last + 1])),
    }


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
