"""Wire types of DistServe serving: frontend <-> controller <-> prefill / decode instances.

Flow of one request: the frontend's client actor tells the controller `Generate`; the controller
tells a prefill instance `Prefill`; the prefill instance answers `Prefilled` (the first token) and
keeps the KV; the controller tells a decode instance `Decode`; once it has room, the decode
instance pulls the KV with the stream `PullKV` (items `KVBlock`) and acknowledges with `AckKV`,
then sends its tokens to the controller as `Tokens` (one message per step for all its sequences),
which forwards them to the frontend. `Cancel` travels the same way down. An instance started (or
restarted) after the controller joins it with the ask `Register`. Every message is a tell
except the KV stream and the `GetLoad` and `Register` asks, so no handler ever waits on another actor.
"""

from __future__ import annotations

import msgspec
import numpy as np

from aiollm.actors.messages import Message
from aiollm.actors.ref import ActorRef
from aiollm.model.logprobs import TokenLogprobs
from aiollm.model.sampling import SamplingParams


class Sampling(msgspec.Struct, frozen=True, omit_defaults=True):
    """SamplingParams on the wire (stop strings stay in the frontend); options left at their defaults are not
    sent."""

    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    ignore_eos: bool
    # index of the first token this run draws (tokens generated before a resume)
    first_index: int = 0
    # token ids that end the completion besides the model's EOS ids
    stop_token_ids: tuple[int, ...] = ()
    # OpenAI's presence and frequency penalties, vLLM's repetition penalty
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # stop ids are masked until this many tokens were generated
    min_tokens: int = 0
    min_p: float = 0.0
    # (token id, bias) pairs added to the logits
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None: no logprobs; k: each token's logprob and the k most likely
    logprobs: int | None = None
    # the output is any JSON object (response_format json_object)
    json_object: bool = False
    # the output is JSON following this schema, its text (response_format json_schema)
    json_schema: str | None = None

    @classmethod
    def of(cls, params: SamplingParams) -> Sampling:
        return cls(**{name: getattr(params, name) for name in cls.__struct_fields__})

    def params(self, max_tokens: int | None = None) -> SamplingParams:
        fields = msgspec.structs.asdict(self)
        fields["max_tokens"] = max_tokens or self.max_tokens
        return SamplingParams(**fields)


class Generate(Message, tag="ds.generate"):
    """Frontend -> controller: a new request."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    # where the controller sends this request's `Tokens`
    reply_to: ActorRef


class Cancel(Message, tag="ds.cancel"):
    """Drop a request and free its KV (frontend -> controller -> instances)."""

    request_id: str


class Delta(msgspec.Struct, frozen=True, omit_defaults=True):
    """New tokens of one request; `finish` ("stop", "length") or `error` ends it."""

    request_id: str
    token_ids: list[int]
    finish: str | None = None
    # "overloaded", "unavailable" or "failed: ..." when the request cannot complete
    error: str | None = None
    # one entry per token, only for a request that asks for logprobs
    logprobs: list[TokenLogprobs] | None = None


class Tokens(Message, tag="ds.tokens"):
    """Decode instance -> controller -> frontend: the tokens of one step, for many requests."""

    deltas: list[Delta]
    # name of the sending instance (the controller's bookkeeping)
    source: str = ""


class Prefill(Message, tag="ds.prefill"):
    """Controller -> prefill instance: prefill these prompts (FCFS)."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    reply_to: ActorRef


class Prefilled(Message, tag="ds.prefilled"):
    """Prefill instance -> controller: the first token; the KV waits to be pulled (unless finished)."""

    request_id: str
    first_token: int
    # set when the first token already ends the request (its KV is freed at once)
    finish: str | None
    # name of the prefill instance (the controller's bookkeeping)
    source: str
    # set instead of a token when the prefill failed
    error: str | None = None
    # the first token's logprobs, only for a request that asks for them
    logprobs: TokenLogprobs | None = None


class KVLost(Message, tag="ds.kv_lost"):
    """Prefill instance -> controller: a sequence's KV lease expired before it was pulled and acked."""

    request_id: str
    source: str


