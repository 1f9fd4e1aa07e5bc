"""`python -m aiollm serve`: a whole local DistServe cluster (or the colocated baseline) in one command.

    python -m aiollm serve --config examples/cluster.toml       # a cluster spec (aiollm.deploy.spec)
    python -m aiollm serve --prefill 1 --decode 1 [--port 8000] [--model smollm2]
    python -m aiollm serve --prefill 1 --decode 1 --r-workers 2   # offloaded decode: attention on R-workers
    python -m aiollm serve --colocated                            # one process: prefill and decode batched together

Flags given beside `--config` override the file's fields. The spec is validated before anything starts (its
fields, the listen addresses, and each role's `memory` against the model's weights and KV); a bad field exits
with status 2 naming it. See aiollm.deploy.local for how the cluster is started and supervised.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path

from aiollm.deploy.roles import spec_flag
from aiollm.deploy.spec import WEIGHT_DTYPES, ClusterSpec, SpecError
from aiollm.kv.pool import KV_DTYPES

# serve's flags that set several spec fields at once
_THREADS = ("prefill.threads", "decode.threads", "r_worker.threads")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="TOML", help="cluster spec; the flags below override it")
    spec_flag(parser, "--prefill", "prefill.count", "prefill instances")
    spec_flag(parser, "--decode", "decode.count", "decode instances")
    spec_flag(parser, "--frontends", "frontend.count", "HTTP frontends, on --port and the ports after it")
    spec_flag(
        parser,
        "--colocated",
        "colocated",
        "one process, prefill and decode batched together",
        action="store_const",
        const=True,
    )
    spec_flag(parser, "--model", "model.name", "bundled name, .gguf file or HF directory")
    spec_flag(
        parser, "--served-model-name", "model.served_name", "the name clients send as `model` (default: the model's)"
    )
    spec_flag(parser, "--dtype", "model.dtype", "weight dtype", choices=WEIGHT_DTYPES)
    spec_flag(parser, "--host", "frontend.host", "HTTP interface of the frontend")
    spec_flag(parser, "--port", "frontend.port", "HTTP port of the frontend (0: any free one)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch/attention threads of every instance and R-worker (default: the cores shared among them)",
    )
    spec_flag(parser, "--block-size", "kv.block_size", "tokens per KV block")
    spec_flag(parser, "--kv-dtype", "kv.dtype", "KV storage type", choices=KV_DTYPES)
    spec_flag(
        parser,
        "--prefix-cache",
        "kv.prefix_cache",
        "reuse the KV of cached prompt prefixes (prefill, decode and routing)",
        action=argparse.BooleanOptionalAction,
    )
    spec_flag(parser, "--prefill-kv-blocks", "prefill.kv_blocks", "KV buffer of each prefill instance")
    spec_flag(parser, "--decode-kv-blocks", "decode.kv_blocks", "KV pool of each decode instance")
    spec_flag(
        parser,
        "--max-batch-tokens",
        "prefill.max_batch_tokens",
        "L_m: prompt tokens per prefill batch; 0: from this machine's latency profile, else 512",
    )
    spec_flag(parser, "--max-running", "decode.max_running", "most sequences per decode step")
    parser.add_argument(
        "--take-turns",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefill and decode instances take turns on every core of the host, each with threads for all of them "
        "(unless --threads says), instead of splitting the cores (default: where a split would leave one prefill "
        "and one decode instance fewer than 2 cores each, and neither --threads nor --config is given)",
    )
    spec_flag(parser, "--r-workers", "decode.r_workers", "R-worker processes per decode instance (FastDecode offload)")
    spec_flag(parser, "--r-kv-memory", "r_worker.kv_memory", "KV budget of each R-worker, e.g. 1GiB")
    spec_flag(parser, "--prefill-memory", "prefill.memory", "memory of each prefill instance (weights + KV), e.g. 8GiB")
    spec_flag(parser, "--decode-memory", "decode.memory", "memory of each decode instance (weights + KV), e.g. 8GiB")
    spec_flag(parser, "--api-key", "frontend.api_key", "clients must send it as a Bearer token (or AIOLLM_API_KEY)")
    parser.add_argument(
        "--ray",
        action="store_true",
        help="place every role instance as a Ray actor (resources from the spec's ray_resources); Ray restarts them",
    )
    parser.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --ray: the Ray cluster (`auto`: the one `ray start` runs on this host; default: start a local one)",
    )
    spec_flag(parser, "--log-level", "log_level", "log level of the nodes")
    spec_flag(
        parser,
        "--step-log",
        "step_log",
        "each prefill/decode instance records its batch, step and KV pull timings in DIR/NAME.jsonl",
        metavar="DIR",
    )


def build_spec(args: argparse.Namespace) -> ClusterSpec:
    """The spec the flags describe: `--config` (else the defaults) with every given flag on top."""
    spec = ClusterSpec.from_toml(args.config) if args.config else ClusterSpec()
    overrides = {
        dest: value
        for dest, value in vars(args).items()
        if "." in dest or dest in ("colocated", "log_level", "step_log")
    }
    overrides.update(dict.fromkeys(_THREADS, args.threads))
    spec = spec.override(overrides)
    turns = args.take_turns
    if turns is None:
        turns = args.threads is None and args.config is None and too_few_cores_to_split(spec)
    if turns:
        if spec.colocated or spec.decode.r_workers:
            raise SpecError("--take-turns: prefill and decode instances with colocated attention only")
        # each instance's threads cover every core, unless --threads says otherwise
        spec = spec.override({"turns": turns_path(), **dict.fromkeys(_THREADS, args.threads or _cores())})
    elif args.threads is None and args.config is None:
        spec = spec.override(dict.fromkeys(_THREADS, default_threads(spec)))
    return spec


def turns_path() -> str:
    """A fresh lock-file path for one cluster's turns (aiollm.serving.turns)."""
    return str(Path(tempfile.gettempdir()) / f"aiollm-turns-{os.getpid()}-{secrets.token_hex(4)}")


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def too_few_cores_to_split(spec: ClusterSpec) -> bool:
    """Whether splitting this host's cores would leave one prefill and one decode instance (colocated attention)
    fewer than 2 each: then they take turns on all of them. On 2 cores, split, a 128-token prompt waits for one
    core's prefill (fp32 TTFT p50 at 1 req/s 202 ms against 128 ms by turns, `python -m bench peers`) while the
    decode's core idles between steps (293 against 342 tokens/s at saturation)."""
    return (
        not spec.colocated
        and spec.prefill.count == 1
        and spec.decode.count == 1
        and spec.decode.r_workers == 0
        and _cores() < 4
    )


