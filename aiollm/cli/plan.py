"""`python -m aiollm.plan distserve|fastdecode|profile ...`: placement plans, FastDecode sizing, and
this machine's latency profile.

    python -m aiollm.plan distserve --model opt-13b --cluster 1x4xA100-80G --workload sharegpt \\
        --ttft 0.2 --tpot 0.1 --attainment 0.9 [--rate R] [--affinity high|low|colocated] [--json PATH]
    python -m aiollm.plan fastdecode --model smollm2 --seq-len 1024 [--latency-target 0.05]
    python -m aiollm.plan profile [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from aiollm.heap import keep_freed_memory
from aiollm.kv.pool import KV_DTYPES
from aiollm.planner.datasets import DATASETS, load_lengths
from aiollm.planner.goodput import SLO
from aiollm.planner.hardware import parse_cluster
from aiollm.planner.latency import LatencyModel
from aiollm.planner.models import get_model
from aiollm.planner.placement import AFFINITIES, PlacementConfig, Planner
from aiollm.planner.profiles import latency_model
from aiollm.planner.workload import Workload


def build_placement(args: argparse.Namespace) -> tuple[PlacementConfig, Workload]:
    """Parse the distserve sub-command's flags into a PlacementConfig and a workload sample."""
    model = get_model(args.model)
    cluster = parse_cluster(args.cluster)
    latency = latency_model(model.name, cluster.gpu.name, args.profile)
    colocated = _colocated_latency(model.name, cluster.gpu.name, args.profile, latency)
    lengths = load_lengths(args.workload, model.name)
    workload = Workload.build(lengths, args.requests, args.seed, args.arrival, args.burstiness)
    slo = SLO(args.ttft, args.tpot, args.attainment, args.slo_mode)
    config = PlacementConfig(
        model,
        cluster,
        latency,
        slo,
        args.affinity,
        args.rate,
        rel_tol=args.rel_tol,
        colocated_latency=colocated,
        max_pp=args.max_pp,
        workers=args.workers,
    )
    return config, workload


def _colocated_latency(model: str, gpu: str, profile: str, latency: LatencyModel) -> LatencyModel | None:
    """On DistServe's own profile, colocated instances use its vLLM profile (as DistServe compares)."""
    if not latency.source.startswith("DistServe"):
        return None
    return latency_model(model, gpu, "vllm" if profile in ("auto", "distserve") else profile)


def cmd_distserve(args: argparse.Namespace) -> int:
    config, workload = build_placement(args)
    print(f"workload: {json.dumps(workload.lengths.summary())}")
    plan = Planner(config, workload).plan()
    print(plan.describe())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(plan.to_json(), indent=2))
        print(f"wrote {args.json}")
    if args.emit:
        from aiollm.deploy.from_plan import plan_header, spec_from_plan
        from aiollm.deploy.spec import ClusterSpec

        base = ClusterSpec.from_toml(args.base) if args.base else ClusterSpec()
        if args.serve_model:
            base = base.override({"model.name": args.serve_model})
        spec = spec_from_plan(plan, base)
        if args.budget and plan.prefill is not None:
            spec = _with_r_workers(spec, plan, workload, args)
        if args.memory_per_process:
            spec = _within_memory(spec, args.memory_per_process)
        args.emit.parent.mkdir(parents=True, exist_ok=True)
        args.emit.write_text(plan_header(plan) + spec.to_toml())
        print(f"wrote {args.emit} ({spec.describe()}): python -m aiollm serve --config {args.emit}")
    return 0 if plan.fits else 1


def _within_memory(spec, memory: str):
    """The spec with every prefill and decode instance's `memory` set to `memory`; ValueError when an instance
    cannot hold the served model's weights and its KV blocks in it (or an R-worker one block in its kv_memory)."""
    from aiollm.deploy.memory import check_memory
    from aiollm.deploy.spec import SpecError

    try:
        spec = spec.override({"prefill.memory": memory, "decode.memory": memory})
        check_memory(spec)
    except SpecError as exc:
        raise ValueError(f"--memory-per-process {memory}: the planned instances do not fit: {exc}") from None
    return spec


