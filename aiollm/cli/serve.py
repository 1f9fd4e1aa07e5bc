"""`python -m aiollm serve`: a whole local DistServe cluster (or the colocated baseline) in one command.

    python -m aiollm serve --prefill 1 --decode 1 [--port 8000] [--model smollm2]
    python -m aiollm serve --prefill 1 --decode 1 --r-workers 2   # offloaded decode: attention on R-workers
    python -m aiollm serve --colocated              # one process: prefill and decode batched together

Disaggregated: every prefill and decode instance, the controller and the frontend is its own
`python -m aiollm.node --role ...` subprocess on 127.0.0.1 (started through aiollm.deploy.graph, which
shares a fresh cluster secret and always reaps its processes); the instances start first, in
parallel (each loads the model; with `--r-workers N`, each decode instance's N FastDecode R-worker
processes start just before it and it is pointed at them), then the controller, then the frontend.
The command prints the API base URL once the frontend answers and runs until interrupted. It
supervises the nodes: a prefill or decode instance whose process exits (crashed, killed, OOM) is
started again with `--controller`, so it re-registers under its name and gets work again (the
controller failed its requests over meanwhile), up to `_MAX_RESTARTS` times per instance; if the
controller, the frontend or an R-worker exits, or an instance keeps dying, every node is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
import urllib.request
from pathlib import Path

from aiollm import log
from aiollm.deploy.graph import Graph
from aiollm.deploy.roles.common import served_name
from aiollm.heap import keep_freed_memory
from aiollm.kv.pool import KV_DTYPES

_READY_TIMEOUT_S = 300.0
# restarts of one prefill/decode instance before the cluster gives up
_MAX_RESTARTS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=int, default=1, help="prefill instances")
    parser.add_argument("--decode", type=int, default=1, help="decode instances")
    parser.add_argument("--colocated", action="store_true", help="one process, prefill and decode batched together")
    parser.add_argument("--model", default="smollm2", help="bundled name, .gguf file or HF directory")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="weight dtype")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP interface of the frontend")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of the frontend (0: any free one)")
    parser.add_argument("--threads", type=int, default=1, help="torch/attention threads per instance")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--kv-dtype", default="fp32", choices=KV_DTYPES, help="KV storage type")
    parser.add_argument("--prefill-kv-blocks", type=int, default=1024, help="KV buffer of each prefill instance")
    parser.add_argument("--decode-kv-blocks", type=int, default=2048, help="KV pool of each decode instance")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=0,
        help="L_m: prompt tokens per prefill batch (default: from this machine's latency profile, else 512)",
    )
    parser.add_argument("--max-running", type=int, default=128, help="most sequences per decode step")
    parser.add_argument(
        "--r-workers",
        type=int,
        default=0,
        help="R-worker processes per decode instance (offloaded attention, FastDecode); 0: colocated",
    )
    parser.add_argument("--r-kv-memory", default="1GiB", help="KV budget of each R-worker, e.g. 1GiB")
    parser.add_argument("--log-level", default="WARNING", help="log level of the nodes")
    parser.add_argument(
        "--step-log",
        default="",
        metavar="DIR",
        help="each prefill/decode instance records its batch, step and KV pull timings in DIR/NAME.jsonl",
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _step_log(args: argparse.Namespace, name: str) -> tuple[str, ...]:
    return ("--step-log", str(Path(args.step_log, f"{name}.jsonl"))) if args.step_log else ()


async def _serve_cluster(args: argparse.Namespace) -> int:
    """Start the nodes (instances in parallel, then controller, then frontend) and supervise them."""
    model = (
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--block-size",
        str(args.block_size),
        "--kv-dtype",
        args.kv_dtype,
    )
    port = args.port or _free_port()
    async with Graph(startup_timeout=_READY_TIMEOUT_S, log_level=args.log_level) as graph:
        # how each instance node was started, by its URL, to start it again
        instances: dict[str, tuple[str, str, tuple[str, ...]]] = {}

        async def instance(role: str, name: str, role_args: tuple[str, ...]):
            handle = await graph.start_node(role, process=True, args=role_args)
            instances[handle.url] = (role, name, role_args)
            return handle

        prefill = [
            instance(
                "prefill",
                f"prefill{i}",
                (
                    "--actor",
                    f"prefill{i}",
                    *model,
                    "--kv-blocks",
                    str(args.prefill_kv_blocks),
                    "--max-batch-tokens",
                    str(args.max_batch_tokens),
                    *_step_log(args, f"prefill{i}"),
                ),
            )
            for i in range(args.prefill)
        ]

        async def decode_node(i: int):
            offload: tuple[str, ...] = ()
            if args.r_workers:
                r_workers = await asyncio.gather(
                    *(
                        graph.start_node(
                            "r-worker",
                            process=True,
                            args=(
                                "--model",
                                args.model,
                                "--kv-dtype",
                                args.kv_dtype,
                                "--block-size",
                                str(args.block_size),
                                "--kv-memory",
                                args.r_kv_memory,
                                "--threads",
                                str(args.threads),
                            ),
                        )
                        for _ in range(args.r_workers)
                    )
                )
                offload = ("--r-workers", ",".join(h.actors["r-worker"] for h in r_workers))
            return await instance(
                "decode",
                f"decode{i}",
                (
                    "--actor",
                    f"decode{i}",
                    *model,
                    "--kv-blocks",
                    str(args.decode_kv_blocks),
                    "--max-running",
                    str(args.max_running),
                    *offload,
                    *_step_log(args, f"decode{i}"),
                ),
            )

        decode = [decode_node(i) for i in range(args.decode)]
        handles = await asyncio.gather(*prefill, *decode)
        urls = [url for handle in handles for url in handle.actors.items()]
        controller = await graph.start_node(
            "controller",
            process=True,
            args=(
                "--prefill",
                ",".join(f"{n}={u}" for n, u in urls if n.startswith("prefill")),
                "--decode",
                ",".join(f"{n}={u}" for n, u in urls if n.startswith("decode")),
            ),
        )
        await graph.start_node(
            "frontend",
            process=True,
            args=(
                "--controller",
                next(iter(controller.actors.values())),
                "--model",
                args.model,
                "--http-host",
                args.host,
                "--http-port",
                str(port),
            ),
        )
        base = f"http://{args.host}:{port}"
        while not await asyncio.to_thread(_healthy, f"{base}/health"):
            await asyncio.sleep(0.2)
        print(
            f"aiollm: serving {served_name(args.model)} at {base}/v1 "
            f"({args.prefill} prefill + {args.decode} decode instances"
            f"{f', {args.r_workers} R-workers each' if args.r_workers else ''})",
            flush=True,
        )
        return await _supervise(graph, instances, next(iter(controller.actors.values())))


async def _supervise(graph: Graph, instances: dict, controller_url: str) -> int:
    """Run until SIGINT/SIGTERM (0); restart instance nodes that exit; 1 when another node exits or an
    instance exhausted its restarts."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.ensure_future(stop.wait())
    restarts: dict[str, int] = {}
    try:
        while True:
            exits = {asyncio.ensure_future(h.process.wait()): h for h in graph.nodes if h.process.returncode is None}
            done, _ = await asyncio.wait({stopped, *exits}, return_when=asyncio.FIRST_COMPLETED)
            for future in exits:
                future.cancel()
            if stopped in done:
                return 0
            for handle in (exits[f] for f in done):
                spec = instances.pop(handle.url, None)
                status = handle.process.returncode
                if spec is None or restarts.get(spec[1], 0) >= _MAX_RESTARTS:
                    print(f"aiollm: node {handle.url} exited with status {status}; stopping", file=sys.stderr)
                    return 1
                role, name, role_args = spec
                restarts[name] = restarts.get(name, 0) + 1
                print(
                    f"aiollm: {name} exited with status {status}; starting it again ({restarts[name]}/{_MAX_RESTARTS})",
                    file=sys.stderr,
                    flush=True,
                )
                new = await graph.start_node(role, process=True, args=(*role_args, "--controller", controller_url))
                instances[new.url] = spec
    finally:
        stopped.cancel()


