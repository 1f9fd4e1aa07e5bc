"""The performance table: the headline figures of the JSON each benchmark wrote, beside their targets.

    python -m bench table [--results bench/results] [--readme README.md]

Each benchmark writes its figures with `python -m bench NAME --json bench/results/NAME.json`; this reads those
files, prints a markdown table (benchmark, figure, value, target, whether it is met) under one line naming the
CPU and the date of the results, and with `--readme` rewrites the part of that file between the
`<!-- bench-table:start -->` and `<!-- bench-table:end -->` lines. A benchmark without a JSON file is listed
as "not run" in each of its rows; a figure its JSON lacks (a part not run) as "not measured". docs/benchmarks.md says what each
figure means.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

START = "<!-- bench-table:start -->"
END = "<!-- bench-table:end -->"
DEFAULT_RESULTS = Path("bench/results")


@dataclass(frozen=True)
class Target:
    """What a figure should reach: `op` is ">=", "<=" or "±" (within `tolerance` of `value`)."""

    op: str
    value: float
    tolerance: float = 0.0

    def met(self, x: float) -> bool:
        if self.op == ">=":
            return x >= self.value
        if self.op == "<=":
            return x <= self.value
        return abs(x - self.value) <= self.tolerance

    def text(self, unit: str = "") -> str:
        shown = f"{self.value:g} ± {self.tolerance:g}" if self.op == "±" else f"{self.op} {self.value:g}"
        return f"{shown} {unit}".strip()


@dataclass(frozen=True)
class Figure:
    """One headline figure: the JSON key a benchmark writes, what it measures, and its target if it has one."""

    bench: str
    key: str
    label: str
    target: Target | None = None
    unit: str = ""


FIGURES: tuple[Figure, ...] = (
    Figure("attention", "ratio_fp16_vs_read_bw", "fp16 KV read rate / the memory's read bandwidth", Target(">=", 0.9)),
    Figure("attention", "ratio_fp16_vs_sdpa_bf16", "fp16 kernel tokens/s / torch SDPA bf16", Target(">=", 2)),
    Figure("attention", "ratio_fp16_vs_sdpa_fp32", "fp16 kernel tokens/s / torch SDPA fp32", Target(">=", 3.5)),
    Figure("attention", "ratio_int8_vs_fp16", "int8 KV tokens/s / fp16 KV", Target(">=", 1.8)),
    Figure("attention", "ratio_int4_vs_fp16", "int4 KV tokens/s / fp16 KV"),
    Figure("kvalloc", "ratio_churned_vs_lifo", "attention over a churned pool: best-fit runs / LIFO list"),
    Figure("model", "ratio_decode_vs_transformers", "decode tokens/s / transformers, batch >= 8", Target(">=", 2)),
    Figure("fastdecode", "fastdecode_best_tokens_per_s", "best decode rate, S-worker + R-workers", unit="tokens/s"),
    Figure("fastdecode", "ratio_tokens_vs_transformers_best", "that rate / transformers' best", Target(">=", 3)),
    Figure(
        "fastdecode", "ratio_predicted_vs_measured_step", "sizing model's step / measured step", Target("±", 1, 0.15)
    ),
    Figure("fastdecode", "ratio_sls_max_step", "longest step, with / without the schedule", Target("<=", 0.7)),
    Figure("fastdecode", "ratio_sls_tokens", "tokens/s, with / without the schedule", Target(">=", 1.08)),
    Figure(
        "serve", "ratio_goodput_disagg_vs_colocated", "goodput, disaggregated / colocated, same cores", Target(">=", 2)
    ),
    Figure("planner", "search_seconds_4x8", "placement search, 4 x 8 GPUs", unit="s"),
    Figure("planner", "ratio_paper_opt13b_disagg_vs_colocated", "simulated goodput per GPU, OPT-13B: disagg / coloc"),
    Figure(
        "planner",
        "sim_vs_real_attainment_max_diff_points",
        "simulated vs real SLO attainment, worst rate",
        Target("<=", 2),
        unit="points",
    ),
    Figure("transport", "ratio_tcp_vs_raw_64MiB", "tcp transport / raw sockets, 64 MiB frames", Target(">=", 0.85)),
    Figure("transport", "ratio_ask_rtt_vs_raw", "actor ask round trip / raw socket round trip", Target("<=", 3)),
    Figure("transport", "ask_rtt_pinned_us", "actor ask round trip, both ends on one CPU", Target("<=", 40), unit="µs"),
    Figure("faults", "requests_lost", "requests lost while every role is killed in turn", Target("<=", 0)),
    Figure("faults", "outputs_identical_fraction", "outputs equal to the fault-free pass", Target(">=", 1)),
    Figure("faults", "goodput_under_faults_vs_fault_free", "goodput under faults / fault-free", Target(">=", 0.8)),
    Figure("cluster", "ratio_goodput_netns_vs_local", "goodput across namespaces / on 127.0.0.1", Target(">=", 0.9)),
    Figure(
        "cluster", "ratio_kv_pull_vs_raw_netns", "KV pull stream / raw socket, across namespaces", Target(">=", 0.8)
    ),
    Figure("cluster", "replan_seconds", "workload drift detected to the new instance serving", unit="s"),
    Figure("prefix", "ratio_ttft_p50_cache_vs_none", "multi-turn TTFT p50, prefix cache / none", Target("<=", 0.5)),
    Figure("peers", "ratio_tokens_vs_vllm_saturation_bf16", "tokens/s at saturation / vLLM CPU, bf16", Target(">=", 1)),
    Figure("peers", "ratio_tokens_vs_vllm_saturation_fp32", "tokens/s at saturation / vLLM CPU, fp32", Target(">=", 1)),
    Figure("peers", "ratio_ttft_p50_vs_vllm_rate1", "default serve TTFT p50 at 1 req/s / vLLM", Target("<=", 1)),
    Figure("peers", "ratio_tpot_p50_vs_vllm_rate4", "default serve TPOT p50 at 4 req/s / vLLM", Target("<=", 1)),
    Figure(
        "peers", "ratio_ttft_p50_vs_vllm_rate1_split", "the cores split (--no-take-turns): TTFT p50 at 1 req/s / vLLM"
    ),
    Figure(
        "peers", "ratio_tpot_p50_vs_vllm_rate4_split", "the cores split (--no-take-turns): TPOT p50 at 4 req/s / vLLM"
    ),
    Figure(
        "peers", "ratio_goodput_disagg_vs_vllm", "default serve goodput / vLLM (fp32, same SLOs)", Target(">=", 1.5)
    ),
    Figure("peers", "ratio_goodput_split_vs_vllm", "the cores split: goodput / vLLM (fp32, same SLOs)"),
    Figure(
        "peers", "ratio_tokens_vs_llamacpp_saturation", "tokens/s at saturation / llama.cpp server", Target(">=", 2)
    ),
)


@dataclass(frozen=True)
class Results:
    """What one benchmark's JSON held: its figures (None: no file), when and on which CPU it ran, any error."""

    bench: str
    figures: dict | None
    date: str = ""
    cpu: str = ""
    error: str = ""


