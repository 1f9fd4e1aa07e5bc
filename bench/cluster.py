"""Cluster: one cluster on 127.0.0.1 against the same cluster split over network namespaces, the stream rate
between namespaces against a raw socket on the same link, and how long a replan takes to serve.

    python -m bench cluster [--rates 2,4,8,12] [--num-prompts 40] [--json PATH]     # needs root (namespaces)

Goodput: 1 prefill + 1 decode instance, controller and frontend (the bundled model), started on 127.0.0.1, then
with the prefill instance, the decode instance and controller + frontend each on a namespace of its own joined by a
bridge (aiollm.testing.netns.Lan); the same requests (ShareGPT prompts, token ids, `ignore_eos`) at each rate
against each. Goodput is DistServe's: the highest rate at which >= 90 % of requests meet TTFT <= 2 s and TPOT <=
0.25 s. `ratio_goodput_netns_vs_local` (target >= 0.9).

Stream rate: the actor stream a decode instance pulls KV with (credit window 8, items the size of a SmolLM2 fp32
KV block, 737,280 bytes) from a node in a namespace to this one, against a raw TCP socket moving the same bytes
over the same link, in alternating rounds; `ratio_kv_pull_vs_raw_netns` (target >= 0.8) is the median of the
rounds' ratios.

Replan: the local cluster with a replanner whose policy wants a second decode instance above 3 req/s; the rate
steps from 1 to 6 req/s; `replan_seconds` is from the drift being detected to the new instance serving.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import numpy as np

from aiollm.report import table

BLOCK_BYTES = 30 * 2 * 3 * 16 * 64 * 4  # one SmolLM2 KV block, fp32: layers x (K, V) x heads x tokens x dim x 4
TTFT_SLO_S, TPOT_SLO_S = 2.0, 0.25
HTTP_PORT = 18090


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rates", default="2,4,8,12", help="requests/s of the goodput sweep")
    parser.add_argument("--num-prompts", type=int, default=40, help="requests per rate")
    parser.add_argument("--stream-items", type=int, default=256, help="KV blocks per stream-rate round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating stream / raw rounds")


def _requests(n: int):
    from aiollm.loadgen.replay import BenchRequest
    from aiollm.model.loader import load_tokenizer
    from aiollm.planner.datasets import read_sharegpt, sharegpt_pairs

    tokenizer, _ = load_tokenizer("smollm2")
    conversations, _ = read_sharegpt()
    out = []
    for prompt, answer in sharegpt_pairs(conversations, 0):
        ids = tokenizer.encode(prompt)
        if 4 <= len(ids) <= 256:
            out.append(BenchRequest(ids, max(4, min(32, len(tokenizer.encode(answer))))))
        if len(out) == n:
            return out
    raise RuntimeError("too few ShareGPT prompts")


async def _sweep(base_url: str, requests, rates: list[float]) -> tuple[float, list[dict]]:
    from aiollm.loadgen.replay import max_rate_at, run_rate, summarise

    rows = []
    rng = np.random.default_rng(0)
    gaps = rng.exponential(1.0, len(requests))
    unit = np.cumsum(gaps) - gaps[0]
    await run_rate(base_url, "smollm2", requests[:1], np.zeros(1))  # warm
    for rate in rates:
        results, duration = await run_rate(base_url, "smollm2", requests, unit / rate)
        rows.append({"rate": rate, **summarise(results, duration, TTFT_SLO_S, TPOT_SLO_S)})
    goodput = max_rate_at([r["rate"] for r in rows], [r["attainment"] for r in rows], 0.9)
    if all(r["attainment"] >= 0.9 for r in rows):  # met at the highest rate tried: a lower bound
        rows[-1]["goodput_is_lower_bound"] = True
    return goodput, rows


async def _local(requests, rates):
    from aiollm.actors import NodeConfig
    from aiollm.deploy.graph import Graph
    from aiollm.deploy.local import start_cluster
    from aiollm.deploy.spec import ClusterSpec

    spec = ClusterSpec.from_dict({"frontend": {"port": 0}})
    async with Graph(NodeConfig(secret=b"bench-cluster-secret-0123456789"), startup_timeout=300) as graph:
        cluster = await start_cluster(graph, spec)
        return await _sweep(f"{cluster.base_urls[0]}/v1", requests, rates)


async def _split(lan, requests, rates):
    """The same cluster with prefill, decode and controller + frontend each on a namespace of its own."""
    from aiollm.actors import NodeConfig
    from aiollm.deploy.graph import Graph
    from aiollm.deploy.roles import Wiring
    from aiollm.deploy.spec import ClusterSpec

    a, b, c = lan.hosts
    spec = ClusterSpec.from_dict(
        {
            "prefill": {"listen": f"tcp://{a.ip}:0"},
            "decode": {"listen": f"tcp://{b.ip}:0"},
            "controller": {"listen": f"tcp://{c.ip}:0"},
            "frontend": {"listen": f"tcp://{c.ip}:0", "host": c.ip, "port": HTTP_PORT},
        }
    )
    async with Graph(NodeConfig(secret=b"bench-cluster-secret-0123456789"), startup_timeout=300) as graph:
        prefill, decode = await asyncio.gather(
            graph.start_node("prefill", process=True, prefix=a.exec, spec=spec, wiring=Wiring(actor="prefill0")),
            graph.start_node("decode", process=True, prefix=b.exec, spec=spec, wiring=Wiring(actor="decode0")),
        )
        wiring = Wiring(prefill=dict(prefill.actors), decode=dict(decode.actors))
        controller = await graph.start_node("controller", process=True, prefix=c.exec, spec=spec, wiring=wiring)
        frontend = Wiring(controller=controller.actors["controller"])
        await graph.start_node("frontend", process=True, prefix=c.exec, spec=spec, wiring=frontend)
        base = f"http://{c.ip}:{HTTP_PORT}"
        await _until_healthy(f"{base}/health")
        return await _sweep(f"{base}/v1", requests, rates)


async def _until_healthy(url: str) -> None:
    import httpx

    async with httpx.AsyncClient() as http:
        for _ in range(600):
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not answer")


_RAW_SENDER = """
import socket, sys
host, port, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = memoryview(bytes(4 << 20))
with socket.create_connection((host, port)) as s:
    sent = 0
    while sent < total:
        n = min(len(data), total - sent)
        s.sendall(data[:n])
        sent += n
