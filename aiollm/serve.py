"""`python -m aiollm serve`: a whole local DistServe cluster (or the colocated baseline) in one command.

    python -m aiollm serve --prefill 1 --decode 1 [--port 8000] [--model smollm2]
    python -m aiollm serve --colocated              # one process: prefill and decode batched together

Disaggregated: every prefill and decode instance, the controller and the frontend is its own
`python -m aiollm.node --role ...` subprocess on 127.0.0.1, sharing a fresh cluster secret; the
instances start first (each loads the model), then the controller, then the frontend. The command
prints the API base URL once the frontend answers and runs until interrupted (or until a child
dies), then stops every child it started.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_READY_TIMEOUT_S = 300.0


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
    parser.add_argument("--kv-dtype", default="fp32", choices=["fp32", "fp16", "int8"], help="KV storage type")
    parser.add_argument("--prefill-kv-blocks", type=int, default=1024, help="KV buffer of each prefill instance")
    parser.add_argument("--decode-kv-blocks", type=int, default=2048, help="KV pool of each decode instance")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="L_m: prompt tokens per prefill batch")
    parser.add_argument("--max-running", type=int, default=128, help="most sequences per decode step")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Child:
    """One started node: its process, and its `ready ...` line once printed (other output is passed on)."""

    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.ready = threading.Event()
        self.fields: dict[str, str] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("ready ") and not self.ready.is_set():
                self.fields = dict(item.split("=", 1) for item in line.split()[1:] if "=" in item)
                self.ready.set()
            else:
                sys.stdout.write(f"[{self.name}] {line}")
        self.ready.set()  # exited: wake the waiter, which sees the exit code

    def wait_ready(self, timeout: float) -> dict[str, str]:
        if not self.ready.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} did not start (exit code {self.proc.poll()})")
        return self.fields

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _node(role: str, port: int, secret_file: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "aiollm.node", "--role", role, "--listen", f"tcp://127.0.0.1:{port}",
            "--secret-file", str(secret_file), *extra]


def _start_cluster(args: argparse.Namespace, secret_file: Path, children: list[_Child]) -> None:
    """Start every node, appending each to `children` at once (so the caller can stop them on any error)."""
    model = ["--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads),
             "--block-size", str(args.block_size), "--kv-dtype", args.kv_dtype]
    for i in range(args.prefill):
        children.append(_Child(f"prefill{i}", _node("prefill", _free_port(), secret_file, "--actor", f"prefill{i}",
                                                     *model, "--kv-blocks", str(args.prefill_kv_blocks),
                                                     "--max-batch-tokens", str(args.max_batch_tokens))))
    for i in range(args.decode):
        children.append(_Child(f"decode{i}", _node("decode", _free_port(), secret_file, "--actor", f"decode{i}",
                                                   *model, "--kv-blocks", str(args.decode_kv_blocks),
                                                   "--max-running", str(args.max_running))))
    urls = {child.name: child.wait_ready(_READY_TIMEOUT_S)["actor"] for child in children}
    prefill = ",".join(f"{n}={u}" for n, u in urls.items() if n.startswith("prefill"))
    decode = ",".join(f"{n}={u}" for n, u in urls.items() if n.startswith("decode"))
    controller = _Child("controller", _node("controller", _free_port(), secret_file, "--prefill", prefill,
                                            "--decode", decode))
    children.append(controller)
    controller_url = controller.wait_ready(_READY_TIMEOUT_S)["actor"]
    frontend = _Child("frontend", _node("frontend", _free_port(), secret_file, "--controller", controller_url,
                                        "--model", args.model, "--http-host", args.host,
                                        "--http-port", str(args.port)))
    children.append(frontend)
    print(f"aiollm: serving {args.model} at {frontend.wait_ready(_READY_TIMEOUT_S)['http']} "
          f"({args.prefill} prefill + {args.decode} decode instances)", flush=True)


def _supervise(children: list[_Child]) -> int:
    """Wait until a signal arrives (exit 0) or a child exits (exit 1)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        for child in children:
            if child.proc.poll() is not None:
                print(f"aiollm: {child.name} exited with code {child.proc.returncode}; stopping", file=sys.stderr)
                return 1
    return 0


def _run_colocated(args: argparse.Namespace) -> int:
    import torch

    from aiollm.model.loader import load
    from aiollm.workers.backend import ModelInfo
    from aiollm.workers.engine import ColocatedEngine, EngineConfig
    from aiollm.workers.frontend import Frontend, FrontendConfig, start_server
    from aiollm.workers.roles import served_name

    torch.set_num_threads(args.threads)
    model = load(args.model, dtype=args.dtype)

    async def main() -> None:
        engine = ColocatedEngine(model, EngineConfig(
            kv_blocks=args.decode_kv_blocks, block_size=args.block_size, kv_dtype=args.kv_dtype,
            max_batch_tokens=args.max_batch_tokens, max_running=args.max_running, attn_threads=args.threads))
        await engine.start()
        frontend = Frontend(engine, model.tokenizer, ModelInfo(served_name(args.model), model.config.max_context),
                            FrontendConfig(host=args.host, port=args.port, vocab_size=model.config.vocab))
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
    if args.colocated:
        return _run_colocated(args)
    if args.prefill < 1 or args.decode < 1:
        print("aiollm serve: --prefill and --decode must be >= 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="aiollm-") as tmp:
        secret_file = Path(tmp) / "secret"
        secret_file.write_text(secrets.token_hex(32))
        os.chmod(secret_file, 0o600)
        children: list[_Child] = []
        try:
            _start_cluster(args, secret_file, children)
            return _supervise(children)
        except RuntimeError as exc:
            print(f"aiollm serve: {exc}", file=sys.stderr)
            return 1
        finally:
            for child in reversed(children):
                child.stop()