def benches() -> list[str]:
    """The benchmarks with headline figures, in table order."""
    return list(dict.fromkeys(f.bench for f in FIGURES))


def read_results(results_dir: Path, bench: str) -> Results:
    """`results_dir/BENCH.json`; a missing file or directory gives figures None, an unreadable one an error."""
    path = Path(results_dir) / f"{bench}.json"
    if not path.is_file():
        return Results(bench, None)
    try:
        figures = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return Results(bench, None, error=f"unreadable JSON: {exc}")
    if not isinstance(figures, dict):
        return Results(bench, None, error="unreadable JSON: not an object")
    return Results(bench, figures, date=_date(figures, path), cpu=str(figures.get("cpu", "")))


def _date(figures: dict, path: Path) -> str:
    """The day the figures were taken: a `date` key, else the latest `finished_*` key, else the file's mtime."""
    stamps = [str(figures["date"])] if figures.get("date") else []
    stamps = stamps or sorted(str(v) for k, v in figures.items() if k.startswith("finished_") and v)
    if stamps:
        return stamps[-1][:10]
    return datetime.fromtimestamp(path.stat().st_mtime, UTC).strftime("%Y-%m-%d")


def this_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The model name of this machine's CPU, as /proc/cpuinfo gives it ("" if it cannot be read)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name":
                return " ".join(value.split())
    except OSError:
        pass
    return ""