"""


def _raw_rate(host, gateway: str, total: int) -> float:
    """Bytes/s of a plain TCP socket moving `total` bytes from a process in the namespace to this one."""
    import socket

    with socket.socket() as server:
        server.bind((gateway, 0))
        server.listen(1)
        port = server.getsockname()[1]
        sender = subprocess.Popen([*host.exec, sys.executable, "-c", _RAW_SENDER, gateway, str(port), str(total)])
        conn, _ = server.accept()
        buf = bytearray(4 << 20)
        view = memoryview(buf)
        got = 0
        start = time.perf_counter()
        with conn:
            while got < total:
                n = conn.recv_into(view)
                if not n:
                    break
                got += n
        elapsed = time.perf_counter() - start
        sender.wait(30)
    return got / elapsed


async def _stream_rates(lan, items: int, rounds: int) -> tuple[list[float], list[float]]:
    from aiollm.actors import NodeConfig
    from aiollm.actors.echo import Count
    from aiollm.deploy.graph import Graph

    host = lan.hosts[0]
    config = NodeConfig(secret=b"bench-cluster-secret-0123456789")
    streams, raws = [], []
    async with Graph(config) as graph:
        # the driver node listens on 127.0.0.1 only: the echo node's stream comes back over the connection the
        # driver opened to it, across the bridge
        echo = await graph.start_node("echo", process=True, prefix=host.exec, listen=f"tcp://{host.ip}:0")
        ref = graph.ref(echo.actors["echo"])
        async for _ in ref.stream(Count(4, payload=BLOCK_BYTES), window=8):  # connect and warm
            pass
        for _ in range(rounds):
            start = time.perf_counter()
            async for _ in ref.stream(Count(items, payload=BLOCK_BYTES), window=8):
                pass
            streams.append(items * BLOCK_BYTES / (time.perf_counter() - start))
            raws.append(await asyncio.to_thread(_raw_rate, host, lan.gateway, items * BLOCK_BYTES))
    return streams, raws


async def _replan_seconds(requests) -> float | None:
    import openai

    from aiollm.actors import NodeConfig
    from aiollm.deploy.graph import Graph
    from aiollm.deploy.local import start_cluster
    from aiollm.deploy.scale import Replanner, Scaler
    from aiollm.deploy.spec import ClusterSpec
    from aiollm.planner.replan import MonitorConfig

    spec = ClusterSpec.from_dict({"frontend": {"port": 0}, "planner": {"replan": True, "max_instances": 3}})
    async with Graph(NodeConfig(secret=b"bench-cluster-secret-0123456789"), startup_timeout=300) as graph:
        cluster = await start_cluster(graph, spec)
        scaler = Scaler(cluster)
        monitor = MonitorConfig(window_s=5.0, min_requests=4, threshold=0.5, cooldown_s=4.0)
        replanner = Replanner(scaler, lambda s: (1, 2 if s.rate > 3.0 else 1), monitor, budget=3)
        loop = asyncio.create_task(replanner.run())
        client = openai.AsyncOpenAI(base_url=f"{cluster.base_urls[0]}/v1", api_key="b", max_retries=0, timeout=300)
        try:
            for rate, seconds in ((1.0, 8.0), (6.0, 15.0)):
                tasks, start, i = [], time.monotonic(), 0
                while time.monotonic() - start < seconds and not replanner.history:
                    r = requests[i % len(requests)]
                    tasks.append(
                        asyncio.create_task(
                            client.completions.create(model="smollm2", prompt=r.prompt_ids, max_tokens=8, temperature=0)
                        )
                    )
                    i += 1
                    await asyncio.sleep(1 / rate)
                await asyncio.gather(*tasks)
        finally:
            loop.cancel()
            await client.close()
        return replanner.history[0].seconds if replanner.history else None


def run(args: argparse.Namespace) -> dict:
    from aiollm.testing.netns import Lan, available

    ok, why = available()
    if not ok:
        raise SystemExit(f"python -m bench cluster: {why}")
    rates = [float(r) for r in args.rates.split(",")]
    requests = _requests(args.num_prompts)
    print(f"goodput sweep: {len(requests)} requests at {rates} req/s, local then across namespaces", flush=True)
    local_goodput, local_rows = asyncio.run(_local(requests, rates))
    with Lan("aiollm-bench", 3) as lan:
        split_goodput, split_rows = asyncio.run(_split(lan, requests, rates))
        print(f"stream rate: {args.rounds} rounds of {args.stream_items} KV blocks, actor stream vs raw socket")
        streams, raws = asyncio.run(_stream_rates(lan, args.stream_items, args.rounds))
    print("replan: 1 -> 6 req/s on the local cluster", flush=True)
    replan = asyncio.run(_replan_seconds(requests))
    rows = [{"cluster": "local", **r} for r in local_rows] + [{"cluster": "netns", **r} for r in split_rows]
    keep = ("cluster", "rate", "attainment", "ttft_p90_ms", "tpot_p90_ms", "goodput_rps", "failed")
    print(table([{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k in keep} for r in rows]))
    ratios = [s / r for s, r in zip(streams, raws)]
    return {
        "slo_ttft_s": TTFT_SLO_S,
        "slo_tpot_s": TPOT_SLO_S,
        "goodput_local_rps": local_goodput,
        "goodput_netns_rps": split_goodput,
        "ratio_goodput_netns_vs_local": split_goodput / local_goodput if local_goodput else None,
        "goodput_is_lower_bound": any(r.get("goodput_is_lower_bound") for r in rows),
        "goodput_sweep": rows,
        "stream_gbs": [s / 1e9 for s in streams],
        "raw_socket_gbs": [r / 1e9 for r in raws],
        "ratio_kv_pull_vs_raw_netns": statistics.median(ratios),
        "replan_seconds": replan,
    }