def _run_colocated(args: argparse.Namespace) -> int:
    import torch

    from aiollm.deploy.roles.prefill import compute_bound_length
    from aiollm.frontend.app import Frontend, FrontendConfig, start_server
    from aiollm.model.loader import load
    from aiollm.serving.backend import ModelInfo
    from aiollm.serving.colocated import ColocatedEngine, EngineConfig

    torch.set_num_threads(args.threads)
    model = load(args.model, dtype=args.dtype)

    async def main() -> None:
        engine = ColocatedEngine(
            model,
            EngineConfig(
                kv_blocks=args.decode_kv_blocks,
                block_size=args.block_size,
                kv_dtype=args.kv_dtype,
                max_batch_tokens=args.max_batch_tokens or compute_bound_length(args.model),
                max_running=args.max_running,
                attn_threads=args.threads,
            ),
        )
        await engine.start()
        frontend = Frontend(
            engine,
            model.tokenizer,
            ModelInfo(served_name(args.model), model.config.max_context),
            FrontendConfig(host=args.host, port=args.port, vocab_size=model.config.vocab),
        )
        server, task, port = await start_server(frontend.app, args.host, args.port)
        print(f"aiollm: serving {args.model} at http://{args.host}:{port}/v1 (colocated)", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.should_exit = True
        await task
        await engine.stop()

    asyncio.run(main())
    return 0


def run(args: argparse.Namespace) -> int:
    log.configure(args.log_level)
    keep_freed_memory()
    if args.colocated:
        return _run_colocated(args)
    if args.r_workers < 0:
        print("python -m aiollm serve: error: --r-workers must be >= 0", file=sys.stderr)
        return 2
    if args.prefill < 1 or args.decode < 1:
        print("python -m aiollm serve: error: --prefill and --decode must be >= 1", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve_cluster(args))
    except RuntimeError as exc:  # a node did not start
        print(f"python -m aiollm serve: error: {exc}", file=sys.stderr)
        return 1
