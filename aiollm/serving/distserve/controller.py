"""DistServe's controller: FCFS dispatch to prefill, then decode instances; failover; timings.

Requests wait in one FCFS queue; the head goes to the prefill instance with the shortest queue
(aiollm.sched.dispatch) as long as that instance has fewer than `prefill_queue_limit` requests not
yet prefilled — so a prefill instance whose KV buffer is full (it stops prefilling) pushes back
into this queue instead of piling up work. After the first token, the request goes to the
least-loaded decode instance, which pulls the KV itself. All tokens pass through here on their way
to the frontend, so the controller records each request's arrival, first-token and token times,
and hands each finished request's timings to a replanning hook (see `ReplanHook`).

Failover: when an instance dies (watched: `Terminated`, which also covers a silent node past the
heartbeat timeout), a decode pull fails, or a KV lease expires, the request is sent back to the head
of the queue with its prompt extended by the tokens already generated, up to `max_retries` times;
the client sees one uninterrupted stream. Why retry rather than fail: the tokens so far are kept, so
a retry costs one re-prefill, not the whole request. A request fails with a clear error ("failed: ...
lost ...; no live decode instance") once its retries are spent or no live instance of the kind it
needs is left (the frontend answers 503 before the stream starts, or ends the stream with the error).

Taking instances back: a dead instance's name stays in the tables. An instance (re)started with
`--controller URL` joins with `Register` (a known name is taken back at its new address, a new name
is added, so replicas can also be added while serving); and every `revive_probe_s` the controller
asks each dead instance's last address for its load, so one declared dead after a heartbeat loss
that is in fact alive (a frozen process that resumed, a network blip) is taken back as well. Stale
work of a taken-back instance (prefills and decodes already failed over) is cancelled on sight.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from aiollm.actors.actor import Actor, handler
from aiollm.actors.messages import Terminated
from aiollm.actors.ref import ActorRef
from aiollm.errors import AiollmError, require_positive
from aiollm.kv.prefix_cache import block_hashes
from aiollm.log import get_logger
from aiollm.model.logprobs import TokenLogprobs
from aiollm.sched.dispatch import Dispatcher
from aiollm.sched.prefix_routing import PrefixIndex
from aiollm.serving.distserve.messages import (
    Cancel,
    Decode,
    Delta,
    Drain,
    DrainStatus,
    Generate,
    GetLoad,
    GetWorkload,
    KVLost,
    Load,
    Prefill,
    Prefilled,
    Register,
    Registered,
    Replanned,
    Sampling,
    Tokens,
    Workload,
)

_log = get_logger("controller")


@dataclass(frozen=True)
class ControllerConfig:
    """Admission and failover limits of the controller."""

    # most requests sent to one prefill instance and not yet prefilled
    prefill_queue_limit: int = 4
    # most requests waiting in the controller's queue; one more is refused as overloaded (HTTP 429)
    max_waiting: int = 4096
    # times one request may be re-dispatched after an instance failure
    max_retries: int = 2
    # seconds between load polls of the instances (for /metrics)
    load_poll_s: float = 0.5
    # seconds between probes of a dead instance's last address (it is taken back when it answers)
    revive_probe_s: float = 0.5
    # seconds a request waits for a live prefill and decode instance (one restarting, say) before it fails
    resume_timeout_s: float = 30.0
    # a request whose decode instance died before decoding a token has another decode instance pull its KV from
    # the prefill instance again instead of prefilling it again
    repull: bool = True
    # route a request to the prefill instance that likely holds the longest cached prefix of its prompt when that
    # costs less than the shortest queue (the instances run with a prefix cache)
    prefix_routing: bool = True

    def __post_init__(self) -> None:
        require_positive(
            self, "prefill_queue_limit", "max_waiting", "load_poll_s", "revive_probe_s", "resume_timeout_s"
        )
        if self.max_retries < 0:
            raise ValueError(f"ControllerConfig.max_retries must be >= 0, got {self.max_retries}")


@dataclass(frozen=True)
class RequestTiming:
    """What the controller recorded for one finished request (times from time.monotonic())."""

    request_id: str
    arrival: float
    first_token: float
    # time each generated token reached the controller (the first one included)
    token_times: tuple[float, ...]
    prompt_len: int
    output_len: int


# Called with every finished request, e.g. `lambda t: monitor.observe(t.arrival, t.prompt_len, t.output_len)`
# with aiollm.planner.replan.WorkloadMonitor, which replans when the workload drifts.
ReplanHook = Callable[[RequestTiming], object]


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    sampling: Sampling
    reply_to: ActorRef
    arrival: float
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    stage: str = "waiting"  # waiting | prefill | decode
    prefill: str | None = None
    decode: str | None = None
    retries: int = 0
    # when it last entered the queue (it fails if no prefill and decode path comes up within resume_timeout_s)
    queued_at: float = 0.0
    # tokens the current decode instance has sent (0: its KV may still sit on the prefill instance)
    decoded: int = 0
    # prompt tokens the prefill instance is expected to compute (its queue counts them)
    prefill_tokens: int = 0
    # the full-block hashes of the current prompt (prefix routing), and the prompt length they were taken at
    hashes: list[bytes] = field(default_factory=list)
    hashed: int = -1

    @property
    def current_prompt(self) -> list[int]:
        """After a failover, the tokens generated so far are prefilled again with the prompt."""
        return self.prompt + self.generated

    @property
    def remaining(self) -> int:
        return self.sampling.max_tokens - len(self.generated)

    @property
    def next_index(self) -> int:
        """Index of the next token to draw: seeded draws are keyed by it, so a resumed request draws the same."""
        return self.sampling.first_index + len(self.generated)


class Controller(Actor):
    """Dispatches requests over n prefill and m decode instances (given by URL)."""

    def __init__(
        self,
        prefill_urls: dict[str, str],
        decode_urls: dict[str, str],
        config: ControllerConfig = ControllerConfig(),
        replan: ReplanHook | None = None,
    ) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("the controller needs at least one prefill and one decode instance")
        self.config, self.replan = config, replan
        self._urls = {**prefill_urls, **decode_urls}
        self._prefill_names, self._decode_names = list(prefill_urls), list(decode_urls)
        self.dispatcher = Dispatcher()
        # what each prefill instance likely holds in its prefix cache, and the KV block size the hashes use
        self.prefixes = PrefixIndex()
        self._block_size = 16
        # requests sent to a prefill instance for its cached prefix rather than the shortest queue
        self.prefix_routed = 0
        self._refs: dict[str, ActorRef] = {}
        self._queue: deque[_Request] = deque()
        self._requests: dict[str, _Request] = {}
        # requests whose KV a prefill instance holds for a decode instance to come (one died before pulling it)
        self._parked: deque[_Request] = deque()
        # how lost requests were resumed: KV pulled again from the prefill instance, or prefilled again
        self.resumed = {"repull": 0, "reprefill": 0}
        self._loads: dict[str, Load] = {}
        # the most recent finished requests, for inspection and the launcher's workload monitor, numbered
        self.finished: deque[RequestTiming] = deque(maxlen=1000)
        self._finished_count = 0
        # instances being drained (no new work; forgotten once their work is done)
        self._draining: set[str] = set()
        # replans the launcher enacted
        self.replans: list[Replanned] = []
        self._tasks: list[asyncio.Task] = []

    async def on_start(self) -> None:
        for name, url in self._urls.items():
            self._refs[name] = self.node.ref(url)
        for name in self._prefill_names:
            self.dispatcher.add_prefill(name)
        for name in self._decode_names:
            load = await self._ask_load(self._refs[name], attempts=300)
            self.dispatcher.add_decode(name, capacity_tokens=load.kv_blocks_total * load.kv_block_size)
            self._loads[name] = load
            self._block_size = load.kv_block_size
        for ref in self._refs.values():
            await self.watch(ref)
        self._tasks = [
            asyncio.create_task(self._poll_loads(), name="controller-loads"),
            asyncio.create_task(self._probe_dead(), name="controller-revive"),
            asyncio.create_task(self._expire_waiting(), name="controller-expire"),
        ]

    async def on_stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ---- from the frontend ------------------------------------------------------------------

    @handler(Generate)
    async def on_generate(self, msg: Generate) -> None:
        if len(self._queue) >= self.config.max_waiting:
            await msg.reply_to.tell(Tokens([Delta(msg.request_id, [], error="overloaded")]))
            return
        now = time.monotonic()
        req = _Request(msg.request_id, list(msg.prompt_ids), msg.sampling, msg.reply_to, now, queued_at=now)
        self._requests[req.request_id] = req
        self._queue.append(req)
        await self._dispatch()

    @handler(Cancel)
    async def on_cancel(self, msg: Cancel) -> None:
        req = self._requests.pop(msg.request_id, None)
        if req is None:
            return
        if req.stage == "waiting":
            self._queue.remove(req)
        elif req.stage == "parked":
            self._parked.remove(req)
            await self._tell(req.prefill, Cancel(req.request_id))
        elif req.stage == "prefill":
            self.dispatcher.prefill_done(req.prefill, req.prefill_tokens)
            await self._tell(req.prefill, Cancel(req.request_id))
            await self._dispatch()
        else:
            self.dispatcher.decode_done(req.decode, self._decode_need(req))
            await self._tell(req.decode, Cancel(req.request_id))
            await self._tell(req.prefill, Cancel(req.request_id))  # frees the KV if not yet pulled

    @handler(GetLoad)
    async def on_get_load(self, msg: GetLoad) -> Load:
        loads = {name: self._loads.get(name) for name in self._urls}
        live = [load for name, load in loads.items() if load is not None and self._instance_alive(name)]
        return Load(
            waiting=len(self._queue) + sum(self.dispatcher.prefill[n].queued for n in self._prefill_names),
            running=sum(self.dispatcher.decode[n].running for n in self._decode_names),
            kv_blocks_used=sum(load.kv_blocks_used for load in live),
            kv_blocks_total=sum(load.kv_blocks_total for load in live),
            prefill_queues={n: self.dispatcher.prefill[n].queued for n in self._prefill_names},
            decode_queues={n: loads[n].waiting if loads[n] else 0 for n in self._decode_names},
            alive={n: self._instance_alive(n) for n in self._urls},
            resumed=dict(self.resumed),
            replans=len(self.replans),
            last_replan=(
                f"{self.replans[-1].why}: {self.replans[-1].before} -> {self.replans[-1].after}" if self.replans else ""
            ),
            # a dead instance holds nothing this cluster can use
            instance_kv_blocks_used={
                n: loads[n].kv_blocks_used if loads[n] and self._instance_alive(n) else 0 for n in self._urls
            },
            prompt_tokens=sum(loads[n].prompt_tokens for n in self._prefill_names if loads[n]),
            prefix_hit_tokens=sum(loads[n].prefix_hit_tokens for n in self._prefill_names if loads[n]),
            kv_blocks_pulled=sum(loads[n].kv_blocks_pulled for n in self._decode_names if loads[n]),
            kv_blocks_reused=sum(loads[n].kv_blocks_reused for n in self._decode_names if loads[n]),
        )

    # ---- from the launcher --------------------------------------------------------------------

    @handler(Drain)
    async def on_drain(self, msg: Drain) -> DrainStatus:
        """Take `msg.name` out of dispatch; answer how much of its work is left (asked again until 0, when the
        instance is forgotten and may stop)."""
        if msg.name not in self._urls:
            raise ValueError(f"no instance {msg.name!r}; instances: {', '.join(self._urls)}")
        if msg.name not in self._draining:
            kind = "prefill" if msg.name in self._prefill_names else "decode"
            names = self._prefill_names if kind == "prefill" else self._decode_names
            if len([n for n in names if n not in self._draining]) <= 1:
                raise ValueError(f"{msg.name!r} is the last {kind} instance; a cluster keeps one")
            self._draining.add(msg.name)
            self.dispatcher.mark_dead(msg.name)
            _log.warning("draining instance", instance=msg.name)
        left = self._work_on(msg.name)
        if left == 0:
            await self._forget(msg.name)
        return DrainStatus(msg.name, left)

    @handler(GetWorkload)
    async def on_get_workload(self, msg: GetWorkload) -> Workload:
        first = self._finished_count - len(self.finished)
        rows = [
            (first + i + 1, t.arrival, t.prompt_len, t.output_len)
            for i, t in enumerate(self.finished)
            if first + i + 1 > msg.after
        ]
        return Workload(rows)

    @handler(Replanned)
    async def on_replanned(self, msg: Replanned) -> None:
        self.replans.append(msg)
        del self.replans[:-100]

    def _work_on(self, name: str) -> int:
        """Requests still using `name`: decoding there, prefilling there, or waiting for their KV held there."""
        return sum(
            (r.stage == "prefill" and r.prefill == name)
            or (r.stage == "decode" and r.decode == name)
            or (r.stage in ("decode", "parked") and r.prefill == name and r.decoded == 0)
            for r in self._requests.values()
        )

    async def _forget(self, name: str) -> None:
        """Drop a drained instance from every table (its node may stop: that is no fault)."""
        ref = self._refs.pop(name, None)
        if ref is not None:
            await self.unwatch(ref)
        self._urls.pop(name, None)
        self._loads.pop(name, None)
        self._draining.discard(name)
        self.prefixes.forget(name)
        for names in (self._prefill_names, self._decode_names):
            if name in names:
                names.remove(name)
        self.dispatcher.prefill.pop(name, None)
        self.dispatcher.decode.pop(name, None)
        _log.warning("instance drained and forgotten", instance=name)

    # ---- from the instances -----------------------------------------------------------------

    @handler(Prefilled)
    async def on_prefilled(self, msg: Prefilled) -> None:
        req = self._requests.get(msg.request_id)
        if req is None or req.stage != "prefill" or req.prefill != msg.source:
            if msg.error is None and msg.finish is None:  # a stale prefill: free its KV
                await self._tell(msg.source, Cancel(msg.request_id))
            return
        self.dispatcher.prefill_done(msg.source, req.prefill_tokens)
        if msg.error is not None:
            await self._retry(req, msg.error)
            await self._dispatch()
            return
        await self._forward(req, [msg.first_token], msg.finish, [msg.logprobs] if msg.logprobs is not None else None)
        if msg.finish is None:
            await self._to_decode(req)
        await self._dispatch()

    @handler(Tokens)
    async def on_tokens(self, msg: Tokens) -> None:
        out: dict[ActorRef, list[Delta]] = defaultdict(list)
        now = time.monotonic()
        for delta in msg.deltas:
            req = self._requests.get(delta.request_id)
            if req is None or req.stage != "decode" or req.decode != msg.source:
                if delta.finish is None and delta.error is None:  # stale work of a taken-back instance
                    await self._tell(msg.source, Cancel(delta.request_id))
                continue
            if delta.error is not None:
                self.dispatcher.decode_done(req.decode, self._decode_need(req))
                await self._retry(req, delta.error)
                continue
            req.generated += delta.token_ids
            req.decoded += len(delta.token_ids)
            req.token_times += [now] * len(delta.token_ids)
            out[req.reply_to].append(Delta(req.request_id, delta.token_ids, delta.finish, logprobs=delta.logprobs))
            if delta.finish is not None:
                self.dispatcher.decode_done(req.decode, self._decode_need(req))
                self._complete(req)
        for dest, deltas in out.items():
            await self._reply(dest, deltas)
        await self._dispatch()

    @handler(KVLost)
    async def on_kv_lost(self, msg: KVLost) -> None:
        req = self._requests.get(msg.request_id)
        if req is not None and req.stage == "parked" and req.prefill == msg.source:
            self._parked.remove(req)
            await self._retry(req, f"KV lease expired on {msg.source} while no decode instance was alive")
            await self._dispatch()
            return
        if req is None or req.stage != "decode" or req.prefill != msg.source:
            return
        self.dispatcher.decode_done(req.decode, self._decode_need(req))
        await self._tell(req.decode, Cancel(req.request_id))
        await self._retry(req, f"KV lease expired on {msg.source}")
        await self._dispatch()

    @handler(Terminated)
    async def on_terminated(self, msg: Terminated) -> None:
        name = next((n for n, ref in self._refs.items() if ref.url == msg.url), None)
        if name is None or not self._instance_alive(name):
            return
        # an orderly stop (the cluster shutting down) is not a fault worth a warning
        (_log.info if msg.reason == "node stopped" else _log.warning)("instance lost", instance=name, reason=msg.reason)
        await self._lose(name, msg.reason)
        await self._dispatch()

    @handler(Register)
    async def on_register(self, msg: Register) -> Registered:
        if msg.kind not in ("prefill", "decode"):
            raise ValueError(f"Register.kind must be 'prefill' or 'decode', got {msg.kind!r}")
        names = self._prefill_names if msg.kind == "prefill" else self._decode_names
        known = msg.name in self._urls
        if known and msg.name not in names:
            raise ValueError(f"instance {msg.name!r} is registered as the other kind, not {msg.kind}")
        if known and self._instance_alive(msg.name):
            if self._refs[msg.name].url == msg.instance.url:
                return Registered(known=True)
            # restarted before its old address was declared dead: the old one's requests fail over
            await self._lose(msg.name, f"replaced by {msg.instance.url}")
        await self._take(msg.name, msg.kind, self.node.ref(msg.instance.url), msg.capacity_tokens)
        _log.warning("instance registered", instance=msg.name, url=msg.instance.url, known=known)
        await self._dispatch()
        return Registered(known=known)

    # ---- instances ----------------------------------------------------------------------------

    async def _lose(self, name: str, reason: str) -> None:
        """Stop sending to `name` and fail its requests over (or fail them, see `_retry`)."""
        self.dispatcher.mark_dead(name)
        self.prefixes.forget(name)
        for req in list(self._requests.values()):
            if req.stage == "prefill" and req.prefill == name:
                self.dispatcher.prefill_done(name, req.prefill_tokens)
                await self._retry(req, f"prefill instance {name} lost ({reason})")
            elif req.stage == "decode" and req.decode == name:
                self.dispatcher.decode_done(name, self._decode_need(req))
                if self.config.repull and req.decoded == 0 and self._instance_alive(req.prefill):
                    # nothing decoded yet: its KV is still on the prefill instance for another decode instance
                    self.resumed["repull"] += 1
                    _log.warning("request re-pulls its KV", request_id=req.request_id, lost=name)
                    await self._to_decode(req, park=True)
                    continue
                await self._tell(req.prefill, Cancel(req.request_id))
                await self._retry(req, f"decode instance {name} lost ({reason})")

    async def _take(self, name: str, kind: str, ref: ActorRef, capacity_tokens: int) -> None:
        """Add `name` at `ref`, or take it back there (live, empty counters) and watch it."""
        old = self._refs.get(name)
        if old is not None:
            await self.unwatch(old)
        self._refs[name], self._urls[name] = ref, ref.url
        if kind == "prefill":
            if name not in self._prefill_names:
                self._prefill_names.append(name)
            self.dispatcher.add_prefill(name)
        else:
            if name not in self._decode_names:
                self._decode_names.append(name)
            self.dispatcher.add_decode(name, capacity_tokens)
        self.dispatcher.revive(name, capacity_tokens or None)
        await self.watch(ref)

    async def _probe_dead(self) -> None:
        """Ask each dead instance's last address for its load; one that answers registers again (through
        this actor's own mailbox, so the take-back runs between handlers, not inside one)."""
        while True:
            await asyncio.sleep(self.config.revive_probe_s)
            for name in [n for n in self._urls if not self._instance_alive(n) and n not in self._draining]:
                try:
                    load = await self._refs[name].ask(GetLoad(), timeout=2.0)
                except (AiollmError, TimeoutError):  # still gone
                    continue
                kind = "prefill" if name in self.dispatcher.prefill else "decode"
                _log.warning("dead instance answers again", instance=name)
                await self.ref.tell(Register(name, kind, self._refs[name], load.kv_blocks_total * load.kv_block_size))

    # ---- internals ----------------------------------------------------------------------------

    async def _dispatch(self) -> None:
        """Send queue heads to the prefill instance with the shortest queue while it has room; while no prefill or
        no decode instance is alive the queue waits for one to come back (`_expire_waiting` bounds the wait)."""
        while self._parked and self.dispatcher.any_alive("decode"):
            await self._to_decode(self._parked.popleft(), park=True)
        while self._queue and self.dispatcher.any_alive("decode"):
            prompt = self._queue[0].current_prompt
            hashes, cached = self._cached_prefixes(self._queue[0])
            name = self.dispatcher.choose_prefill_cached(len(prompt), cached, self.config.prefill_queue_limit)
            if name is None:
                return
            if self.dispatcher.prefill[name].queued >= self.config.prefill_queue_limit:
                return
            req = self._queue.popleft()
            if name != self.dispatcher.choose_prefill():
                self.prefix_routed += 1
            req.prefill_tokens = len(prompt) - cached.get(name, 0)
            self.dispatcher.assign_prefill(name, req.prefill_tokens)
            if hashes:
                self.prefixes.record(name, hashes)
            req.stage, req.prefill, req.decode = "prefill", name, None
            sampling = msgspec.structs.replace(req.sampling, max_tokens=req.remaining, first_index=req.next_index)
            await self._tell(name, Prefill(req.request_id, prompt, sampling, self.ref))

    async def _to_decode(self, req: _Request, park: bool = False) -> None:
        """Send a prefilled request to the least-loaded decode instance. With none alive it goes back to the
        queue with its tokens so far (its KV freed), or with `park` waits with its KV held on the prefill
        instance (the lease bounds the wait)."""
        name = self.dispatcher.choose_decode(self._decode_need(req))
        if name is None:
            if park:
                req.stage, req.decode = "parked", None
                self._parked.append(req)
                return
            await self._tell(req.prefill, Cancel(req.request_id))
            self._requeue(req)
            return
        self.dispatcher.assign_decode(name, self._decode_need(req))
        req.stage, req.decode, req.decoded = "decode", name, 0
        # the decode side continues after the generated tokens; the last one is its first input
        prompt, first = req.current_prompt[:-1], req.generated[-1]
        sampling = msgspec.structs.replace(req.sampling, max_tokens=req.remaining + 1, first_index=req.next_index)
        await self._tell(name, Decode(req.request_id, prompt, first, sampling, self._refs[req.prefill], self.ref))

    def _cached_prefixes(self, req: _Request) -> tuple[list[bytes], dict[str, int]]:
        """The prompt's full-block hashes and, per live prefill instance, the prompt tokens it likely holds."""
        if not self.config.prefix_routing:
            return [], {}
        length = len(req.prompt) + len(req.generated)
        if req.hashed != length:  # hashed once per prompt (a resumed request's prompt is longer)
            req.hashes, req.hashed = block_hashes(req.current_prompt, self._block_size), length
        hashes = req.hashes
        cached = {}
        for name, load in self.dispatcher.prefill.items():
            hit = self.prefixes.match(name, hashes) if load.alive else 0
            if hit:
                cached[name] = hit * self._block_size
        return hashes, cached

    def _decode_need(self, req: _Request) -> int:
        return len(req.prompt) + req.sampling.max_tokens

    async def _forward(
        self, req: _Request, tokens: list[int], finish: str | None, logprobs: list[TokenLogprobs] | None = None
    ) -> None:
        now = time.monotonic()
        req.first_token_at = req.first_token_at or now
        req.generated += tokens
        req.token_times += [now] * len(tokens)
        if finish is not None:
            self._complete(req)
        await self._reply(req.reply_to, [Delta(req.request_id, tokens, finish, logprobs=logprobs)])

    async def _retry(self, req: _Request, reason: str) -> None:
        """Resume a request whose instance failed: back to the head of the queue with its tokens so far, where it
        waits (up to `resume_timeout_s`) if no instance of a kind it needs is alive."""
        if req.retries >= self.config.max_retries or req.remaining <= 0:
            await self._fail(req, f"failed: {reason}; retries spent")
            return
        _log.warning("request failed over", request_id=req.request_id, reason=reason, retry=req.retries + 1)
        req.retries += 1
        self.resumed["reprefill"] += 1
        self._requeue(req)

    def _requeue(self, req: _Request) -> None:
        req.stage, req.prefill, req.decode = "waiting", None, None
        req.queued_at = time.monotonic()
        self._queue.appendleft(req)

    async def _expire_waiting(self) -> None:
        """Fail the requests that waited `resume_timeout_s` for a live prefill and decode instance in vain."""
        while True:
            await asyncio.sleep(min(1.0, self.config.resume_timeout_s / 4))
            missing = [kind for kind in ("prefill", "decode") if not self.dispatcher.any_alive(kind)]
            if not missing:
                continue
            deadline = time.monotonic() - self.config.resume_timeout_s
            for req in [r for r in self._queue if r.queued_at < deadline]:
                self._queue.remove(req)
                waited = self.config.resume_timeout_s
                await self._fail(req, f"unavailable: no live {' or '.join(missing)} instance within {waited:g} s")

    async def _fail(self, req: _Request, error: str) -> None:
        self._requests.pop(req.request_id, None)
        await self._reply(req.reply_to, [Delta(req.request_id, [], error=error)])

    async def _reply(self, dest: ActorRef, deltas: list[Delta]) -> None:
        """Send tokens to a frontend; if it is gone, cancel its requests here (their KV is freed)."""
        try:
            await dest.tell(Tokens(deltas))
        except Exception as exc:
            _log.warning("frontend unreachable: cancelling its requests", frontend=dest.url, error=str(exc))
            for delta in deltas:
                if delta.request_id in self._requests:
                    await self.on_cancel(Cancel(delta.request_id))

    def _complete(self, req: _Request) -> None:
        self._requests.pop(req.request_id, None)
        self._finished_count += 1
        timing = RequestTiming(
            req.request_id, req.arrival, req.first_token_at, tuple(req.token_times), len(req.prompt), len(req.generated)
        )
        self.finished.append(timing)
        if self.replan is not None:
            try:
                self.replan(timing)
            except Exception:
                _log.exception("replanning hook failed")

    async def _tell(self, name: str | None, msg) -> None:
        if name is None or name not in self._refs:  # none, or drained and forgotten: nothing of it is left
            return
        try:
            await self._refs[name].tell(msg)
        except Exception as exc:  # a dead instance: its Terminated notice does the failover
            _log.warning("send failed", instance=name, message=type(msg).__name__, error=str(exc))

    async def _ask_load(self, ref: ActorRef, attempts: int = 1) -> Load:
        for attempt in range(attempts):
            try:
                return await ref.ask(GetLoad(), timeout=5.0)
            except Exception:
                if attempt + 1 == attempts:
                    raise
                await asyncio.sleep(0.2)
        raise AssertionError("unreachable")

    async def _poll_loads(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_poll_s)
            live = [n for n in self._urls if self._instance_alive(n)]
            results = await asyncio.gather(
                *(self._refs[n].ask(GetLoad(), timeout=2.0) for n in live), return_exceptions=True
            )
            for name, result in zip(live, results):
                if isinstance(result, Load):
                    self._loads[name] = result
                    if name in self.dispatcher.prefill:
                        self.prefixes.set_capacity(name, result.kv_blocks_total)

    def _instance_alive(self, name: str) -> bool:
        table = self.dispatcher.prefill if name in self.dispatcher.prefill else self.dispatcher.decode
        return table[name].alive


async def register_with(
    node, controller_url: str, name: str, kind: str, instance: ActorRef, attempts: int = 30
) -> Registered:
    """Join a running controller from an instance's node (`--controller` of the prefill/decode roles).

    Retries for a while (the controller may still be starting); raises the last error after
    `attempts` tries half a second apart."""
    load = await instance.ask(GetLoad(), timeout=10.0)
    msg = Register(name, kind, instance, load.kv_blocks_total * load.kv_block_size if kind == "decode" else 0)
    controller = node.ref(controller_url)
    for _ in range(attempts - 1):
        try:
            return await controller.ask(msg, timeout=10.0)
        except (AiollmError, TimeoutError):
            await asyncio.sleep(0.5)
    return await controller.ask(msg, timeout=10.0)
