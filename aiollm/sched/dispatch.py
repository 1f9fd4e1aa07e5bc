"""DistServe's request dispatch: FCFS to the prefill instance with the shortest queue, then to the
least-loaded decode instance, as pure bookkeeping.

Why pure: the controller actor and the planner's simulator drive this same object with their own
clock and their own notion of "done", so the policy cannot drift between simulation and serving.
The controller calls `assign_prefill` when a prefill instance can take the head of its FCFS queue,
`prefill_done` when the first token came back, `assign_decode` when the KV is ready to move, and
`decode_done` when the request finished (or failed, or was cancelled).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefillLoad:
    """What the dispatcher knows about one prefill instance."""

    # Requests sent to it whose first token has not come back yet.
    queued: int = 0
    # Prompt tokens of those requests (breaks ties between equal queue lengths).
    queued_tokens: int = 0
    # False once the instance died or was drained: it gets nothing new.
    alive: bool = True


@dataclass
class DecodeLoad:
    """What the dispatcher knows about one decode instance."""

    # Requests assigned to it that have not finished.
    running: int = 0
    # KV tokens those requests may reach (prompt + max new tokens): what it has promised to hold.
    reserved_tokens: int = 0
    # The most KV tokens the instance can hold; 0 means unknown (then only `reserved_tokens` counts).
    capacity_tokens: int = 0
    alive: bool = True


@dataclass
class Dispatcher:
    """Per-instance load counters and the two choices DistServe's controller makes."""

    prefill: dict[str, PrefillLoad] = field(default_factory=dict)
    decode: dict[str, DecodeLoad] = field(default_factory=dict)

    def add_prefill(self, name: str) -> None:
        self.prefill.setdefault(name, PrefillLoad())

    def add_decode(self, name: str, capacity_tokens: int = 0) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        load = self.decode.setdefault(name, DecodeLoad())
        load.capacity_tokens = capacity_tokens

    def mark_dead(self, name: str) -> None:
        """Stop sending to an instance (its node died or it is being drained)."""
        for table in (self.prefill, self.decode):
            if name in table:
                table[name].alive = False

    def revive(self, name: str, capacity_tokens: int | None = None) -> None:
        """Take an instance back after it re-registered or answered again: alive, with empty counters
        (everything it held was failed over when it was marked dead); a decode instance may come back
        with another capacity (None keeps the old one)."""
        if name in self.prefill:
            self.prefill[name] = PrefillLoad()
        if name in self.decode:
            old = self.decode[name].capacity_tokens
            self.decode[name] = DecodeLoad()
            self.add_decode(name, old if capacity_tokens is None else capacity_tokens)

    def any_alive(self, kind: str) -> bool:
        """Whether a live instance of `kind` ("prefill" or "decode") exists."""
        return any(load.alive for load in (self.prefill if kind == "prefill" else self.decode).values())

    def choose_prefill(self) -> str | None:
        """The live prefill instance with the shortest queue (fewest queued tokens breaks ties)."""
        live = [(load.queued, load.queued_tokens, name) for name, load in self.prefill.items() if load.alive]
        return min(live)[2] if live else None

    def choose_prefill_cached(self, prompt_tokens: int, cached: dict[str, int], queue_limit: int) -> str | None:
        """Prefix-cache-aware choice: the shortest queue (`choose_prefill`) unless an instance that likely holds a
        prefix of the prompt (`cached`: name -> tokens) and has room under `queue_limit` costs less, where an
        instance's cost is the tokens it would compute for this prompt plus the tokens queued there."""
        best = self.choose_prefill()
        if best is None:
            return None
        cost = lambda name: prompt_tokens - cached.get(name, 0) + self.prefill[name].queued_tokens
        best_cost = cost(best)
        for name, hit in sorted(cached.items()):
            load = self.prefill.get(name)
            if hit <= 0 or load is None or not load.alive or load.queued >= queue_limit:
                continue
            if cost(name) < best_cost:
                best, best_cost = name, cost(name)
        return best

    def choose_decode(self, need_tokens: int) -> str | None:
        """The least-loaded live decode instance: lowest share of its capacity promised after adding
        this request; instances of unknown capacity compare by promised tokens, then by running count."""
        if need_tokens <= 0:
            raise ValueError(f"need_tokens must be > 0, got {need_tokens}")
        best: tuple | None = None
        for name, load in self.decode.items():
            if not load.alive:
                continue
            after = load.reserved_tokens + need_tokens
            share = after / load.capacity_tokens if load.capacity_tokens else float(after)
            key = (share, load.running, name)
            if best is None or key < best:
                best = key
        return best[2] if best else None

    def assign_prefill(self, name: str, prompt_tokens: int) -> None:
        load = self.prefill[name]
        load.queued += 1
        load.queued_tokens += prompt_tokens

    def prefill_done(self, name: str, prompt_tokens: int) -> None:
        load = self.prefill[name]
        if load.queued <= 0:
            raise ValueError(f"prefill instance {name!r} has no queued request to finish")
        load.queued -= 1
        load.queued_tokens -= prompt_tokens

    def assign_decode(self, name: str, need_tokens: int) -> None:
        load = self.decode[name]
        load.running += 1
        load.reserved_tokens += need_tokens

    def decode_done(self, name: str, need_tokens: int) -> None:
        load = self.decode[name]
        if load.running <= 0:
            raise ValueError(f"decode instance {name!r} has no running request to finish")
        load.running -= 1
        load.reserved_tokens -= need_tokens
