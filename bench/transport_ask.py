"""Ask round-trip latency of the actor runtime: this process asks an `echo` node process over TCP on 127.0.0.1.

Used by `bench.transport` (which puts it beside the raw-socket round trip); also runnable alone:
`flock /tmp/aiollm-bench.lock python -m bench.transport_ask --iterations 5000`.
What is timed is the whole ask path: encode, send, the peer's reader, mailbox, handler, the reply
frame, decode and the future — a small message (`Ping`) each way.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import uvloop

from aiollm.actors.echo import Ping, Pong
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
        times_ns = uvloop.run(_measure(iterations))
    finally:
        os.sched_setaffinity(0, original)
    times_us = times_ns / 1e3
    return {
        "p50_us": float(np.percentile(times_us, 50)),
        "p99_us": float(np.percentile(times_us, 99)),
        "mean_us": float(times_us.mean()),
        "iterations": iterations,
        "pinned": pinned,
    }


async def _measure(iterations: int) -> np.ndarray:
    async with Graph() as graph:
        node = await graph.start_node("echo", process=True)
        echo = graph.ref(node.actors["echo"])
        for seq in range(WARMUP):
            await echo.ask(Ping(seq))
        times = np.empty(iterations, dtype=np.int64)
        clock = time.perf_counter_ns
        for seq in range(iterations):
            start = clock()
            pong = await echo.ask(Ping(seq))
            times[seq] = clock() - start
        if pong != Pong(iterations - 1):
            raise RuntimeError(f"echo answered {pong!r}")
        return times


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.transport_ask", description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=5000)
    args = parser.parse_args()
    for pinned in (False, True):
        print(json.dumps(measure_ask_rtt(pinned, args.iterations)))


if __name__ == "__main__":
    main()
