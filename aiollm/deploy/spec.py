"""The cluster spec: one typed, frozen, validated description of a deployment.

    spec = ClusterSpec.from_toml("cluster.toml")                  # or ClusterSpec.from_dict({...})
    spec = ClusterSpec(decode=DecodeSpec(count=2, r_workers=2))   # or built in Python
    spec = spec.override({"kv.dtype": "fp16", "frontend.port": 0})

`python -m aiollm serve --config F`, `serve`'s flags, the per-role CLI (`python -m aiollm.node --role R`),
`Graph` and the planner's `--emit` all build this one object; the launchers and roles read only it. A bad
value fails here, before anything starts, with a `SpecError` naming the field (`prefill.count: must be >= 1`).

The sections are msgspec structs: decoding TOML checks every type and refuses unknown sections and fields,
and each section's `__post_init__` checks its ranges, so a spec built in Python is validated the same way.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from aiollm.kv.pool import DEFAULT_BLOCK_SIZE, DEFAULT_KV_DTYPE, KV_DTYPES
from aiollm.sizes import parse_size
from aiollm.transports.base import parse_address

WEIGHT_DTYPES = ("fp32", "bf16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class SpecError(ValueError):
    """A cluster spec that cannot run; the message starts with the field's dotted name."""


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise SpecError(f"{field}: {message}")


def _check_size(field: str, text: str) -> None:
    try:
        parse_size(text)
    except ValueError as exc:
        raise SpecError(f"{field}: {exc}") from None


