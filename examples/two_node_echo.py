"""Two aiollm nodes as OS processes talking over TCP on 127.0.0.1 — run with `python examples/two_node_echo.py`.

What it shows, printing each step: a node started with the `echo` role and an empty node on which
an actor is spawned remotely; an ask, a tell, an ask carrying a tensor out of band, a stream under
credit flow control, an ask between the two node processes, a remote exception, a cancelled ask
reaching the remote handler, and a watch that reports the death of a SIGKILLed node. Every
process is stopped at the end, whatever happens.
"""

import asyncio
import signal
import time

import numpy as np

from aiollm import log
from aiollm.actors import Actor, NodeConfig, Terminated, handler
from aiollm.actors.echo import Count, Echo, EchoActor, Fail, GetStats, Ping, PingPeer, Sleep
from aiollm.deploy.graph import Graph
from aiollm.errors import RemoteError


class Watcher(Actor):
    """Lives in this script's driver node and reports the actors it watches dying."""

    def __init__(self) -> None:
        self.gone: asyncio.Queue[Terminated] = asyncio.Queue()

    @handler(Terminated)
    async def terminated(self, msg: Terminated) -> None:
        self.gone.put_nowait(msg)


async def main() -> None:
    config = NodeConfig(secret=b"two-node-echo-demo-secret", heartbeat_interval=0.2, heartbeat_timeout=1.0)
    async with Graph(config) as graph:
        alpha = await graph.start_node("echo", process=True)
        beta = await graph.start_node("empty", process=True)
        print(f"alpha: pid {alpha.process.pid}, listening on {alpha.url}, role echo -> {alpha.actors}")
        print(f"beta:  pid {beta.process.pid}, listening on {beta.url}, role empty")
        echo_a = graph.ref(alpha.actors["echo"])
        echo_b = await graph.spawn(beta, EchoActor, "echo")
        print(f"spawned {echo_b.url} on beta")

        start = time.perf_counter()
        pong = await echo_a.ask(Ping(1), timeout=5)
        print(f"ask   Ping(1) -> {pong} in {(time.perf_counter() - start) * 1e3:.2f} ms (first use opens the link)")
        await echo_a.tell(Ping(2))
        print("tell  Ping(2) -> sent, no reply")
        data = np.linspace(0, 1, 1 << 20, dtype=np.float16).reshape(1024, 1024)
        out = await echo_a.ask(Echo("tensor", data))
        print(
            f"ask   Echo with a {data.dtype}{list(data.shape)} array ({data.nbytes >> 10} KiB out of band) "
            f"-> equal: {bool(np.array_equal(out.data, data))}"
        )
        items = [item.i async for item in echo_a.stream(Count(8, delay=0.01), window=2)]
        print(f"stream Count(8), window 2 -> {items}")
        rtt = await echo_b.ask(PingPeer(echo_a, 200), timeout=30)
        print(
            f"beta -> alpha: {rtt.n} asks between the two node processes, p50 {rtt.p50_us:.0f} us, "
            f"max {rtt.max_us:.0f} us"
        )
        try:
            await echo_a.ask(Fail("raised on purpose"))
        except RemoteError as exc:
            print(
                f"ask   Fail -> RemoteError {exc.type_name}: {exc.message} "
                f"(remote traceback of {len(exc.traceback_text.splitlines())} lines)"
            )
        try:
            await echo_a.ask(Sleep(30), timeout=0.2)
        except TimeoutError:
            await asyncio.sleep(0.05)
            stats = await echo_a.ask(GetStats())
            print(f"ask   Sleep(30) timed out after 0.2 s -> remote handler cancelled: {stats.cancelled == 1}")
        print(f"alpha's echo stats: {await echo_a.ask(GetStats())}")

        watcher = Watcher()
        await graph.driver.spawn(watcher, "watcher")
        await watcher.watch(echo_b)
        beta.process.send_signal(signal.SIGKILL)
        killed = time.perf_counter()
        notice = await asyncio.wait_for(watcher.gone.get(), 10)
        print(
            f"SIGKILLed beta -> Terminated({notice.url}, {notice.reason!r}) "
            f"after {(time.perf_counter() - killed) * 1e3:.0f} ms"
        )
    print("all nodes stopped")


if __name__ == "__main__":
    log.configure("WARNING")
    asyncio.run(main())
