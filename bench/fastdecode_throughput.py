"""`bench fastdecode`'s throughput part: the sizing's inputs measured in real steps, tokens/s per (P, B, KV dtype),
the pipeline and thread-policy effects, the schedule's gain in steady state, and every row's step predicted by the
step model (aiollm.planner.fastdecode) beside the measured one, with the sizing's own choice run as chosen."""

from __future__ import annotations

import asyncio
import functools
import os
import statistics

import numpy as np
import torch
import uvloop

from aiollm.calibrate.fastdecode_probes import long_step_terms, measure_effective_cores, measure_overlap, step_costs
from aiollm.deploy.graph import Graph
from aiollm.planner.fastdecode import AskCost, Overlap, TimeShared, balanced_context, predict_step, size
from aiollm.report import table
from bench.fastdecode_steps import (
    PROMPT_LEN,
    kernel_r,
    start_r_workers,
    synthetic_step,
    t_median,
    t_now,
)


def throughput_part(model, batches: list[int], seq_len: int, cores: int, figures: dict) -> None:
    """Sizing inputs, tokens/s per (P, B, KV dtype), the pipeline and thread-policy effects, predicted steps."""
    sizes = {max(1, b // 2) for b in batches} | {max(1, b // 4) for b in batches}
    curve = t_median(model, sorted({1, *batches, *sizes}))
    torch.set_num_threads(cores)  # T(B) of the time-shared rows' S-part, on every core
    curve_shared = t_median(model, sorted({1, *batches}))
    torch.set_num_threads(1)
    r_of = {"fp16": kernel_r(model, seq_len), "int8": kernel_r(model, seq_len, "int8")}
    c_eff = measure_effective_cores(cores)
    print(
        f"\n-- effective cores: {c_eff:.2f} of {cores} (aiollm.planner.fastdecode.measure_effective_cores: a fixed "
        f"single-threaded GEMM loop as {cores} processes at once vs alone, median of 3 paired rounds; other users "
        f"of this machine lower it)"
    )
    figures.update(
        t_of_b={str(b): t for b, t in curve.items()},
        t_of_b_all_cores={str(b): t for b, t in curve_shared.items()},
        r_per_token_s=r_of["fp16"],
        r_per_token_int8_s=r_of["int8"],
        effective_cores=c_eff,
    )
    check_batch = max([b for b in batches if b <= 256] or batches[:1])
    rows, off, trips, ramp, situ, overlap = uvloop.run(
        _throughput(model, batches, seq_len, check_batch, curve, r_of, c_eff)
    )
    # the kernel alone on a fresh pool vs real R-workers (per R-worker count: peers attending at once share the
    # memory bus): the step model uses the latter (int8 scaled alike)
    kernel = dict(r_of)
    r_of = {
        p: {"fp16": r, "int8": {w: x * kernel["int8"] / kernel["fp16"] for w, x in r.items()}}
        for p, (r, _) in situ.items()
    }
    s_tok = {p: s for p, (_, s) in situ.items()}
    print(
        f"\n-- R, attention CPU per KV entry (all layers): kernel alone {kernel['fp16'] * 1e9:.0f} ns, in real "
        f"R-worker steps "
        + "; ".join(
            f"with {p} R-worker(s) attending at once "
            + ", ".join(f"{x * 1e9:.0f} ns at {w} entries each" for w, x in sorted(r.items()))
            for p, (r, _) in situ.items()
        )
        + "; the S-worker's CPU per KV entry the R-workers stream: "
        + ", ".join(f"{s * 1e9:.2f} ns with {p}" for p, (_, s) in situ.items())
        + " (used below)"
    )
    figures["r_per_token_in_situ_s"] = {str(p): {str(w): x for w, x in r.items()} for p, (r, _) in situ.items()}
    figures["s_cpu_per_kv_token_s"] = {str(p): s for p, (_, s) in situ.items()}
    figures["ask_cost_ms"] = {
        f"{p}{'_pipelined' if pipe else ''}": {
            str(b): {"s": 1e3 * t.s, "r": 1e3 * t.r, "wait": 1e3 * t.wait} for b, t in c.items()
        }
        for pipe, by_p in trips.items()
        for p, c in by_p.items()
    }
    figures["overlap"] = {str(p): {**vars(o)} for p, o in overlap.items()}
    print("\n-- the pipeline's overlap loss: " + "; ".join(o.explain() for o in overlap.values()))
    loss = {p: o.loss for p, o in overlap.items()}
    # the sizing's cores: the median of every reading so far (the first and one per group of rows): a single reading
    # in a slow phase (0.89 while the groups read 1.7-2.0) would price every pipelined option a core short
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

    sizing = size(
        pooled(curve, 1),
        r_of[1]["fp16"],
        seq_len,
        round_trip=trips[True],
        n_layers=model.config.n_layers,
        cores=c_size,
        s_per_token=s_tok,
        time_shared=TimeShared(pooled(curve_shared, cores), trips[False]),
        overlap=overlap,
    )
    print(
        "\n-- sizing model (aiollm.planner.fastdecode, fed this run's T(B) on one core and on all, R in situ, the "
        "pipelined and unpipelined steps' ask costs and effective cores: median of the readings "
        + ", ".join(f"{c:.2f}" for c in readings)
        + ")\n"
        + sizing.explain()
    )
    figures.update(
        sizing_batch=sizing.batch, sizing_workers=sizing.workers, sizing_mode=sizing.mode, sizing_cores=c_size
    )
    # the configuration it chose, run as chosen (its mode, spread contexts over [16, S)): the honest check
    chosen, chosen_inputs = uvloop.run(
        _chosen_row(
            model, sizing.batch, sizing.workers, seq_len, sizing.mode == "time-shared", pooled(curve, 1), kernel["fp16"]
        )
    )
    rows.append(chosen)

    # every row's step predicted from the inputs measured above (no fitting to the measured steps)
    def at(by_workers: dict, n: int):  # inputs measured with the most R-workers up to n
        return by_workers[max(k for k in by_workers if k <= n)]

    for row in rows + [off]:
        n = row["r_workers"]
        group = {
            "r_situ": at(r_of, n)[row["kv"]],
            "trips": at(trips[row["pipelined"]], n),
            "s_per_token": at(s_tok, n),
            "loss": at(loss, n),
        }

        def price(t_of_b: dict[int, float], inputs: dict = group):
            return predict_step(
                t_of_b,
                inputs["r_situ"],
                inputs["trips"],
                model.config.n_layers,
                row["batch"],
                row["kv_tokens"],
                n,
                row["pipelined"],
                row["cores_local"],
                s_per_token=inputs["s_per_token"],
                overlap=inputs["loss"],
            )

        first = curve if row["s_threads"] == 1 else curve_shared
        t_local = {**first, **{int(b): t / 1e3 for b, t in row["t_local_ms"].items()}}
        p = price(t_local)
        if row is chosen:  # also priced on the inputs read again beside it
            row["predicted_local_inputs_ms"] = 1e3 * price(t_local, chosen_inputs).step
        row["predicted_ms"] = 1e3 * p.step
        row["predicted_first_curve_ms"] = 1e3 * price(first).step
        row["overlap_loss_ms"] = 1e3 * p.idle
        row["binding"] = max(
            (("S", p.s_worker), ("R", p.r_worker), ("chain", p.chain), ("cores", p.all_over_cores)),
            key=lambda kv: kv[1],
        )[0]
    print(
        f"\n-- S-worker + R-worker processes, decode at context S={seq_len} (placeholder contexts over "
        f"[{PROMPT_LEN}, S)); pipelined or not as predict_step said faster (last row: the other way); "
        f"rows with s_threads={cores} are time-shared (unpipelined, the S-part on every core, then the attention); "
        f"predicted = aiollm.planner.fastdecode.predict_step (T(B) on s_threads), binding = its largest bound, "
        f"s_cpu_ms / r_cpu_ms = each side's CPU per step (R summed over R-workers), busy = their sum over the step "
        f"(cores kept busy)\n"
        f"{table(rows + [off])}"
    )
    figures["fastdecode"] = rows + [off]
    figures["chosen_local_inputs"] = {
        "r_per_token_in_situ_s": {str(w): r for w, r in chosen_inputs["r_situ"].items()},
        "s_cpu_per_kv_token_s": chosen_inputs["s_per_token"],
        "overlap_loss": chosen_inputs["loss"],
        "ask_cost_ms": {
            str(b): {"s": 1e3 * t.s, "r": 1e3 * t.r, "wait": 1e3 * t.wait} for b, t in chosen_inputs["trips"].items()
        },
    }
    best = max(rows, key=lambda r: r["tokens_per_s"])
    best_fp16 = max((r for r in rows if r["kv"] == "fp16"), key=lambda r: r["tokens_per_s"])
    figures.update(
        fastdecode_best_tokens_per_s=best["tokens_per_s"],
        fastdecode_best_kv=best["kv"],
        fastdecode_best_batch=best["batch"],
        fastdecode_best_r_workers=best["r_workers"],
        fastdecode_best_s_threads=best["s_threads"],
        fastdecode_best_pipelined=best["pipelined"],
        fastdecode_best_fp16_tokens_per_s=best_fp16["tokens_per_s"],
    )

    deliberate = next(
        r
        for r in rows
        if r["batch"] == min(64, max(batches)) and r["r_workers"] == 2 and r["s_threads"] == 1 and r["kv"] == "fp16"
    )
    naive = uvloop.run(_naive_threads(model, deliberate["batch"], seq_len, cores, deliberate["pipelined"]))
    print(
        f"\n-- threads when sharing {cores} cores (B={naive['batch']}, 2 R-workers): deliberate "
        f"{deliberate['step_ms']:.1f} ms/step vs naive {naive['step_ms']:.1f} ms/step "
        f"(S-worker {cores} torch threads, R-workers {cores} attention threads each, OMP_WAIT_POLICY=active; the "
        f"S-worker's own torch threads keep the policy its process started with, passive: libgomp reads it once)"
    )
    figures.update(
        naive_threads_step_ms=naive["step_ms"],
        deliberate_threads_step_ms=deliberate["step_ms"],
        ratio_naive_vs_deliberate_threads_step=naive["step_ms"] / deliberate["step_ms"],
    )

    check = next(
        r
        for r in rows
        if r["batch"] == off["batch"] and r["r_workers"] == 2 and r["kv"] == "fp16" and r["s_threads"] == 1
    )
    on, without = (check, off) if check["pipelined"] else (off, check)
    print(
        f"\n-- pipeline (B={check['batch']}, 2 R-workers): {on['step_ms']:.1f} ms/step with, "
        f"{without['step_ms']:.1f} without (predicted {on['predicted_ms']:.1f} and {without['predicted_ms']:.1f}); "
        f"the step model chose {'with' if check['pipelined'] else 'without'}"
    )
    figures.update(
        pipeline_on_step_ms=on["step_ms"],
        pipeline_off_step_ms=without["step_ms"],
        ratio_pipeline_step=on["step_ms"] / without["step_ms"],
    )
    _steady_state_schedule_gain(
        check,
        ramp,
        seq_len,
        figures,
        lambda w, n_cores, r_cores, pipe: (
            predict_step(
                curve,
                r_of[2]["fp16"],
                trips[pipe][2],
                model.config.n_layers,
                check["batch"],
                w,
                2,
                pipe,
                n_cores,
                r_cores,
                s_tok[2],
                loss[2],
            ).step
        ),
        c_eff,
    )
    ratios = [r["predicted_ms"] / r["step_ms"] for r in rows + [off]]
    figures.update(
        predicted_step_ms=chosen["predicted_ms"],
        measured_step_ms=chosen["step_ms"],
        predicted_batch=chosen["batch"],
        predicted_r_workers=chosen["r_workers"],
        ratio_predicted_vs_measured_step=chosen["predicted_ms"] / chosen["step_ms"],
        predicted_vs_measured_local_inputs=chosen["predicted_local_inputs_ms"] / chosen["step_ms"],
        predicted_vs_measured_check_row=check["predicted_ms"] / check["step_ms"],
        predicted_vs_measured_worst=max(ratios, key=lambda x: abs(x - 1)),
        predicted_within_15pct=sum(abs(x - 1) <= 0.15 for x in ratios) / len(ratios),
        predicted_first_curve_within_15pct=sum(
            abs(r["predicted_first_curve_ms"] / r["step_ms"] - 1) <= 0.15 for r in rows + [off]
        )
        / len(ratios),
    )
    print(
        f"\n-- predicted vs measured step for the sizing model's choice (B={chosen['batch']}, "
        f"{chosen['r_workers']} R-worker(s), {sizing.mode}): "
        f"{chosen['predicted_ms']:.1f} ms vs {chosen['step_ms']:.1f} ms on the group's inputs, as every row; "
        f"{chosen['predicted_local_inputs_ms']:.1f} ms on the inputs read again beside it (R in situ "
        f"{1e9 * next(iter(chosen_inputs['r_situ'].values())):.0f} ns per entry, S-worker "
        f"{1e9 * chosen_inputs['s_per_token']:.0f} ns per streamed entry, overlap loss {chosen_inputs['loss']:.3f}) "
        f"(its CPU: S-worker {chosen['s_cpu_ms']:.0f} "
        f"ms, R-workers {chosen['r_cpu_ms']:.0f} ms, {chosen['busy']:.2f} of {c_eff:.2f} cores busy over the step; "
        f"effective cores read {' and '.join(f'{c:.2f}' for c in chosen['cores_before_after'])} before and after it, "
        f"the mean priced; "
        f"the model's bounds price CPU, so a step that leaves cores idle is under-predicted by that idle time); "
        f"B={check['batch']} with 2 R-workers "
        f"{check['predicted_ms']:.1f} vs {check['step_ms']:.1f} ms; over all {len(ratios)} rows: worst ratio "
        f"{figures['predicted_vs_measured_worst']:.2f}, {100 * figures['predicted_within_15pct']:.0f} % within 15 % "
        f"({100 * figures['predicted_first_curve_within_15pct']:.0f} % from the first-measured T(B) alone)"
    )


async def _chosen_row(
    model, batch: int, workers: int, seq_len: int, time_shared: bool, curve: dict[int, float], r_kernel: float
) -> tuple[dict, dict]:
    """The sizing model's configuration (B, P, pipelined or time-shared), run as it chose it, and the step model's
    other inputs read again right beside it on its own R-workers (the ask cost at its rows per ask, R in situ and the
    S-worker's CPU per streamed entry, and for a pipelined row the overlap loss), as T(B) is for every row: the
    host's phases last seconds to minutes, and the group's inputs are read minutes before (a row priced with 1.07 us
    of R per entry can see its R-worker spend ~2 us). Both predictions are reported; the key stays on the group's
    inputs, as for every other row, since the local reading tracks the measured step no better (both land within
    ~10 % of it)."""
    async with Graph(startup_timeout=120.0) as graph:
        urls = await start_r_workers(graph, workers)
        threads = len(os.sched_getaffinity(0)) if time_shared else 1
        n_cpus = len(os.sched_getaffinity(0))
        pipeline = not time_shared and batch >= 2
        layers = model.config.n_layers
        s_part_now = functools.partial(t_now, model)
        plain = await step_costs(
            graph.driver, model, urls, [max(1, batch // workers)], curve, r_kernel, s_part_now=s_part_now
        )
        r_situ, s_per_token = await long_step_terms(
            graph.driver,
            model,
            urls,
            batch,
            seq_len // 2,
            curve,
            plain,
            r_kernel,
            floor=False,
            s_part_now=s_part_now,
            repeats=3,
        )
        local = {
            "trips": plain,
            "r_situ": {batch * (seq_len // 2 + 3) // workers: r_situ},
            "s_per_token": s_per_token,
            "loss": 0.0,
        }
        before = await asyncio.to_thread(measure_effective_cores, n_cpus)
        if pipeline:
            piped = await step_costs(
                graph.driver,
                model,
                urls,
                [max(1, batch // (2 * workers))],
                curve,
                r_kernel,
                pipeline=True,
                s_part_now=s_part_now,
            )
            probe = max(2, batch // 2)
            context = balanced_context(
                lambda c: predict_step(
                    curve,
                    local["r_situ"],
                    piped,
                    layers,
                    probe,
                    probe * c,
                    workers,
                    True,
                    before,
                    s_per_token=s_per_token,
                ),
                seq_len - 8,
            )
            overlap = await measure_overlap(
                graph.driver, model, urls, probe, context, piped, before, longest=seq_len - 8
            )
            local.update(trips=piped, loss=overlap.loss)
        # median of 6 steps and T(B) of 8 readings around them, and the effective cores read before and after: this
        # row is the sizing's check, and the machine's slow phases last seconds (a single reading of 1.6 where the
        # other rows read 1.8-2.0 would price its "cores" bound a quarter high)
        row = await synthetic_step(
            graph, model, urls, batch, seq_len, "s-chosen", steps=6, t_rounds=4, pipeline=pipeline, s_threads=threads
        )
        after = await asyncio.to_thread(measure_effective_cores, n_cpus)
        return {
            "cores_local": (before + after) / 2,
            "cores_before_after": [before, after],
            **row,
            "kv": "fp16",
            "sizing": True,
        }, local


def _steady_state_schedule_gain(
    spread: dict, ramp: list[dict], seq_len: int, figures: dict, price, c_eff: float
) -> None:
    """The schedule's tokens/s gain at context S, measured in steady state: a batch started together lives
    through equal contexts from the prompt to S (mean step over that life), the schedule keeps it spread over
    [prompt, S) (one step). Equal mean W; only a step time convex in W (the pipeline's max(S, R) on cores of
    their own) makes the spread batch faster."""
    life = float(np.mean([r["step_ms"] for r in ramp]))
    ends = (ramp[0]["step_ms"] + ramp[-1]["step_ms"]) / 2
    middle = float(np.mean([r["step_ms"] for r in ramp[1:-1]]))
    print(
        f"\n-- schedule in steady state (B={spread['batch']}, 2 R-workers, S={seq_len}): equal contexts "
        + ", ".join(f"{r['context']}: {r['step_ms']:.1f} ms" for r in ramp)
        + f" (mean over the life {life:.1f} ms; middle points {middle:.1f} vs the ends' mean {ends:.1f}: "
        f"{'linear' if abs(middle / ends - 1) < 0.05 else 'convex' if middle < ends else 'concave'} in W) vs "
        f"spread contexts {spread['step_ms']:.1f} ms -> tokens/s with/without {life / spread['step_ms']:.3f}"
    )
    predicted = {}
    # here as run; on a core per process with the two-minibatch pipeline, as FastDecode runs
    for label, n_cores, r_cores, pipe in (("here", c_eff, 0.0, spread["pipelined"]), ("dedicated", 3.0, 2.0, True)):
        ramp_steps = [price(spread["batch"] * r["context"], n_cores, r_cores, pipe) for r in ramp]
        predicted[label] = float(np.mean(ramp_steps)) / price(spread["kv_tokens"], n_cores, r_cores, pipe)
    print(
        f"   step model over the same W: with/without {predicted['here']:.3f} on {c_eff:.2f} shared cores, "
        f"{predicted['dedicated']:.3f} with a core per process (S-worker, 2 R-workers): the gain needs the "
        f"R-part to bind late in an unscheduled batch's life and the S-part early, which shared cores never let "
        f"happen (every bound there is the sum of the work)"
    )
    figures.update(
        sls_steady_ramp=ramp,
        sls_steady_spread_step_ms=spread["step_ms"],
        ratio_sls_tokens_steady_state=life / spread["step_ms"],
        sls_steady_predicted_ratio_here=predicted["here"],
        sls_steady_predicted_ratio_dedicated=predicted["dedicated"],
    )


async def _throughput(
    model, batches: list[int], seq_len: int, check: int, curve: dict[int, float], r_of: dict[str, float], cores: float
) -> tuple[
    list[dict], dict, dict[bool, dict[int, dict[int, AskCost]]], list[dict], dict[int, tuple], dict[int, Overlap]
]:
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
            return predict_step(
                curve,
                r,
                (trips_pipe if pipe else trips)[n],
                layers,
                batch,
                batch * mean_w,
                n,
                pipe,
                cores,
                s_per_token=situ[n][1],
                overlap=overlap[n].loss,
            ).step

        return batch >= 2 and step(True) < step(False)

    def here(row: dict) -> dict:  # the effective cores measured next to the row, for its prediction
        return {**row, "cores_local": cores}

    s_part_now = functools.partial(t_now, model)  # T(b) read around each cost probe (step_costs)

    for n in (1, 2):
        async with Graph(startup_timeout=120.0) as graph:
            urls = await start_r_workers(graph, n)
            # effective cores again next to this group's probes and rows (the machine drifts over minutes)
            cores = await asyncio.to_thread(measure_effective_cores, cores_n)
            per_ask = {max(1, b // n) for b in batches}  # unpipelined rows, time-shared ones and R in situ ask B/P
            trips[n] = await step_costs(
                graph.driver, model, urls, sorted(per_ask), curve, r_of["fp16"], s_part_now=s_part_now
            )
            trips_pipe[n] = await step_costs(
                graph.driver,
                model,
                urls,
                sorted({max(1, b // (2 * n)) for b in batches}),
                curve,
                r_of["fp16"],
                pipeline=True,
                s_part_now=s_part_now,
            )
            # R in situ at two loads per R-worker (the check batch and the largest at context S/2, as the rows'
            # spread contexts hold): per KV entry it rises with the KV an R-worker holds
            terms = {
                b: await long_step_terms(
                    graph.driver,
                    model,
                    urls,
                    b,
                    seq_len // 2,
                    curve,
                    trips[n],
                    r_of["fp16"],
                    floor=False,
                    s_part_now=s_part_now,
                    repeats=3,
                )
                for b in sorted({check, max(batches)})
            }
            situ[n] = ({b * (seq_len // 2 + 3) // n: r for b, (r, _) in terms.items()}, terms[check][1])
            r_situ = situ[n][0]
            probe = max(2, check // 2)
            context = balanced_context(
                lambda c: predict_step(
                    curve, r_situ, trips_pipe[n], layers, probe, probe * c, n, True, cores, s_per_token=situ[n][1]
                ),
                seq_len - 8,
            )
            overlap[n] = await measure_overlap(
                graph.driver, model, urls, probe, context, trips_pipe[n], cores, longest=seq_len - 8
            )
            for batch in batches:
                pipe = pipelined(batch, n, r_situ)
                rows.append(
                    here(
                        {
                            **await synthetic_step(graph, model, urls, batch, seq_len, f"s-{n}-{batch}", pipeline=pipe),
                            "kv": "fp16",
                        }
                    )
                )
            if n == 2:
                for batch in shared:
                    rows.append(
                        here(
                            {
                                **await synthetic_step(
                                    graph,
                                    model,
                                    urls,
                                    batch,
                                    seq_len,
                                    f"s-shared-{batch}",
                                    pipeline=False,
                                    s_threads=cores_n,
                                ),
                                "kv": "fp16",
                            }
                        )
                    )
                pipe = pipelined(check, n, r_situ)
                off = here(
                    {
                        **await synthetic_step(graph, model, urls, check, seq_len, "s-other", pipeline=not pipe),
                        "kv": "fp16",
                    }
                )
                # without the schedule a batch that starts together holds equal contexts that grow from the
                # prompt to S: the same B at equal contexts over that life
                for i, context in enumerate(np.linspace(PROMPT_LEN, seq_len - 8, 4).astype(int).tolist()):
                    ramp.append(
                        {
                            **await synthetic_step(
                                graph,
                                model,
                                urls,
                                check,
                                seq_len,
                                f"s-ramp-{i}",
                                steps=3,
                                pipeline=pipe,
                                context=context,
                            ),
                            "context": context,
                        }
                    )
    r_int8 = {w: r * r_of["int8"] / r_of["fp16"] for w, r in situ[2][0].items()}
    async with Graph(startup_timeout=120.0) as graph:  # int8 KV halves the bytes the R-part reads
        urls = await start_r_workers(graph, 2, kv_dtype="int8")
        cores = await asyncio.to_thread(measure_effective_cores, cores_n)
        for batch in [b for b in batches if b >= 256] or batches[-1:]:
            rows.append(
                here(
                    {
                        **await synthetic_step(
                            graph, model, urls, batch, seq_len, f"s-int8-{batch}", pipeline=pipelined(batch, 2, r_int8)
                        ),
                        "kv": "int8",
                    }
                )
            )
        for batch in shared:
            rows.append(
                here(
                    {
                        **await synthetic_step(
                            graph,
                            model,
                            urls,
                            batch,
                            seq_len,
                            f"s-int8-shared-{batch}",
                            pipeline=False,
                            s_threads=cores_n,
                        ),
                        "kv": "int8",
                    }
                )
            )
        # and one R-worker at the largest batch (the other process idles: S-worker and R-worker get a core each)
        batch = max(batches)
        rows.append(
            here(
                {
                    **await synthetic_step(
                        graph, model, urls[:1], batch, seq_len, "s-int8-p1", pipeline=pipelined(batch, 1, r_int8)
                    ),
                    "kv": "int8",
                }
            )
        )
    return rows, off, {False: trips, True: trips_pipe}, ramp, situ, overlap


async def _naive_threads(model, batch: int, seq_len: int, cores: int, pipeline: bool) -> dict:
    """The same run with every process using all cores and spinning OpenMP waits."""
    os.environ["OMP_WAIT_POLICY"] = "active"
    torch.set_num_threads(cores)
    try:
        async with Graph(startup_timeout=120.0) as graph:
            urls = await start_r_workers(graph, 2, threads=cores)
            return await synthetic_step(graph, model, urls, batch, seq_len, "s-naive", pipeline=pipeline)
    finally:
        os.environ["OMP_WAIT_POLICY"] = "passive"
        torch.set_num_threads(1)