def default_threads(spec: ClusterSpec) -> int:
    """Threads per process when neither --threads nor a spec says: the cores this process may run on, shared
    among the processes that compute (one colocated process takes them all)."""
    cores = _cores()
    if spec.colocated:
        return cores
    processes = spec.prefill.count + spec.decode.count * (1 + spec.decode.r_workers)
    return max(1, cores // processes)


def run(args: argparse.Namespace) -> int:
    from aiollm import log
    from aiollm.deploy.local import check_addresses
    from aiollm.deploy.local import run as run_local
    from aiollm.deploy.memory import check_memory
    from aiollm.heap import keep_freed_memory
    from aiollm.serving import turns

    try:
        spec = build_spec(args)
        if not spec.colocated:
            check_addresses(spec)
        check_memory(spec)
    except SpecError as exc:
        print(f"python -m aiollm serve: error: {exc}", file=sys.stderr)
        return 2
    log.configure(spec.log_level)
    keep_freed_memory()
    if args.ray:
        from aiollm.deploy import ray as on_ray
        from aiollm.deploy.local import free_port

        if not spec.frontend.port:
            spec = spec.override({"frontend.port": free_port(spec.frontend.host)})
    try:
        if args.ray:
            return on_ray.serve(spec, args.ray_address)
        return run_local(spec)
    finally:
        if spec.turns:
            turns.remove(spec.turns)