def _check_address(field: str, url: str, *, node: bool = True) -> None:
    try:
        address = parse_address(url)
    except ValueError as exc:
        raise SpecError(f"{field}: {exc}") from None
    _require(not (node and address.path), field, f"{url!r}: a node address has no actor path")


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A frozen section of the spec; TOML decoding refuses fields it does not declare."""


class ModelSpec(_Section):
    # bundled model name, .gguf file or Hugging Face directory
    name: str = "smollm2"
    # weight dtype of every role that holds weights
    dtype: str = "fp32"
    # the name clients send as `model` ("": the model file's or directory's name, without extension)
    served_name: str = ""

    def __post_init__(self) -> None:
        _require(bool(self.name), "name", "must name a model")
        _require(self.dtype in WEIGHT_DTYPES, "dtype", f"must be one of {', '.join(WEIGHT_DTYPES)}, got {self.dtype!r}")


class KVSpec(_Section):
    # storage type of the KV cache, the same on every role that holds or pulls it
    dtype: str = DEFAULT_KV_DTYPE
    # tokens per KV block, the same on every role
    block_size: int = DEFAULT_BLOCK_SIZE
    # automatic prefix caching: prefill and decode instances keep prompts' full KV blocks (by hash) and reuse
    # them, the controller routes a request to the prefill instance that likely holds its prefix
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        _require(self.dtype in KV_DTYPES, "dtype", f"must be one of {', '.join(KV_DTYPES)}, got {self.dtype!r}")
        _require(self.block_size >= 1, "block_size", f"must be >= 1, got {self.block_size}")


class NodeSpec(_Section):
    # seconds between heartbeats on every connection
    heartbeat_interval: float = 1.0
    # seconds of silence after which a peer counts as dead
    heartbeat_timeout: float = 5.0
    # messages an actor's mailbox holds before senders wait
    mailbox_size: int = 256
    # largest frame a node accepts or sends, in bytes
    max_frame_bytes: int = 2 * 1024**3
    # for tls:// addresses (mutual TLS): this node's certificate chain, its key, and the cluster's CA (PEM
    # paths; "" : the AIOLLM_TLS_CERT / _KEY / _CA variables)
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""

    @property
    def transport_options(self) -> tuple[tuple[str, str], ...]:
        files = {"tls.cert": self.tls_cert, "tls.key": self.tls_key, "tls.ca": self.tls_ca}
        return tuple((key, path) for key, path in files.items() if path)

    def __post_init__(self) -> None:
        _require(self.heartbeat_interval > 0, "heartbeat_interval", "must be > 0")
        _require(
            self.heartbeat_timeout > self.heartbeat_interval, "heartbeat_timeout", "must exceed heartbeat_interval"
        )
        _require(self.mailbox_size >= 1, "mailbox_size", "must be >= 1")
        _require(self.max_frame_bytes >= 1024, "max_frame_bytes", "must be >= 1024")


class _Role(_Section):
    # the node's listen address; port 0 picks a free port per instance
    listen: str = "tcp://127.0.0.1:0"
    # the address other nodes reach it at, when it differs from `listen` (NAT, 0.0.0.0, several interfaces);
    # port 0 takes the bound one
    advertise: str = ""
    # on Ray (`serve --ray`): custom resources an instance needs, e.g. {prefill = 1} to run on the nodes started
    # with `ray start --resources '{"prefill": 1}'`
    ray_resources: dict[str, float] = msgspec.field(default_factory=dict)

    def _check_role(self, count: int) -> None:
        _check_address("listen", self.listen)
        if self.advertise:
            _check_address("advertise", self.advertise)
        port = parse_address(self.listen).port
        _require(count <= 1 or not port, "listen", f"port {port} fixed for {count} instances; use port 0")


class PrefillSpec(_Role):
    # prefill instances
    count: int = 1
    # torch and attention threads of each instance
    threads: int = 1
    # KV buffer of prefilled sequences waiting to be pulled, in blocks
    kv_blocks: int = 1024
    # L_m, prompt tokens per prefill batch; 0: from this machine's latency profile, else 512
    max_batch_tokens: int = 0
    # seconds a prefilled sequence's KV waits for its pull before it is freed
    lease_seconds: float = 60.0
    # memory of each instance, e.g. 8GiB: its weights and its KV buffer must fit (checked before anything
    # starts); "" : no check
    memory: str = ""

    def __post_init__(self) -> None:
        _require(self.count >= 1, "count", f"must be >= 1, got {self.count}")
        _require(self.threads >= 1, "threads", f"must be >= 1, got {self.threads}")
        _require(self.kv_blocks >= 1, "kv_blocks", f"must be >= 1, got {self.kv_blocks}")
        _require(self.max_batch_tokens >= 0, "max_batch_tokens", f"must be >= 0, got {self.max_batch_tokens}")
        _require(self.lease_seconds > 0, "lease_seconds", f"must be > 0, got {self.lease_seconds}")
        if self.memory:
            _check_size("memory", self.memory)
        self._check_role(self.count)


class DecodeSpec(_Role):
    # decode instances
    count: int = 1
    # torch and attention threads of each instance
    threads: int = 1
    # KV pool of decoding sequences, in blocks (colocated attention)
    kv_blocks: int = 2048
    # most sequences in one decode step
    max_running: int = 128
    # R-worker processes behind each decode instance (FastDecode's attention offload); 0: attention in-process
    r_workers: int = 0
    # offloaded: split steps into two overlapping mini-batches from this batch on
    pipeline_min_batch: int = 64
    # memory of each instance, e.g. 8GiB: its weights and (colocated attention) its KV pool must fit (checked
    # before anything starts); "" : no check
    memory: str = ""

    def __post_init__(self) -> None:
        _require(self.count >= 1, "count", f"must be >= 1, got {self.count}")
        _require(self.threads >= 1, "threads", f"must be >= 1, got {self.threads}")
        _require(self.kv_blocks >= 1, "kv_blocks", f"must be >= 1, got {self.kv_blocks}")
        _require(self.max_running >= 1, "max_running", f"must be >= 1, got {self.max_running}")
        _require(self.r_workers >= 0, "r_workers", f"must be >= 0, got {self.r_workers}")
        _require(self.pipeline_min_batch >= 1, "pipeline_min_batch", f"must be >= 1, got {self.pipeline_min_batch}")
        if self.memory:
            _check_size("memory", self.memory)
        self._check_role(self.count)


class RWorkerSpec(_Role):
    # native attention threads of each R-worker (one per core it may use)
    threads: int = 1
    # KV budget in RAM, e.g. 8GiB; admission refuses beyond it
    kv_memory: str = "1GiB"

    def __post_init__(self) -> None:
        _require(self.threads >= 1, "threads", f"must be >= 1, got {self.threads}")
        _check_size("kv_memory", self.kv_memory)
        self._check_role(2)

    @property
    def kv_memory_bytes(self) -> int:
        return parse_size(self.kv_memory)


class SWorkerSpec(_Role):
    # torch threads of the S-part
    threads: int = 1
    # B: most sequences decoding at once
    max_batch: int = 256
    # split each step into two mini-batches so the S-part overlaps the R-workers' attention
    pipeline: bool = True
    # ...from this batch on (below it the S-part reads the weights twice for little overlap)
    pipeline_min_batch: int = 64
    # F: start a micro-batch every F steps (the load-stabilising schedule); 0: off
    sls_interval: int = 0
    # S the schedule plans for (prompt + completion)
    sls_seq_len: int = 1024
    # prompt tokens per prefill batch
    max_prefill_tokens: int = 4096
    # prompt KV waiting to be pulled by the R-workers, in tokens
    staging_tokens: int = 16384
    # memory of the S-worker, e.g. 8GiB: its weights and its staging KV must fit (checked before it starts);
    # "" : no check
    memory: str = ""

    def __post_init__(self) -> None:
        for name in (
            "threads",
            "max_batch",
            "pipeline_min_batch",
            "sls_seq_len",
            "max_prefill_tokens",
            "staging_tokens",
        ):
            value = getattr(self, name)
            _require(value >= 1, name, f"must be >= 1, got {value}")
        _require(self.sls_interval >= 0, "sls_interval", f"must be >= 0, got {self.sls_interval}")
        if self.memory:
            _check_size("memory", self.memory)
        self._check_role(1)


class ControllerSpec(_Role):
    # requests sent ahead to one prefill instance and not yet prefilled
    prefill_queue_limit: int = 4
    # requests queued in the controller; one more is refused with HTTP 429
    max_waiting: int = 4096
    # seconds a request waits for a live prefill and decode instance (one restarting) before it fails
    resume_timeout_s: float = 30.0
    # a request whose decode instance died before decoding a token pulls its KV again instead of a re-prefill
    repull: bool = True

    def __post_init__(self) -> None:
        _require(self.prefill_queue_limit >= 1, "prefill_queue_limit", f"must be >= 1, got {self.prefill_queue_limit}")
        _require(self.max_waiting >= 1, "max_waiting", f"must be >= 1, got {self.max_waiting}")
        _require(self.resume_timeout_s > 0, "resume_timeout_s", f"must be > 0, got {self.resume_timeout_s}")
        self._check_role(1)


class FrontendSpec(_Role):
    # HTTP frontends (each its own process; one lost loses only its own connections)
    count: int = 1
    # HTTP interface of the OpenAI-compatible API
    host: str = "127.0.0.1"
    # HTTP port of the first frontend, the next ones on the ports after it; 0 picks free ones
    port: int = 8000
    # HTTP generation requests served at once; one more gets 429
    max_in_flight: int = 512
    # largest request body in bytes; a larger one gets 413 before it is parsed
    max_body_bytes: int = 4 * 1024**2
    # clients of /v1/ must send `Authorization: Bearer api_key`; "" : the AIOLLM_API_KEY variable, else no key
    api_key: str = ""

    def __post_init__(self) -> None:
        _require(bool(self.host), "host", "must name an interface")
        _require(self.max_body_bytes >= 1024, "max_body_bytes", f"must be >= 1024, got {self.max_body_bytes}")
        _require(self.count >= 1, "count", f"must be >= 1, got {self.count}")
        _require(0 <= self.port <= 65536 - self.count, "port", f"must be in 0..{65536 - self.count}, got {self.port}")
        _require(self.max_in_flight >= 1, "max_in_flight", f"must be >= 1, got {self.max_in_flight}")
        self._check_role(self.count)


class PlannerSpec(_Section):
    # replan while serving: when the workload drifts, change the prefill/decode instance counts
    replan: bool = False
    # seconds of finished requests the workload statistics cover, and the fewest requests to decide on
    window_s: float = 60.0
    min_requests: int = 50
    # relative change of rate, mean prompt or mean output length that triggers a replan
    threshold: float = 0.25
    # seconds after a replan during which no other replan happens
    cooldown_s: float = 30.0
    # the resource budget: prefill + decode instances the launcher may run
    max_instances: int = 4
    # the SLOs the placement meets: TTFT and TPOT in seconds, and the share of requests meeting both
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.1
    attainment: float = 0.9
    # the latency profile the placement prices instances with: "local" (python -m aiollm.plan profile), "derived"
    profile: str = "local"

    def __post_init__(self) -> None:
        for name in ("window_s", "threshold", "ttft_slo_s", "tpot_slo_s"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(self.min_requests >= 2, "min_requests", f"must be >= 2, got {self.min_requests}")
        _require(self.cooldown_s >= 0, "cooldown_s", f"must be >= 0, got {self.cooldown_s}")
        _require(self.max_instances >= 2, "max_instances", f"must be >= 2, got {self.max_instances}")
        _require(0 < self.attainment <= 1, "attainment", f"must be in (0, 1], got {self.attainment}")


class ClusterSpec(_Section):
    """A whole deployment: the model, the KV layout every role shares, and each role's count and sizing."""

    model: ModelSpec = ModelSpec()
    kv: KVSpec = KVSpec()
    node: NodeSpec = NodeSpec()
    prefill: PrefillSpec = PrefillSpec()
    decode: DecodeSpec = DecodeSpec()
    r_worker: RWorkerSpec = RWorkerSpec()
    s_worker: SWorkerSpec = SWorkerSpec()
    controller: ControllerSpec = ControllerSpec()
    frontend: FrontendSpec = FrontendSpec()
    planner: PlannerSpec = PlannerSpec()
    # one process batching prefill and decode together (the colocated baseline) instead of a cluster
    colocated: bool = False
    # log level of every node
    log_level: str = "WARNING"
    # directory where each prefill/decode instance records its batch, step and KV pull timings; "" : none
    step_log: str = ""
    # lock-file path through which this host's prefill and decode instances take turns on its cores, each with
    # threads for all of them (aiollm.serving.turns); "" : each computes on its own threads at any time
    turns: str = ""

    def __post_init__(self) -> None:
        _require(self.log_level.upper() in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}")
        instances = self.prefill.count + self.decode.count
        _require(
            not self.planner.replan or instances <= self.planner.max_instances,
            "planner.max_instances",
            f"{self.planner.max_instances} is below the {instances} prefill and decode instances the spec starts",
        )

    # --- building ---------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterSpec:
        """Validate a dict shaped as the TOML file (sections of fields)."""
        try:
            return msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise SpecError(_explain(exc)) from None

    @classmethod
    def from_toml(cls, path: str | Path) -> ClusterSpec:
        path = Path(path)
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise SpecError(f"cannot read the cluster spec {path}: {exc.strerror}") from None
        try:
            return msgspec.toml.decode(text, type=cls)
        except msgspec.ValidationError as exc:
            raise SpecError(f"{path}: {_explain(exc)}") from None
        except msgspec.DecodeError as exc:
            raise SpecError(f"{path}: not valid TOML: {exc}") from None

    def override(self, values: dict[str, Any]) -> ClusterSpec:
        """A copy with dotted fields replaced, e.g. {"decode.count": 2, "kv.dtype": "fp16"}; None values are skipped."""
        data = self.to_dict()
        for dotted, value in values.items():
            if value is None:
                continue
            *sections, field = dotted.split(".")
            target = data
            for section in sections:
                if not isinstance(target.get(section), dict):
                    raise SpecError(f"{dotted}: unknown section {section!r}")
                target = target[section]
            if field not in target:
                raise SpecError(f"{dotted}: unknown field")
            target[field] = value
        return self.from_dict(data)

    # --- writing ----------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def to_toml(self) -> str:
        """The spec as TOML that `from_toml` reads back to an equal spec."""
        return msgspec.toml.encode(self).decode()

    # --- what the launchers need ------------------------------------------------------------------------------

    def describe(self) -> str:
        """One line: what this spec runs."""
        if self.colocated:
            return f"{self.model.name}, colocated in one process"
        offload = f", {self.decode.r_workers} R-workers each" if self.decode.r_workers else ""
        return (
            f"{self.model.name} ({self.model.dtype}, KV {self.kv.dtype}): {self.prefill.count} prefill + "
            f"{self.decode.count} decode instances{offload}"
        )


def _explain(exc: msgspec.ValidationError) -> str:
    """msgspec's "message - at `$.a.b`" as "a.b: message", with a post-init field name joined to its section."""
    text = str(exc)
    message, _, where = text.rpartition(" - at `")
    if not _:
        message, where = text, ""
    path = where.rstrip("`").removeprefix("$").lstrip(".")
    unknown = re.match(r"Object contains unknown field `(\w+)`", message)
    if unknown:
        return f"{'.'.join(filter(None, (path, unknown.group(1))))}: unknown {'field' if path else 'section or field'}"
    field, sep, rest = message.partition(": ")
    if sep and re.fullmatch(r"\w+", field):  # raised by a section's __post_init__, naming its own field
        return f"{'.'.join(filter(None, (path, field)))}: {rest}"
    return f"{path or 'spec'}: {message[:1].lower()}{message[1:]}"