def _with_r_workers(spec, plan, workload, args):
    """The spec with FastDecode's R-workers behind each decode instance, the whole fitted to --budget processes."""
    from aiollm.planner.fastdecode import read_t_of_b
    from aiollm.planner.joint import plan_joint

    if not args.t_of_b or not args.r_per_token:
        raise ValueError("--budget needs --t-of-b (bench model JSON) and --r-per-token to size the R-workers")
    lengths = workload.lengths
    seq_len = int(lengths.prompt.mean() + lengths.output.mean())
    joint = plan_joint(
        plan.prefill.count,
        plan.decode.count,
        args.budget,
        read_t_of_b(args.t_of_b, args.t_of_b_key),
        args.r_per_token,
        seq_len,
        args.tpot,
    )
    print(joint.explain())
    return spec.override(
        {"prefill.count": joint.prefill, "decode.count": joint.decode, "decode.r_workers": joint.r_workers}
    )


def cmd_fastdecode(args: argparse.Namespace) -> int:
    # libgomp reads OMP_WAIT_POLICY once, when torch loads (below): passive, as `bench fastdecode` measures, so that
    # OpenMP threads sleep instead of spinning through the waits for an R-worker; the R-workers started for the
    # probes inherit it
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    from aiollm.calibrate.fastdecode_probes import measure_costs, measure_effective_cores, measure_r, measure_t_of_b
    from aiollm.model.loader import load_config
    from aiollm.planner.fastdecode import AskCost, Overlap, read_t_of_b, size

    get_model(args.model)
    t_of_b = read_t_of_b(args.t_of_b, args.t_of_b_key) if args.t_of_b else measure_t_of_b(args.model, args.batches)
    r = args.r_per_token if args.r_per_token else measure_r(args.model, args.seq_len)
    s_per_token = overlap = None
    if args.round_trip:
        round_trip = {
            1: {int(b): AskCost.even(float(ms) / 1e3) for b, ms in (i.split(":") for i in args.round_trip.split(","))}
        }
        if args.overlap_loss is not None:
            overlap = {1: Overlap(args.overlap_loss, 0, 0, 1, 0.0, 0.0, 0.0, 0.0)}
    else:
        round_trip, r_situ, streamed, measured = measure_costs(
            args.model, [8, 32, 128], t_of_b, r, seq_len=args.seq_len
        )
        s_per_token = {1: streamed}  # measured with the most R-workers, applied to every P
        overlap = {1: measured}  # measured with one R-worker (balanced there), applied to every P
        r = args.r_per_token or r_situ
    cores = args.cores or len(os.sched_getaffinity(0))
    if not args.cores and not args.round_trip:  # measuring: the cores this run really gets (others' load lowers it)
        cores = measure_effective_cores(cores)
        print(f"effective cores: {cores:.2f} of {len(os.sched_getaffinity(0))} (median of 3 paired rounds)")
    result = size(
        t_of_b,
        r,
        args.seq_len,
        args.latency_target,
        round_trip=round_trip,
        n_layers=load_config(args.model).n_layers,
        cores=cores,
        s_per_token=s_per_token,
        overlap=overlap,
    )
    print(result.explain())
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=2))
        print(f"wrote {args.json}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from aiollm.calibrate.profile import measure_profile

    path = measure_profile(
        args.model, args.out, quick=args.quick, dtype=args.dtype, kv_dtype=args.kv_dtype, threads=args.threads
    )
    entry = next(iter(json.loads(path.read_text())["models"].values()))
    print(
        f"prefill (a, b, c) = {entry['prefill']}, decode (d, e, f) = {entry['decode']} (seconds); largest fit "
        f"error over the measured points: prefill {entry['max_relative_error']['prefill'] * 100:.0f} %, "
        f"decode {entry['max_relative_error']['decode'] * 100:.0f} %"
    )
    print(f"wrote {path}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m aiollm.plan", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("distserve", help="plan prefill/decode instances for a model, cluster, workload and SLO")
    d.add_argument("--model", required=True, help="opt-13b, opt-66b, opt-175b, llama-2-7b/13b/70b, smollm2")
    d.add_argument("--cluster", required=True, help="NODESxGPUSxGPU[@Ngbps], GPU one of A100-80G, H100-80G, H200")
    d.add_argument("--workload", default="sharegpt", help=f"one of {', '.join(DATASETS)}")
    d.add_argument("--ttft", type=float, required=True, help="TTFT SLO, seconds")
    d.add_argument("--tpot", type=float, required=True, help="TPOT SLO, seconds")
    d.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLOs")
    d.add_argument(
        "--slo-mode",
        choices=("joint", "separate"),
        default="joint",
        help="joint: a request must meet both SLOs; separate: P(attainment) of TTFT and TPOT each "
        "(DistServe's simulator script)",
    )
    d.add_argument("--rate", type=float, help="target request rate to size replicas for (req/s)")
    d.add_argument(
        "--affinity",
        choices=AFFINITIES,
        default="low",
        help="high: Algorithm 1; low: Algorithm 2; colocated: the vLLM-like baseline",
    )
    d.add_argument(
        "--profile",
        default="auto",
        help="auto|distserve|vllm|derived|local or a path (DistServe profile dir or aiollm profile JSON)",
    )
    d.add_argument("--requests", type=int, default=300, help="requests in the simulated sample")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--arrival", choices=("poisson", "gamma"), default="poisson")
    d.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    d.add_argument("--rel-tol", type=float, default=0.03, help="goodput search precision (relative)")
    d.add_argument("--max-pp", type=int, help="largest pipeline degree to search")
    d.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="processes for the search")
    d.add_argument("--json", type=Path, help="write the plan as JSON here")
    d.add_argument("--emit", type=Path, metavar="TOML", help="write the plan as a cluster spec for `serve --config`")
    d.add_argument("--base", type=Path, metavar="TOML", help="with --emit: the spec the plan's counts go into")
    d.add_argument(
        "--serve-model", metavar="NAME", help="with --emit: the model the spec serves (default: --base's, else smollm2)"
    )
    d.add_argument(
        "--budget",
        type=int,
        metavar="N",
        help="with --emit: processes the cluster may run (prefill + decode instances + R-workers): FastDecode's "
        "R-workers per decode instance are sized within it (needs --t-of-b and --r-per-token)",
    )
    d.add_argument(
        "--memory-per-process",
        metavar="SIZE",
        help="with --emit: the memory of each prefill and decode instance, e.g. 8GiB, written as their `memory`; "
        "a plan whose instances cannot hold the served model's weights and KV blocks in it is refused",
    )
    d.add_argument("--t-of-b", type=Path, help="with --budget: bench model JSON holding the decode step time T(B)")
    d.add_argument("--t-of-b-key", default="t_of_b", help="key in that JSON (t_of_b: fp32, t_of_b_bf16: bf16)")
    d.add_argument("--r-per-token", type=float, help="with --budget: attention seconds per context token")
    d.set_defaults(func=cmd_distserve)

    f = sub.add_parser("fastdecode", help="FastDecode sizing: batch B and R-worker count P")
    f.add_argument("--model", default="smollm2")
    f.add_argument("--seq-len", type=int, required=True, help="context length S per sequence")
    f.add_argument("--latency-target", type=float, help="largest acceptable S-part step time T(B), seconds")
    f.add_argument(
        "--t-of-b", type=Path, help="JSON from `python -m bench model --json` (key t_of_b) instead of measuring"
    )
    f.add_argument("--t-of-b-key", default="t_of_b", help="key in that JSON (t_of_b is fp32, t_of_b_bf16 bf16)")
    f.add_argument(
        "--r-per-token",
        type=float,
        help="R: seconds of attention per context token on one R-worker (instead of measuring with aiollm.kv)",
    )
    f.add_argument("--batches", default="1,4,16,64,256", help="batch sizes to measure T(B) at")
    f.add_argument(
        "--round-trip",
        help="C(b): a step's per-layer cost per Attend ask of b rows, ms, as ROWS:MS,... "
        "(instead of measuring it in real steps with 1 and 2 R-worker processes)",
    )
    f.add_argument(
        "--cores",
        type=float,
        help="cores the S-worker and R-workers share (default: measured, see "
        "measure_effective_cores; with --round-trip this machine's count)",
    )
    f.add_argument(
        "--overlap-loss",
        type=float,
        help="with --round-trip: the pipeline's overlap loss, the idle a "
        "pipelined step adds as a fraction of its lesser side (0..1; "
        "measured by a balanced probe otherwise)",
    )
    f.add_argument("--json", type=Path)
    f.set_defaults(func=cmd_fastdecode)

    m = sub.add_parser("profile", help="measure this machine's prefill/decode step times and fit the latency model")
    m.add_argument("--model", default="smollm2")
    m.add_argument("--out", type=Path, help="profile JSON (default ~/.cache/aiollm/latency-profile-local.json)")
    m.add_argument("--quick", action="store_true", help="fewer, smaller points")
    m.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="weights (serving default fp32)")
    m.add_argument("--kv-dtype", default="fp32", choices=KV_DTYPES, help="KV cache storage")
    m.add_argument("--threads", type=int, default=1, help="threads, as one serving instance uses")
    m.set_defaults(func=cmd_profile)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    keep_freed_memory()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
