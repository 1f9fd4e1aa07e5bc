"""Ask round-trip latency of the actor runtime: this process asks an `echo` node process over TCP on 127.0.0.1.

Used by `bench.transport`; also runnable alone:
`flock /tmp/aiollm-bench.lock python -m bench.transport_ask --rounds 5 --iterations 2000`.
What is timed is the whole ask path: encode, send, the peer's receive callback, the handler (run
inline when the actor is idle), the reply frame, decode and the asker's future — a small message
(`Ping`) each way. `measure_interleaved` puts it beside raw sockets, the uvloop floor and our tcp
transport's push echo, alternated round by round in one run, with the CPU time each process spends
per round trip; `measure_ask_breakdown` adds the same ask with both nodes in one process (its code's
cost with warm caches and no sleeping) and the codec's share.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import numpy as np
import uvloop

from aiollm.actors.codec import Codec
from aiollm.actors.echo import EchoActor, Ping, Pong
from aiollm.actors.messages import ASK, PROTOCOL_VERSION, Reply, Request
from aiollm.actors.node import Node, NodeConfig
from aiollm.deploy.graph import Graph
from bench import transport_peers

# Untimed round trips at the start of every round (as transport_peers does for every kind).
WARMUP = transport_peers.WARMUP


# The round trips alternated by `measure_interleaved`, in their first round's order: raw blocking sockets
# (the limit), the uvloop floor (8-byte echo from protocol callbacks), our tcp transport in push mode
# (framing, no actors), and the actor ask.
KINDS = ("raw", "uvloop_floor", "tcp_push", "ask")


# Where `measure_interleaved` runs the processes: wherever the scheduler puts them, all on one CPU, or
# this process on one CPU and every server on another (every round trip then crosses vCPUs).
PLACEMENTS = ("unpinned", "pinned", "split")


def measure_interleaved(placement: str, rounds: int, iterations: int) -> dict:
    """Round trips of every kind in KINDS, alternated in `rounds` rounds (the order rotates each round).

    Every kind runs between this process and a server process on 127.0.0.1 with TCP_NODELAY on both
    ends; the server processes and the echo node are started once and stay up, so a drift of the
    machine (another tenant, CPU frequency) hits every kind alike. Per kind: the median over rounds of
    each round's p50 and p99, and the CPU time (user + system, from /proc/PID/schedstat, in ns) that
    this process and the server process spent per round trip. `placement`: one of PLACEMENTS
    (unpinned, the scheduler may or may not put the two ends of a round trip on one vCPU; that
    choice alone moves raw sockets between ~9 and ~20 µs on a small VM). Runs its own event loop (uvloop),
    so call it from synchronous code.
    """
    if rounds <= 0 or iterations <= 0:
        raise ValueError(f"rounds and iterations must be > 0, got {rounds} and {iterations}")
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    original = os.sched_getaffinity(0)
    cpus = sorted(original)
    mine = None
    if placement == "pinned":
        os.sched_setaffinity(0, {cpus[0]})  # inherited by every server process started below
    elif placement == "split":
        if len(cpus) < 2:
            raise ValueError("placement 'split' needs two CPUs")
        os.sched_setaffinity(0, {cpus[1]})  # the servers' CPU; this process moves to cpus[0] once they run
        mine = {cpus[0]}
    plan = [["rtt", iterations]] * rounds
    try:
        with contextlib.ExitStack() as stack:
            servers = {
                kind: stack.enter_context(transport_peers.peer_process(kind, plan))
                for kind in ("raw", "uvloop_floor", "tcp")
            }
            per_round = uvloop.run(_interleaved(servers, rounds, iterations, mine))
    finally:
        os.sched_setaffinity(0, original)
    figures: dict = {"placement": placement, "rounds": rounds, "iterations": iterations}
    for kind in KINDS:
        runs = per_round[kind]
        figures[kind] = {key: float(np.median([run[key] for run in runs])) for key in runs[0]}
        figures[kind]["round_p50_us"] = [round(run["p50_us"], 2) for run in runs]
    figures["ask_vs_raw_per_round"] = [
        round(a["p50_us"] / r["p50_us"], 2) for a, r in zip(per_round["ask"], per_round["raw"])
    ]
    return figures


async def _interleaved(servers: dict, rounds: int, iterations: int, mine: set[int] | None) -> dict[str, list[dict]]:
    async with Graph() as graph:
        node = await graph.start_node("echo", process=True)
        if mine is not None:
            os.sched_setaffinity(0, mine)
        echo = graph.ref(node.actors["echo"])
        sock = transport_peers.connect_raw(servers["raw"][1])
        floor = await transport_peers.FloorClient.connect(servers["uvloop_floor"][1])
        push = await transport_peers.PushClient.connect(servers["tcp"][1], {})

        async def raw_round() -> np.ndarray:
            return transport_peers.raw_round(sock, iterations)  # blocking; nothing else needs the loop meanwhile

        runners = {
            "raw": (raw_round, servers["raw"][0].pid),
            "uvloop_floor": (lambda: floor.rtt_round(iterations), servers["uvloop_floor"][0].pid),
            "tcp_push": (lambda: push.rtt_round(iterations), servers["tcp"][0].pid),
            "ask": (lambda: _ask_round(echo, iterations), node.process.pid),
        }
        results: dict[str, list[dict]] = {kind: [] for kind in KINDS}
        me = os.getpid()
        for r in range(rounds):
            for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
                run, pid = runners[kind]
                cpu = _cpu_ns(me), _cpu_ns(pid)
                times_us = await run() / 1e3
                trips = WARMUP + iterations  # every round starts with WARMUP untimed round trips
                results[kind].append(
                    {
                        "p50_us": float(np.percentile(times_us, 50)),
                        "p99_us": float(np.percentile(times_us, 99)),
                        "client_cpu_us": (_cpu_ns(me) - cpu[0]) / trips / 1e3,
                        "server_cpu_us": (_cpu_ns(pid) - cpu[1]) / trips / 1e3,
                    }
                )
        sock.close()
        floor.transport.close()
        await push.conn.close()
        return results


async def _ask_round(echo, iterations: int) -> np.ndarray:
    """WARMUP untimed asks, then `iterations` timed ones (ns), a small message (`Ping`) each way."""
    ask = echo.ask
    for seq in range(WARMUP):
        await ask(Ping(seq))
    times = np.empty(iterations, dtype=np.int64)
    clock = time.perf_counter_ns
    for seq in range(iterations):
        start = clock()
        pong = await ask(Ping(seq))
        times[seq] = clock() - start
    if pong != Pong(iterations - 1):
        raise RuntimeError(f"echo answered {pong!r}")
    return times


def _cpu_ns(pid: int) -> int:
    """CPU time (user + system) of every thread of a process so far, in ns (/proc/PID/task/*/schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # a thread that just ended
            pass
    return total


def measure_ask_breakdown(iterations: int) -> dict:
    """Where an ask's microseconds go, measured in this process (call from synchronous code).

    `one_process_us`: an ask between two nodes of this process over tcp on 127.0.0.1, best of 3 runs:
    the code of both sides (and the kernel's loopback send) with warm caches and no process ever
    asleep. `codec_us`: encoding and decoding the request and the reply envelopes (4 steps).
    """
    return {"one_process_us": uvloop.run(_one_process(iterations)), "codec_us": _codec_cost(iterations)}


async def _one_process(iterations: int) -> float:
    config = NodeConfig(secret=os.urandom(32))
    asking, answering = Node(config), Node(config)
    await asking.start(["tcp://127.0.0.1:0"])
    await answering.start(["tcp://127.0.0.1:0"])
    try:
        await answering.spawn(EchoActor, "echo")
        echo = asking.ref(f"{answering.url}/echo")
        for seq in range(WARMUP):
            await echo.ask(Ping(seq))
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter_ns()
            for seq in range(iterations):
                await echo.ask(Ping(seq))
            best = min(best, (time.perf_counter_ns() - start) / iterations / 1e3)
        return best
    finally:
        await asking.stop()
        await answering.stop()


def _codec_cost(iterations: int) -> float:
    codec = Codec(lambda url: None)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter_ns()
        for seq in range(iterations):
            header, _ = codec.encode(Request(PROTOCOL_VERSION, seq + 1, ASK, "echo", 0, Ping(seq)))
            env = codec.decode_envelope(header)
            codec.decode_body(env.body, ())
            header, _ = codec.encode(Reply(PROTOCOL_VERSION, env.id, Pong(seq)))
            codec.decode_body(codec.decode_envelope(header).body, ())
        best = min(best, (time.perf_counter_ns() - start) / iterations / 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.transport_ask", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        action="append",
        help="where the processes run (repeatable; default: all three)",
    )
    args = parser.parse_args()
    for placement in args.placement or PLACEMENTS:
        print(json.dumps(measure_interleaved(placement, args.rounds, args.iterations)))
    print(json.dumps(measure_ask_breakdown(args.iterations)))


if __name__ == "__main__":
    main()
