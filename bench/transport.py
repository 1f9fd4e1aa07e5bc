"""Transport round trips and throughput between two processes on 127.0.0.1, against raw sockets.

First table, one run per transport: raw blocking sockets with `recv_into` (the practical limit),
aiollm's tcp transport driven in push mode as nodes drive it (`Connection.deliver`; received into
preallocated memory through `allocate`, and into fresh arrays), aiollm's ucx transport where its
binding is installed, pyzmq, Ray (where installed). Throughput is one-way, best of `repeats` runs.

Second table, the actor-level ask against its limits (bench.transport_ask): raw sockets, the uvloop
floor (an 8-byte echo from protocol callbacks, one task wake-up), our tcp transport's push echo and
the ask, alternated in several rounds within one run (medians reported, so a drifting machine hits
all alike), with the CPU time per round trip of each process; the row-to-row differences are what
each layer costs. Round trips are reported unpinned, with the processes pinned to one CPU, and split
over two CPUs: on these VMs a wake-up across vCPUs is a large part of a small round trip, and unpinned
the scheduler decides per process pair whether there is one (raw sockets: ~9 vs ~20 µs).
Run it as `flock /tmp/aiollm-bench.lock python -m bench transport [--quick] [--json PATH]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
from pathlib import Path

from aiollm.report import table
from bench import transport_peers

MiB = 1024 * 1024
# (label, size in bytes, messages per run in the full and the quick setting)
SIZES = [("64KiB", 64 * 1024, 4096, 1024), ("1MiB", MiB, 256, 64), ("64MiB", 64 * MiB, 8, 3)]
# Environment of the measured processes: quiet UCX, and the UCX settings this bench documents.
UCX_ENV = {"UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_TLS": os.environ.get("UCX_TLS", "tcp,sm,cma")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a few seconds per row)")
    parser.add_argument("--iterations", type=int, help="round trips per RTT measurement (default 5000, quick 1000)")
    parser.add_argument("--repeats", type=int, help="throughput runs per size, best kept (default 3, quick 2)")
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds of raw/floor/push/ask round trips (default 7, quick 3)"
    )


def _plan(rtt_iterations: int, repeats: int, quick: bool, fresh: bool, with_throughput: bool) -> list:
    plan: list = [["rtt", rtt_iterations]]
    if with_throughput:
        for _label, size, full, short in SIZES:
            plan += [["tput", size, short if quick else full, fresh]] * repeats
    return plan


def _measure(kind: str, plan: list, pinned: bool) -> list:
    """Run the server side of `kind` in a child process and the client here; both pinned if asked."""
    original = os.sched_getaffinity(0)
    if pinned:
        os.sched_setaffinity(0, {min(original)})  # the child inherits it
    try:
        with transport_peers.peer_process(kind, plan, UCX_ENV) as (_proc, address):
            return transport_peers.client(kind, plan, address)
    finally:
        os.sched_setaffinity(0, original)


def _row(name: str, unpinned: list, pinned: list, plan: list) -> dict:
    row = {
        "transport": name,
        "rtt_p50_us": unpinned[0]["p50_us"],
        "rtt_p99_us": unpinned[0]["p99_us"],
        "rtt_pinned_p50_us": pinned[0]["p50_us"] if pinned else float("nan"),
    }
    for label, size, _full, _short in SIZES:
        runs = [r for step, r in zip(plan, unpinned) if step[0] == "tput" and step[1] == size]
        if runs:
            count = next(step[2] for step in plan if step[0] == "tput" and step[1] == size)
            row[f"GBps_{label}"] = size * count / min(r["seconds"] for r in runs) / 1e9
    return row


def run(args: argparse.Namespace) -> dict:
    quick = args.quick
    iterations = args.iterations or (1000 if quick else 5000)
    repeats = args.repeats or (2 if quick else 3)
    rtt_only = _plan(iterations, repeats, quick, False, False)
    kinds = [("raw", "raw", False), ("tcp", "tcp", False), ("tcp_fresh", "tcp", True), ("zmq", "zmq", False)]
    if importlib.util.find_spec("ucxx") is not None:
        kinds[3:3] = [
            ("ucxx_raw_polling", "ucxx_raw", False),
            ("ucx", "ucx", False),
            ("ucx_nospin", "ucx[spin_us=0]", False),
            ("ucx_polling", "ucx[progress=polling]", False),
        ]
    else:
        print("ucx: not installed (pip install 'aiollm[ucx]')")
    rows = []
    for name, kind, fresh in kinds:
        plan = _plan(iterations, repeats, quick, fresh, True)
        unpinned = _measure(kind, plan, pinned=False)
        # A spinning peer on the same CPU costs a scheduler slice per round trip: keep that run short.
        pinned_plan = (
            _plan(min(iterations, 200), repeats, quick, False, False)
            if "polling" in name or "spin" in name
            else rtt_only
        )
        pinned = [] if fresh else _measure(kind, pinned_plan, pinned=True)
        rows.append(_row(name, unpinned, pinned, plan))
        print(f"measured {name}", flush=True)
    if importlib.util.find_spec("ray") is None:
        print("ray: not installed")
    if importlib.util.find_spec("libucx") is not None:
        rows += [_ucx_perftest(tls, quick) for tls in ("sm", "tcp")]
    figures = {"rows": rows, "rtt_iterations": iterations, "quick": quick, "ucx_tls": UCX_ENV["UCX_TLS"]}
    by_name = {row["transport"]: row for row in rows}
    for row in rows:
        for key, value in row.items():
            if key != "transport":
                figures[f"{row['transport']}_{key}"] = value
    for label, *_ in SIZES:
        figures[f"ratio_tcp_vs_raw_{label}"] = by_name["tcp"][f"GBps_{label}"] / by_name["raw"][f"GBps_{label}"]
        if "ucx" in by_name:
            figures[f"ratio_ucx_vs_tcp_{label}"] = by_name["ucx"][f"GBps_{label}"] / by_name["tcp"][f"GBps_{label}"]
            # Why ucx can trail tcp: the binding alone (busy polling, no asyncio) against tcp, and our layer against it.
            ucxx = by_name["ucxx_raw_polling"][f"GBps_{label}"]
            figures[f"ratio_ucxx_raw_vs_tcp_{label}"] = ucxx / by_name["tcp"][f"GBps_{label}"]
            figures[f"ratio_ucx_vs_ucxx_raw_{label}"] = by_name["ucx"][f"GBps_{label}"] / ucxx
    rtt_rows = _add_ask(figures, quick, args.rounds)
    print(table(rows))
    print(table(rtt_rows))
    return figures


def _ucx_perftest(tls: str, quick: bool) -> dict:
    """UCX's own tag bandwidth, from the `ucx_perftest` the wheel ships, in loopback mode (one process).

    Loopback because the two-process mode's rendezvous socket binds the wildcard address, and this
    project binds 127.0.0.1 only; one process also has no cross-process wake-ups, so it is an upper bound.
    """
    root = Path(importlib.util.find_spec("libucx").submodule_search_locations[0])
    env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_TLS": tls, "LD_LIBRARY_PATH": str(root / "lib")}
    row = {"transport": f"ucx_perftest_loopback_{tls}"}
    for label, size, full, short in SIZES:
        iterations = short if quick else full
        out = subprocess.run(
            [
                str(root / "bin" / "ucx_perftest"),
                "-l",
                "-t",
                "tag_bw",
                "-s",
                str(size),
                "-n",
                str(iterations),
                "-w",
                str(max(2, iterations // 10)),
                "-f",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        numbers = [line.split() for line in out.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
        if out.returncode or not numbers:
            print(f"ucx_perftest {tls} {label}: failed ({out.stderr.strip()[-200:]})")
            continue
        row[f"GBps_{label}"] = float(numbers[-1][5]) * MiB / 1e9  # overall bandwidth, reported in MiB/s
    return row


def _add_ask(figures: dict, quick: bool, rounds: int | None) -> list[dict]:
    """The actor-level ask beside raw sockets, measured interleaved by the actor runtime's bench module.

    Returns the table rows: per kind of round trip (raw, uvloop floor, tcp push echo, ask) the
    median over rounds of p50 and p99 unpinned, pinned (every process on one CPU) and split (client
    and servers on two CPUs: every round trip crosses vCPUs), and the CPU time per round trip of each
    process; the differences between rows are what each layer adds. Unpinned, the scheduler decides
    whether a round trip crosses vCPUs, which alone moves raw sockets between ~9 and ~20 µs on a small VM.
    """
    try:
        from bench.transport_ask import (
            KINDS,
            measure_ask_breakdown,
            measure_interleaved,
        )
    except ModuleNotFoundError as exc:
        if exc.name != "bench.transport_ask":
            raise
        print("ask: bench.transport_ask not present")
        return []
    rounds = rounds or (3 if quick else 7)
    iterations = 1000 if quick else 2000
    unpinned = measure_interleaved("unpinned", rounds, iterations)
    pinned = measure_interleaved("pinned", rounds, iterations)
    split = measure_interleaved("split", rounds, iterations)
    raw, raw_pinned, raw_split = unpinned["raw"]["p50_us"], pinned["raw"]["p50_us"], split["raw"]["p50_us"]
    rows = []
    for kind in KINDS:
        u, p, x = unpinned[kind], pinned[kind], split[kind]
        rows.append(
            {
                "round trip": kind,
                "p50_us": u["p50_us"],
                "p99_us": u["p99_us"],
                "x_raw": u["p50_us"] / raw,
                "cpu_us_client": u["client_cpu_us"],
                "cpu_us_server": u["server_cpu_us"],
                "pinned_p50_us": p["p50_us"],
                "pinned_x_raw": p["p50_us"] / raw_pinned,
                "pinned_cpu_us": p["client_cpu_us"] + p["server_cpu_us"],
                "split_p50_us": x["p50_us"],
                "split_x_raw": x["p50_us"] / raw_split,
            }
        )
        figures[f"interleaved_{kind}_rtt_p50_us"] = u["p50_us"]
        figures[f"interleaved_{kind}_rtt_pinned_us"] = p["p50_us"]
        figures[f"interleaved_{kind}_rtt_split_us"] = x["p50_us"]
    ask, ask_pinned = unpinned["ask"], pinned["ask"]
    figures.update(
        {
            "rtt_rounds": rounds,
            "rtt_round_iterations": iterations,
            "ask_rtt_p50_us": ask["p50_us"],
            "ask_rtt_p99_us": ask["p99_us"],
            "ask_rtt_pinned_us": ask_pinned["p50_us"],
            "ask_client_cpu_us": ask["client_cpu_us"],
            "ask_server_cpu_us": ask["server_cpu_us"],
            "ask_pinned_client_cpu_us": ask_pinned["client_cpu_us"],
            "ask_pinned_server_cpu_us": ask_pinned["server_cpu_us"],
            "uvloop_floor_rtt_p50_us": unpinned["uvloop_floor"]["p50_us"],
            "uvloop_floor_rtt_pinned_us": pinned["uvloop_floor"]["p50_us"],
            "ratio_ask_rtt_vs_raw": ask["p50_us"] / raw,
            "ratio_ask_rtt_vs_raw_pinned": ask_pinned["p50_us"] / raw_pinned,
            "ratio_ask_rtt_vs_raw_split": split["ask"]["p50_us"] / raw_split,
            "ratio_uvloop_floor_vs_raw": unpinned["uvloop_floor"]["p50_us"] / raw,
            "ratio_tcp_push_vs_raw": unpinned["tcp_push"]["p50_us"] / raw,
            "ask_vs_raw_per_round": unpinned["ask_vs_raw_per_round"],
            "ask_vs_raw_per_round_pinned": pinned["ask_vs_raw_per_round"],
            "ask_vs_raw_per_round_split": split["ask_vs_raw_per_round"],
        }
    )
    breakdown = measure_ask_breakdown(iterations)
    figures.update({"ask_one_process_us": breakdown["one_process_us"], "ask_codec_us": breakdown["codec_us"]})
    floor, push = unpinned["uvloop_floor"]["p50_us"], unpinned["tcp_push"]["p50_us"]
    print(
        f"ask round trip, unpinned, medians of {rounds} interleaved rounds: {ask['p50_us']:.1f} us = raw socket "
        f"{raw:.1f} + event loop {floor - raw:+.1f} (uvloop floor: echo from the receive callback, one task "
        f"wake-up) + framing {push - floor:+.1f} (tcp push echo) + actor runtime {ask['p50_us'] - push:+.1f}; "
        f"{ask['p50_us'] / raw:.2f}x raw (per round: {unpinned['ask_vs_raw_per_round']}); the floor alone is "
        f"{floor / raw:.2f}x raw; split over two CPUs {split['ask']['p50_us']:.1f} us vs raw {raw_split:.1f} "
        f"({split['ask']['p50_us'] / raw_split:.2f}x), pinned {ask_pinned['p50_us']:.1f} vs {raw_pinned:.1f} "
        f"({ask_pinned['p50_us'] / raw_pinned:.2f}x). CPU per ask {ask['client_cpu_us']:.1f} us asking + {ask['server_cpu_us']:.1f} us "
        f"answering (floor {unpinned['uvloop_floor']['client_cpu_us']:.1f} + "
        f"{unpinned['uvloop_floor']['server_cpu_us']:.1f}); the same ask in one process "
        f"{breakdown['one_process_us']:.1f} us (codec {breakdown['codec_us']:.1f} us of it)"
    )
    return rows
