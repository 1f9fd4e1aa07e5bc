"""The roles a node can host, and how a role instance is described: the cluster spec plus its wiring.

A role module (imported only when chosen) has
- `add_arguments(parser)`: its own flags. A flag that sets a spec field has the field's dotted name as its
  `dest` (`--kv-blocks` -> `decode.kv_blocks`) and defaults to None, so the spec (`--config F`, else the
  defaults) supplies what the command line leaves out. Wiring flags (`--actor`, `--controller`, ...) fill a
  `Wiring`.
- `async start(node, spec, wiring) -> {actor name: url}`: spawn the role's actors on a started node.

`python -m aiollm.node`, `Graph.start_node` and the local launcher all go through `parse_role_args`, so a role
is configured the same way whether it is started by hand, from a script or by `serve`.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from aiollm.deploy.spec import ClusterSpec, SpecError


@dataclass(frozen=True)
class Role:
    # the module implementing the role
    module: str
    # one line of help
    help: str
    # the spec section holding its listen / advertise addresses (None: the node's flags alone)
    section: str | None = None


ROLES: dict[str, Role] = {
    "echo": Role(
        "aiollm.deploy.roles.echo", "an `echo` actor answering Ping/Echo/Count/Sleep/Fail (demo, tests, bench)"
    ),
    "empty": Role("aiollm.deploy.roles.empty", "no actor of its own; actors are spawned on it remotely (Graph.spawn)"),
    "prefill": Role(
        "aiollm.deploy.roles.prefill", "DistServe prefill instance: FCFS, batches to L_m, holds KV", "prefill"
    ),
    "decode": Role("aiollm.deploy.roles.decode", "DistServe decode instance: continuous batching, pulls KV", "decode"),
    "controller": Role("aiollm.deploy.roles.controller", "DistServe controller: dispatch, failover", "controller"),
    "frontend": Role("aiollm.deploy.roles.frontend", "OpenAI-compatible HTTP API in front of a controller", "frontend"),
    "r-worker": Role(
        "aiollm.deploy.roles.r_worker", "FastDecode R-worker: sequences' KV in RAM, attention", "r_worker"
    ),
    "s-worker": Role("aiollm.deploy.roles.s_worker", "FastDecode S-worker: weights, batched S-part", "s_worker"),
}


def role_module(name: str) -> ModuleType:
    """The module of role `name`; ValueError listing the roles for an unknown one."""
    if name not in ROLES:
        raise ValueError(f"unknown role {name!r}; roles: {', '.join(ROLES)}")
    return importlib.import_module(ROLES[name].module)


@dataclass(frozen=True)
class Wiring:
    """Where one role instance sits in a graph: names and peers' addresses, which are not sizing."""

    # the actor's name on its node; "" : the role's default
    actor: str = ""
    # a running controller to join under `actor` (a restarted instance), or the frontend's controller
    controller: str = ""
    # offloaded decode instance or S-worker: its R-workers' actor URLs
    r_workers: tuple[str, ...] = ()
    # controller: the prefill and decode instances it dispatches to, name -> actor URL
    prefill: dict[str, str] = field(default_factory=dict)
    decode: dict[str, str] = field(default_factory=dict)
    # prefill / decode instance: record each batch's or step's timing in this file (JSON lines)
    step_log: str = ""

    def to_args(self) -> list[str]:
        """The wiring as the CLI flags that `parse_role_args` reads back."""
        args: list[str] = []
        for name in ("actor", "controller", "step_log"):
            if value := getattr(self, name):
                args += [f"--{name.replace('_', '-')}", value]
        if self.r_workers:
            args += ["--r-workers", ",".join(self.r_workers)]
        for name in ("prefill", "decode"):
            if instances := getattr(self, name):
                args += [f"--{name}", ",".join(f"{n}={url}" for n, url in instances.items())]
        return args


# --- parsing the flags ------------------------------------------------------------------------------------------