def _fmt(value: object, unit: str = "") -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "n/a" if value is None else str(value)
    text = f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return f"{text} {unit}".strip()


def rows(results: dict[str, Results]) -> list[dict[str, str]]:
    """One row per headline figure, in table order; a benchmark without results shows "not run" in each."""
    out = []
    for fig in FIGURES:
        res = results[fig.bench]
        value, met = res.figures.get(fig.key) if res.figures else None, ""
        if res.figures is None:
            shown = "unreadable JSON" if res.error else "not run"
        elif fig.key not in res.figures:
            shown = "not measured"
        else:
            shown = _fmt(value, fig.unit)
            if fig.target and isinstance(value, int | float) and not isinstance(value, bool):
                met = "yes" if fig.target.met(value) else "no"
        target = fig.target.text(fig.unit) if fig.target else ""
        out.append(
            {"bench": fig.bench, "figure": f"`{fig.key}`: {fig.label}", "value": shown, "target": target, "met": met}
        )
    return out


def header(results: dict[str, Results], cpu: str) -> str:
    """The line above the table: the CPU the figures came from and the date (or range of dates) of the results."""
    ran = [r for r in results.values() if r.figures is not None]
    if not ran:
        return "No benchmark results yet: run `python -m bench NAME --json bench/results/NAME.json` for each one."
    cpus = sorted({r.cpu for r in ran if r.cpu}) or [cpu or "an unnamed CPU"]
    dates = sorted(r.date for r in ran)
    when = dates[0] if dates[0] == dates[-1] else f"{dates[0]} to {dates[-1]}"
    return f"Measured on {'; '.join(cpus)}, {when}."


def markdown(results: dict[str, Results], cpu: str) -> str:
    """The header line and the table, as markdown."""
    lines = [header(results, cpu), "", "| bench | figure | value | target | met |", "| --- | --- | ---: | --- | --- |"]
    shown = ""
    for r in rows(results):
        bench, shown = ("", shown) if r["bench"] == shown else (r["bench"], r["bench"])
        lines.append(f"| {bench} | {r['figure']} | {r['value']} | {r['target']} | {r['met']} |")
    return "\n".join(lines)


def build(results_dir: Path = DEFAULT_RESULTS, cpu: str | None = None) -> str:
    """The table for the JSON files under `results_dir` (which need not exist)."""
    results = {bench: read_results(results_dir, bench) for bench in benches()}
    return markdown(results, this_cpu() if cpu is None else cpu)


def rewrite_region(text: str, table: str) -> str:
    """`text` with the lines between the start and end markers replaced by `table` (ValueError without them)."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} region")
    return f"{text[: start + len(START)]}\n{table}\n{text[end:]}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="directory of the benchmarks' JSON")
    parser.add_argument("--readme", type=Path, help="rewrite this file's bench-table region with the table")


def main(args: argparse.Namespace) -> int:
    table = build(args.results)
    print(table)
    if args.readme is not None:
        try:
            args.readme.write_text(rewrite_region(args.readme.read_text(), table))
        except (OSError, ValueError) as exc:
            print(f"python -m bench table: {args.readme}: {exc}", file=sys.stderr)
            return 1
        print(f"rewrote the bench table in {args.readme}")
    return 0
