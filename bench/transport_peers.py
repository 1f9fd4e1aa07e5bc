"""Both ends of each transport measured by `bench.transport`: raw sockets, our tcp/ucx, pyzmq.

Each kind has a `serve_KIND(plan, ready)` run in a child process and a `client_KIND(plan, address)`
run by the bench; both walk the same plan, so no control messages are needed:

- `("rtt", iterations)`: the client sends 8 bytes, the server echoes them; per-iteration times.
- `("tput", size, count)`: the client sends `count` messages of `size` bytes, the server receives
  each into one preallocated buffer (`fresh=True`: into new memory per message, where the kind
  allows it) and answers a 1-byte ack; the client's time from first send to ack.

Child entry point: `python -m bench.transport_peers KIND PLAN_JSON`; it prints its address.
"""
from __future__ import annotations

import asyncio
import json
import socket
import sys
import time

import numpy as np

# Round trips before timing starts (connection set-up, caches, allocator).
WARMUP = 200


def _rtt_stats(times_ns: np.ndarray) -> dict:
    us = times_ns / 1e3
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99))}


# -- raw blocking sockets: the practical limit ----------------------------------------------------

def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos, n = 0, len(view)
    while pos < n:
        got = sock.recv_into(view[pos:])
        if not got:
            raise ConnectionError("peer closed")
        pos += got


def serve_raw(plan: list, ready) -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    ready(f"tcp://127.0.0.1:{lsock.getsockname()[1]}")
    sock, _ = lsock.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    small = memoryview(bytearray(8))
    for step in plan:
        if step[0] == "rtt":
            for _ in range(WARMUP + step[1]):
                _recv_exact(sock, small)
                sock.sendall(small)
        else:
            _, size, count, _fresh = step
            buf = memoryview(np.empty(size, np.uint8))
            for _ in range(count):
                _recv_exact(sock, buf)
            sock.sendall(b"k")


def client_raw(plan: list, address: str) -> list:
    host, port = address.removeprefix("tcp://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    small, ack = memoryview(bytearray(8)), memoryview(bytearray(1))
    results = []
    for step in plan:
        if step[0] == "rtt":
            times = np.empty(step[1], np.int64)
            for i in range(WARMUP + step[1]):
                start = time.perf_counter_ns()
                sock.sendall(small)
                _recv_exact(sock, small)
                if i >= WARMUP:
                    times[i - WARMUP] = time.perf_counter_ns() - start
            results.append(_rtt_stats(times))
        else:
            _, size, count, _fresh = step
            payload = memoryview(np.ones(size, np.uint8))
            start = time.perf_counter()
            for _ in range(count):
                sock.sendall(payload)
            _recv_exact(sock, ack)
            results.append({"seconds": time.perf_counter() - start})
    sock.close()
    return results


# -- aiollm transports (tcp, ucx): the same code path as nodes use --------------------------------

def _config(progress: str | None):
    from aiollm.transports import TransportConfig

    return TransportConfig(options={"ucx.progress": progress} if progress else {})


async def _serve_aiollm(url: str, plan: list, ready, progress: str | None = None) -> None:
    from aiollm.errors import AiollmError
    from aiollm.transports import listen

    accepted: asyncio.Queue = asyncio.Queue()
    listener = await listen(url, accepted.put, _config(progress))
    ready(listener.address)
    conn = await accepted.get()
    for step in plan:
        if step[0] == "rtt":
            for _ in range(WARMUP + step[1]):
                frame = await conn.recv()
                await conn.send(frame.header)
        else:
            _, size, count, fresh = step
            dest = [memoryview(np.empty(size, np.uint8))]
            allocate = None if fresh else (lambda header, sizes: dest)
            for _ in range(count):
                await conn.recv(allocate)
            await conn.send(b"k")
    try:
        await conn.recv()  # the client closes when done
    except AiollmError:
        pass
    await conn.close()
    await listener.close()


async def _client_aiollm(plan: list, address: str, progress: str | None = None) -> list:
    from aiollm.transports import connect

    conn = await connect(address, _config(progress))
    small = b"12345678"
    results = []
    clock = time.perf_counter_ns
    for step in plan:
        if step[0] == "rtt":
            times = np.empty(step[1], np.int64)
            for i in range(WARMUP + step[1]):
                start = clock()
                await conn.send(small)
                await conn.recv()
                if i >= WARMUP:
                    times[i - WARMUP] = clock() - start
            results.append(_rtt_stats(times))
        else:
            _, size, count, _fresh = step
            payload = [np.ones(size, np.uint8)]
            start = time.perf_counter()
            for _ in range(count):
                await conn.send(b"", payload)
            await conn.recv()
            results.append({"seconds": time.perf_counter() - start})
    await conn.close()
    return results


def _run(coro):
    import uvloop

    return uvloop.run(coro)


def serve_tcp(plan: list, ready) -> None:
    _run(_serve_aiollm("tcp://127.0.0.1:0", plan, ready))


def client_tcp(plan: list, address: str) -> list:
    return _run(_client_aiollm(plan, address))


def serve_ucx(plan: list, ready) -> None:
    _run(_serve_aiollm("ucx://127.0.0.1:0", plan, ready))


def client_ucx(plan: list, address: str) -> list:
    return _run(_client_aiollm(plan, address))


def serve_ucx_polling(plan: list, ready) -> None:
    _run(_serve_aiollm("ucx://127.0.0.1:0", plan, ready, "polling"))


def client_ucx_polling(plan: list, address: str) -> list:
    return _run(_client_aiollm(plan, address, "polling"))


# -- pyzmq: a widely used messaging library, zero-copy sends ---------------------------------------

def serve_zmq(plan: list, ready) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ready(f"tcp://127.0.0.1:{port}")
    for step in plan:
        if step[0] == "rtt":
            for _ in range(WARMUP + step[1]):
                sock.send(sock.recv(copy=False), copy=False)
        else:
            for _ in range(step[2]):
                sock.recv(copy=False)
            sock.send(b"k")
    sock.recv()
    sock.close(linger=0)
    ctx.term()


def client_zmq(plan: list, address: str) -> list:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    results = []
    clock = time.perf_counter_ns
    for step in plan:
        if step[0] == "rtt":
            times = np.empty(step[1], np.int64)
            for i in range(WARMUP + step[1]):
                start = clock()
                sock.send(b"12345678")
                sock.recv(copy=False)
                if i >= WARMUP:
                    times[i - WARMUP] = clock() - start
            results.append(_rtt_stats(times))
        else:
            _, size, count, _fresh = step
            payload = np.ones(size, np.uint8)
            start = time.perf_counter()
            for _ in range(count):
                sock.send(payload, copy=False)
            sock.recv()
            results.append({"seconds": time.perf_counter() - start})
    sock.send(b"bye")
    sock.close(linger=1000)
    ctx.term()
    return results


SERVERS = {"raw": serve_raw, "tcp": serve_tcp, "ucx": serve_ucx, "ucx_polling": serve_ucx_polling, "zmq": serve_zmq}
CLIENTS = {"raw": client_raw, "tcp": client_tcp, "ucx": client_ucx, "ucx_polling": client_ucx_polling,
           "zmq": client_zmq}


def main(argv: list[str]) -> None:
    kind, plan = argv[0], json.loads(argv[1])
    SERVERS[kind](plan, lambda address: print(address, flush=True))


if __name__ == "__main__":
    main(sys.argv[1:])