def r_worker_urls(text: str) -> tuple[str, ...]:
    """'tcp://h:p,tcp://h:p/name' -> actor URLs (a bare node address means its `r-worker` actor)."""
    urls = [u.strip() for u in text.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("expected tcp://host:port[/actor][,...]")
    return tuple(u if u.split("://", 1)[-1].count("/") else f"{u}/r-worker" for u in urls)


def instances(text: str) -> dict[str, str]:
    """'name=tcp://h:p/actor,...' or bare actor URLs (named by their actor) -> {name: url}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, url = item.partition("=")
        if not sep:
            name, url = item.rsplit("/", 1)[-1], item
        out[name] = url
    if not out:
        raise argparse.ArgumentTypeError("expected name=tcp://host:port/actor[,...]")
    return out


def add_actor(parser: Any, default: str) -> None:
    parser.add_argument("--actor", default=default, help=f"name of the actor on this node (default {default})")


def add_step_log(parser: Any) -> None:
    parser.add_argument("--step-log", default="", metavar="F", help="record each batch/step's timing here (JSON lines)")


def add_join(parser: Any) -> None:
    parser.add_argument(
        "--controller",
        default="",
        metavar="URL",
        help="join this running controller (tcp://host:port/controller) under the --actor name, e.g. when "
        "restarting a lost instance; empty: the controller is given this instance",
    )


def spec_flag(parser: Any, flag: str, dest: str, help: str, type: Any = None, **kwargs: Any) -> None:
    """A flag setting spec field `dest`; its help shows the spec's default."""
    default = ClusterSpec().to_dict()
    for part in dest.split("."):
        default = default[part]
    kwargs.setdefault("default", None)
    if kwargs.get("action") is None:
        kwargs["type"] = type or _type_of(default)
        if "choices" not in kwargs:
            kwargs.setdefault("metavar", dest.rsplit(".", 1)[-1].upper())
    parser.add_argument(flag, dest=dest, help=f"{help} (default {default})", **kwargs)


def _type_of(default: Any) -> Any:
    return type(default) if isinstance(default, int | float | str) else str


def add_model_flags(parser: Any, section: str, *, weights: bool = True) -> None:
    """--model, --dtype, --memory, --threads, --block-size, --kv-dtype: the flags every model-holding role shares
    (an R-worker, holding no weights, has no --dtype or --memory)."""
    from aiollm.deploy.spec import WEIGHT_DTYPES
    from aiollm.kv.pool import KV_DTYPES

    spec_flag(parser, "--model", "model.name", "bundled name, .gguf file or HF directory")
    if weights:
        spec_flag(parser, "--dtype", "model.dtype", "weight dtype", choices=WEIGHT_DTYPES)
        spec_flag(parser, "--memory", f"{section}.memory", "memory of this process (weights + KV), e.g. 8GiB")
    spec_flag(parser, "--threads", f"{section}.threads", "torch and attention threads of this instance")
    spec_flag(parser, "--block-size", "kv.block_size", "tokens per KV block, the same on every role")
    spec_flag(parser, "--kv-dtype", "kv.dtype", "KV storage type, the same on every role", choices=KV_DTYPES)


def add_prefix_cache_flag(parser: Any) -> None:
    """--prefix-cache / --no-prefix-cache: reuse cached prompt prefixes' KV (kv.prefix_cache)."""
    spec_flag(
        parser,
        "--prefix-cache",
        "kv.prefix_cache",
        "reuse the KV of cached prompt prefixes (prefill and decode instances, the controller's routing)",
        action=argparse.BooleanOptionalAction,
    )


def spec_from_args(args: argparse.Namespace, base: ClusterSpec) -> ClusterSpec:
    """`base` with every spec flag the command line set (dests with a dot) applied; SpecError names a bad one."""
    return base.override({dest: value for dest, value in vars(args).items() if "." in dest})


def wiring_from_args(args: argparse.Namespace) -> Wiring:
    names = {f for f in Wiring.__dataclass_fields__ if hasattr(args, f)}
    return Wiring(**{f: getattr(args, f) for f in names if getattr(args, f) is not None})


def parse_role_args(role: str, argv: list[str], base: ClusterSpec | None = None) -> tuple[ClusterSpec, Wiring]:
    """A role's flags -> (the spec they configure, its wiring); ValueError (SpecError) naming a bad value."""

    class _Raising(argparse.ArgumentParser):
        def error(self, message: str) -> None:  # type: ignore[override]
            raise ValueError(f"role {role}: {message}")

    parser = _Raising(prog=f"role {role}", add_help=False)
    role_module(role).add_arguments(parser)
    args = parser.parse_args(argv)
    return spec_from_args(args, base or ClusterSpec()), wiring_from_args(args)


__all__ = [
    "ROLES",
    "Role",
    "SpecError",
    "Wiring",
    "add_actor",
    "add_join",
    "add_model_flags",
    "add_step_log",
    "instances",
    "parse_role_args",
    "r_worker_urls",
    "role_module",
    "spec_flag",
    "spec_from_args",
    "wiring_from_args",
]
