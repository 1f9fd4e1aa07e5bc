"""Both ends of each transport measured by `bench.transport`: raw sockets, our tcp/ucx, ucxx alone, pyzmq,
and the floor of an awaited request on uvloop (protocol callbacks only, one task wake-up per round trip).

`serve(kind, plan, ready)` runs in a child process and `client(kind, plan, address)` in the bench;
both walk the same plan, so no control messages are needed:

- `("rtt", iterations)`: the client sends 8 bytes, the server echoes them; per-iteration times.
- `("tput", size, count)`: the client sends `count` messages of `size` bytes, the server receives
  each into one preallocated buffer (`fresh=True`: into new memory per message, where the kind
  allows it) and answers a 1-byte ack; the client's time from first send to ack.

Our transports (tcp, ucx) are driven as nodes drive them: in push mode (`Connection.deliver`, frames
handed over from the receive callback), answering with `send_nowait` where the transport takes the
frame at once. The clients of the round-trip kinds also run plan steps one at a time on one
connection (`connect_raw`/`raw_round`, `FloorClient`, `PushClient`), so `bench.transport_ask` can
alternate them with asks in one run.

Child entry point: `python -m bench.transport_peers KIND PLAN_JSON`; it prints its address.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

# Round trips before timing starts (connection set-up, caches, allocator).
WARMUP = 200
ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def peer_process(kind: str, plan: list, env: dict | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """Run `serve(kind, plan)` in a child process (inheriting this process's CPU affinity): (process, address).

    Waits for the child to finish its plan on leaving; kills it if it is still there after that.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.transport_peers", kind, json.dumps(plan)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        address = proc.stdout.readline().strip()
        if not address:
            raise RuntimeError(f"{kind} peer failed to start (exit code {proc.wait()})")
        yield proc, address
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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


def connect_raw(address: str) -> socket.socket:
    """A blocking client socket to `serve_raw`, with TCP_NODELAY like every other kind."""
    host, port = address.removeprefix("tcp://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def raw_round(sock: socket.socket, iterations: int) -> np.ndarray:
    """One `rtt` step against `serve_raw`: WARMUP untimed, then `iterations` timed 8-byte round trips (ns)."""
    small = memoryview(bytearray(8))
    times = np.empty(iterations, np.int64)
    clock = time.perf_counter_ns
    for i in range(WARMUP + iterations):
        start = clock()
        sock.sendall(small)
        _recv_exact(sock, small)
        if i >= WARMUP:
            times[i - WARMUP] = clock() - start
    return times


def client_raw(plan: list, address: str) -> list:
    sock = connect_raw(address)
    ack = memoryview(bytearray(1))
    results = []
    for step in plan:
        if step[0] == "rtt":
            results.append(_rtt_stats(raw_round(sock, step[1])))
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


def _config(options: dict):
    from aiollm.transports import TransportConfig

    return TransportConfig(options=options)


async def _serve_aiollm(url: str, plan: list, ready, options: dict) -> None:
    """Push mode (`Connection.deliver`), as nodes receive: echo from the receive callback, count payloads."""
    from aiollm.transports import listen

    loop = asyncio.get_running_loop()
    accepted: asyncio.Queue = asyncio.Queue()
    listener = await listen(url, accepted.put, _config(options))
    ready(listener.address)
    conn = await accepted.get()
    # One entry per frame the client will send: (answer to send or None, where its payload lands or None).
    frames: deque = deque()
    for step in plan:
        if step[0] == "rtt":
            frames.extend([(_ECHO, None)] * (WARMUP + step[1]))
        else:
            _, size, count, fresh = step
            dest = None if fresh else [memoryview(np.empty(size, np.uint8))]
            frames.extend([(None, dest)] * (count - 1) + [(b"k", dest)])
    ended = loop.create_future()

    def on_frame(header: bytes, buffers: list) -> object:
        answer = frames.popleft()[0]
        if answer is _ECHO:
            answer = header
        if answer is not None and not conn.send_nowait(answer):
            return conn.send(answer)  # held: later frames wait until it is written
        return None

    def on_end(error: Exception) -> None:  # the client closes when done
        ended.set_result(None)

    conn.deliver(on_frame, on_end, lambda header, sizes: frames[0][1])
    await ended
    await conn.close()
    await listener.close()


# Marks a frame to be echoed back (its header is the answer).
_ECHO = object()


class PushClient:
    """Client of `_serve_aiollm` in push mode, like a node's asking side: send (at once when the transport
    can take the frame), then await a future that the receive callback settles."""

    @classmethod
    async def connect(cls, address: str, options: dict) -> PushClient:
        from aiollm.transports import connect

        self = cls()
        self.loop = asyncio.get_running_loop()
        self.waiter = None
        self.conn = await connect(address, _config(options))
        self.conn.deliver(self._on_frame, self._on_end)
        return self

    def _on_frame(self, header: bytes, buffers: list) -> None:
        self.waiter.set_result(None)

    def _on_end(self, error: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    async def rtt_round(self, iterations: int) -> np.ndarray:
        """One `rtt` step: WARMUP untimed, then `iterations` timed 8-byte round trips (ns)."""
        conn, loop, small = self.conn, self.loop, b"12345678"
        times = np.empty(iterations, np.int64)
        clock = time.perf_counter_ns
        for i in range(WARMUP + iterations):
            start = clock()
            self.waiter = waiter = loop.create_future()
            if not conn.send_nowait(small):
                await conn.send(small)
            await waiter
            if i >= WARMUP:
                times[i - WARMUP] = clock() - start
        return times

    async def tput_round(self, size: int, count: int) -> float:
        """One `tput` step: seconds from the first send to the server's ack."""
        payload = [np.ones(size, np.uint8)]
        self.waiter = waiter = self.loop.create_future()
        start = time.perf_counter()
        for _ in range(count):
            await self.conn.send(b"", payload)
        await waiter
        return time.perf_counter() - start


async def _client_aiollm(plan: list, address: str, options: dict) -> list:
    client = await PushClient.connect(address, options)
    results = []
    for step in plan:
        if step[0] == "rtt":
            results.append(_rtt_stats(await client.rtt_round(step[1])))
        else:
            results.append({"seconds": await client.tput_round(step[1], step[2])})
    await client.conn.close()
    return results


def _run(coro):
    import uvloop

    return uvloop.run(coro)


def _options(kind: str) -> dict:
    """`ucx[progress=polling,spin_us=0]` -> {"ucx.progress": "polling", "ucx.spin_us": "0"}."""
    _, _, rest = kind.partition("[")
    return {f"ucx.{k}": v for k, v in (item.split("=") for item in rest.rstrip("]").split(",") if item)}


# -- the binding alone (ucxx, polling, no asyncio): what UCX reaches through Python here ------------


def _ucxx_setup():
    import os

    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx._lib.libucxx as ucx_api
    from ucxx._lib.arr import Array

    context = ucx_api.UCXContext({}, (ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    worker = ucx_api.UCXWorker(context)

    def wait(request) -> None:
        while not request.completed:
            worker.progress()
        request.check_error()

    return ucx_api, Array, context, worker, wait


def _ucxx_endpoint(ucx_api, worker, sock: socket.socket):
    mine = bytes(worker.address)
    sock.sendall(len(mine).to_bytes(4, "little") + mine)
    size = bytearray(4)
    _recv_exact(sock, memoryview(size))
    peer = bytearray(int.from_bytes(size, "little"))
    _recv_exact(sock, memoryview(peer))
    return ucx_api.UCXEndpoint.create_from_worker_address(
        worker, ucx_api.UCXAddress.create_from_buffer(bytes(peer)), True
    )


def serve_ucxx_raw(plan: list, ready) -> None:
    ucx_api, Array, _context, worker, wait = _ucxx_setup()
    lsock = socket.create_server(("127.0.0.1", 0))
    ready(f"tcp://127.0.0.1:{lsock.getsockname()[1]}")
    sock, _ = lsock.accept()
    ep = _ucxx_endpoint(ucx_api, worker, sock)
    tag_in, tag_out, mask = ucx_api.UCXXTag(1), ucx_api.UCXXTag(2), ucx_api.UCXXTagMaskFull
    small = Array(bytearray(8))
    for step in plan:
        if step[0] == "rtt":
            for _ in range(WARMUP + step[1]):
                wait(ep.tag_recv(small, tag_in, mask))
                wait(ep.tag_send(small, tag_out))
        else:
            dest = Array(np.empty(step[1], np.uint8))
            for _ in range(step[2]):
                wait(ep.tag_recv(dest, tag_in, mask))
            wait(ep.tag_send(small, tag_out))
    sock.recv(1)  # the client closes its socket when done


def client_ucxx_raw(plan: list, address: str) -> list:
    ucx_api, Array, _context, worker, wait = _ucxx_setup()
    host, port = address.removeprefix("tcp://").split(":")
    sock = socket.create_connection((host, int(port)))
    ep = _ucxx_endpoint(ucx_api, worker, sock)
    tag_out, tag_in, mask = ucx_api.UCXXTag(1), ucx_api.UCXXTag(2), ucx_api.UCXXTagMaskFull
    small = Array(bytearray(8))
    results = []
    for step in plan:
        if step[0] == "rtt":
            times = np.empty(step[1], np.int64)
            for i in range(WARMUP + step[1]):
                start = time.perf_counter_ns()
                wait(ep.tag_send(small, tag_out))
                wait(ep.tag_recv(small, tag_in, mask))
                if i >= WARMUP:
                    times[i - WARMUP] = time.perf_counter_ns() - start
            results.append(_rtt_stats(times))
        else:
            payload = Array(np.ones(step[1], np.uint8))
            start = time.perf_counter()
            for _ in range(step[2]):
                wait(ep.tag_send(payload, tag_out))
            wait(ep.tag_recv(small, tag_in, mask))
            results.append({"seconds": time.perf_counter() - start})
    sock.close()
    return results


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


# -- the floor of any awaited request on asyncio: uvloop protocols, no framing, no actors ------------


class _Echo(asyncio.Protocol):
    """Server: writes back whatever arrives, from the receive callback (no task)."""

    def __init__(self, done: asyncio.Future) -> None:
        self.done = done

    def connection_made(self, transport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(None)


class _Asker(asyncio.Protocol):
    """Client: each round trip writes 8 bytes and awaits a future the receive callback sets (one task wake-up)."""

    def connection_made(self, transport) -> None:
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport = transport
        self.waiter: asyncio.Future | None = None
        self.got = 0

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= 8:
            self.got -= 8
            self.waiter.set_result(None)


async def _serve_floor(plan: list, ready) -> None:
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    server = await loop.create_server(lambda: _Echo(done), "127.0.0.1", 0)
    ready(f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    await done
    server.close()


class FloorClient:
    """Client of `_serve_floor`: each round trip writes 8 bytes and awaits the `_Asker`'s future."""

    @classmethod
    async def connect(cls, address: str) -> FloorClient:
        self = cls()
        self.loop = asyncio.get_running_loop()
        host, port = address.removeprefix("tcp://").split(":")
        self.transport, self.asker = await self.loop.create_connection(_Asker, host, int(port))
        return self

    async def rtt_round(self, iterations: int) -> np.ndarray:
        """One `rtt` step: WARMUP untimed, then `iterations` timed round trips (ns)."""
        loop, transport, asker = self.loop, self.transport, self.asker
        times = np.empty(iterations, np.int64)
        clock = time.perf_counter_ns
        for i in range(WARMUP + iterations):
            start = clock()
            asker.waiter = loop.create_future()
            transport.write(b"12345678")
            await asker.waiter
            if i >= WARMUP:
                times[i - WARMUP] = clock() - start
        return times


async def _client_floor(plan: list, address: str) -> list:
    client = await FloorClient.connect(address)
    results = [_rtt_stats(await client.rtt_round(step[1])) for step in plan]  # round trips only
    client.transport.close()
    return results


def serve(kind: str, plan: list, ready) -> None:
    """Run the server side of `kind` (raw, tcp, zmq, ucxx_raw, uvloop_floor, ucx or ucx[option=value,...])."""
    base = kind.partition("[")[0]
    if base in ("tcp", "ucx"):
        _run(_serve_aiollm(f"{base}://127.0.0.1:0", plan, ready, _options(kind)))
    elif base == "uvloop_floor":
        _run(_serve_floor(plan, ready))
    else:
        {"raw": serve_raw, "zmq": serve_zmq, "ucxx_raw": serve_ucxx_raw}[base](plan, ready)


def client(kind: str, plan: list, address: str) -> list:
    """Run the client side of `kind`; returns one result per plan step."""
    base = kind.partition("[")[0]
    if base in ("tcp", "ucx"):
        return _run(_client_aiollm(plan, address, _options(kind)))
    if base == "uvloop_floor":
        return _run(_client_floor(plan, address))
    return {"raw": client_raw, "zmq": client_zmq, "ucxx_raw": client_ucxx_raw}[base](plan, address)


def main(argv: list[str]) -> None:
    kind, plan = argv[0], json.loads(argv[1])
    serve(kind, plan, lambda address: print(address, flush=True))


if __name__ == "__main__":
    main(sys.argv[1:])