class Decode(Message, tag="ds.decode"):
    """Controller -> decode instance: continue this request from its prefilled KV."""

    request_id: str
    # prompt tokens whose KV the prefill instance holds
    prompt_ids: list[int]
    # the first generated token (sampled by the prefill instance)
    first_token: int
    sampling: Sampling
    # the prefill actor holding the KV
    source: ActorRef
    reply_to: ActorRef


class PullKV(Message, tag="ds.pull_kv"):
    """Decode instance -> prefill instance (stream): send this sequence's KV, one block per item."""

    request_id: str
    # indices of the blocks the puller already holds (mapped from its own prefix cache): not sent
    skip: list[int] = []


class KVBlock(Message, tag="ds.kv_block"):
    """One KV block of every layer: k [n_layers, 1, n_kv_heads, head_dim, block_size], v likewise transposed."""

    index: int
    k: np.ndarray
    v: np.ndarray
    # int8 KV only: per-token scales [n_layers, 1, n_kv_heads, block_size]
    k_scale: np.ndarray | None = None
    v_scale: np.ndarray | None = None


class AckKV(Message, tag="ds.ack_kv"):
    """Decode instance -> prefill instance: the KV is stored here; free yours."""

    request_id: str


class Register(Message, tag="ds.register"):
    """Instance -> controller (ask): take me (back) into dispatch, e.g. after a restart at a new address."""

    # the instance's name in the controller's tables (a known name replaces the old instance)
    name: str
    # "prefill" or "decode"
    kind: str
    instance: ActorRef
    # decode: KV tokens it can hold (0: unknown)
    capacity_tokens: int = 0


class Registered(Message, tag="ds.registered"):
    """Controller -> instance: the answer to `Register`."""

    # True when the name was known (the instance was taken back), False when it was added
    known: bool


class Drain(Message, tag="ds.drain"):
    """Launcher -> controller (ask, reply `DrainStatus`): send `name` no new work; its requests finish there (a
    prefill instance's KV is pulled) before it stops. Asked again, it answers how much is left."""

    name: str


class DrainStatus(Message, tag="ds.drain_status"):
    """How much work a draining instance still has; 0: it may stop (it is then forgotten)."""

    name: str
    left: int


class GetWorkload(Message, tag="ds.get_workload"):
    """Launcher -> controller (ask, reply `Workload`): the requests finished since number `after`."""

    after: int = 0


class Workload(Message, tag="ds.workload"):
    """Finished requests as (number, arrival time on the controller's clock, prompt tokens, output tokens)."""

    finished: list[tuple[int, float, int, int]]


class Replanned(Message, tag="ds.replanned"):
    """Launcher -> controller (tell): a replan was enacted, for /metrics."""

    # seconds on the launcher's clock, why (the drift), and the instance counts before and after
    at: float
    why: str
    before: dict[str, int]
    after: dict[str, int]


class GetLoad(Message, tag="ds.get_load"):
    """Ask an instance (or the controller) for its load."""


class Load(Message, tag="ds.load"):
    """An instance's load, or the controller's summary of all of them."""

    # requests queued (prefill: not yet prefilled; decode: not yet admitted)
    waiting: int
    # prefill: KV held for pulling; decode: sequences decoding
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    # tokens per KV block
    kv_block_size: int = 16
    # per-instance queue lengths (controller summary only), by instance name
    prefill_queues: dict[str, int] = {}
    decode_queues: dict[str, int] = {}
    # each instance's liveness as the controller sees it, and the KV blocks it holds (controller summary only)
    alive: dict[str, bool] = {}
    instance_kv_blocks_used: dict[str, int] = {}
    # requests resumed after losing an instance, by how: "repull" (KV pulled again), "reprefill"
    resumed: dict[str, int] = {}
    # replans enacted so far, and the last one in words
    replans: int = 0
    last_replan: str = ""
    # prefix caching. prefill: prompt tokens prefilled, and those of them mapped from the cache (not computed);
    # decode: KV blocks of prompts pulled, and those mapped from its own cache instead (not transferred)
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    kv_blocks_pulled: int = 0
    kv_blocks_reused: int = 0
