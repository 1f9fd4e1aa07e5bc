"""Ask round-trip latency of the actor runtime: this process asks an `echo` node process over TCP on 127.0.0.1.

Used by `bench.transport` (which puts it beside the raw-socket round trip); also runnable alone:
`flock /tmp/aiollm-bench.lock python -m bench.transport_ask --iterations 5000`.
What is timed is the whole ask path: encode, send, the peer's receive callback, the handler (run
inline when the actor is idle), the reply frame, decode and the asker's future — a small message
(`Ping`) each way. `measure_ask_breakdown` says where those microseconds go: the CPU time each
process spends per round trip, the same ask with both nodes in one process (its code's cost with
warm caches and no sleeping), and the codec's share.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import uvloop

from aiollm.actors.codec import Codec
from aiollm.actors.echo import EchoActor, Ping, Pong
from aiollm.actors.messages import ASK, PROTOCOL_VERSION, Reply, Request
from aiollm.actors.node import Node, NodeConfig
from aiollm.graph import Graph

# Asks before timing starts (connection set-up, caches, allocator).
WARMUP = 500


def measure_ask_rtt(pinned: bool, iterations: int) -> dict:
    """p50/p99/mean ask round trip in microseconds between two OS processes over tcp.

    `pinned`: this process and the node process both run on one CPU (this process's affinity is
    set with os.sched_setaffinity before the node is started, which inherits it; restored after).
    Runs its own event loop (uvloop), so call it from synchronous code.
    """
    if iterations <= 0:
        raise ValueError(f"iterations must be > 0, got {iterations}")
    original = os.sched_getaffinity(0)
    if pinned:
        os.sched_setaffinity(0, {min(original)})
    try:
        times_ns, cpu_s = uvloop.run(_measure(iterations))
    finally:
        os.sched_setaffinity(0, original)
    times_us = times_ns / 1e3
    return {
        "p50_us": float(np.percentile(times_us, 50)),
        "p99_us": float(np.percentile(times_us, 99)),
        "mean_us": float(times_us.mean()),
        # CPU time (user + system) per round trip of the asking and of the answering process.
        "client_cpu_us": cpu_s[0] / iterations * 1e6,
        "server_cpu_us": cpu_s[1] / iterations * 1e6,
        "iterations": iterations,
        "pinned": pinned,
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(iterations: int) -> tuple[np.ndarray, tuple[float, float]]:
    async with Graph() as graph:
        node = await graph.start_node("echo", process=True)
        echo = graph.ref(node.actors["echo"])
        for seq in range(WARMUP):
            await echo.ask(Ping(seq))
        times = np.empty(iterations, dtype=np.int64)
        clock = time.perf_counter_ns
        pids = (os.getpid(), node.process.pid)
        cpu = [_cpu_seconds(pid) for pid in pids]
        for seq in range(iterations):
            start = clock()
            pong = await echo.ask(Ping(seq))
            times[seq] = clock() - start
        cpu = [_cpu_seconds(pid) - before for pid, before in zip(pids, cpu)]
        if pong != Pong(iterations - 1):
            raise RuntimeError(f"echo answered {pong!r}")
        return times, (cpu[0], cpu[1])


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
    parser.add_argument("--iterations", type=int, default=5000)
    args = parser.parse_args()
    for pinned in (False, True):
        print(json.dumps(measure_ask_rtt(pinned, args.iterations)))
    print(json.dumps(measure_ask_breakdown(args.iterations)))


if __name__ == "__main__":
    main()
