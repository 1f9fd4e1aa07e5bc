"""Prefix-aware prefill routing: the controller's approximate index of each instance's cache, and the cost model
(tokens to compute + tokens queued) against the shortest queue."""

from aiollm.kv.prefix_cache import block_hashes
from aiollm.sched.dispatch import Dispatcher
from aiollm.sched.prefix_routing import PrefixIndex


def _dispatcher(*names: str) -> Dispatcher:
    d = Dispatcher()
    for name in names:
        d.add_prefill(name)
    return d


def test_equal_queues_go_to_the_instance_holding_the_prefix():
    d = _dispatcher("p0", "p1")
    assert d.choose_prefill_cached(100, {}, queue_limit=4) == "p0"
    assert d.choose_prefill_cached(100, {"p1": 64}, queue_limit=4) == "p1"


def test_a_cached_prefix_wins_only_while_it_costs_less_than_the_shortest_queue():
    d = _dispatcher("p0", "p1")
    d.assign_prefill("p1", 50)  # p1 computes 50 queued tokens first
    assert d.choose_prefill_cached(100, {"p1": 64}, queue_limit=4) == "p1"  # 36 + 50 < 100 + 0
    d.assign_prefill("p1", 50)
    assert d.choose_prefill_cached(100, {"p1": 64}, queue_limit=4) == "p0"  # 36 + 100 > 100
    assert d.choose_prefill_cached(100, {"p1": 64}, queue_limit=2) == "p0"  # p1 is at its limit


def test_a_dead_instance_is_never_chosen_for_its_cache():
    d = _dispatcher("p0", "p1")
    d.mark_dead("p1")
    assert d.choose_prefill_cached(100, {"p1": 96}, queue_limit=4) == "p0"
    d.mark_dead("p0")
    assert d.choose_prefill_cached(100, {"p1": 96}, queue_limit=4) is None


def test_the_index_matches_the_longest_prefix_sent_to_an_instance():
    index = PrefixIndex()
    conversation = list(range(100))
    index.record("p0", block_hashes(conversation[:40], 16))  # the first turn: 2 full blocks
    assert index.match("p0", block_hashes(conversation, 16)) == 2
    assert index.match("p1", block_hashes(conversation, 16)) == 0
    assert index.match("p0", block_hashes([7] + conversation[1:], 16)) == 0
    index.forget("p0")
    assert index.match("p0", block_hashes(conversation, 16)) == 0


def test_the_index_keeps_the_most_recent_blocks_up_to_the_capacity():
    index = PrefixIndex(default_capacity=4)
    a, b = block_hashes(list(range(48)), 16), block_hashes(list(range(100, 148)), 16)
    index.record("p0", a)
    index.record("p0", b)  # 6 blocks sent, room for 4: a's first two are forgotten
    assert index.match("p0", b) == 3 and index.match("p0", a) == 0 and len(index) == 4
    index.record("p0", a[:1])
    assert index.match("p0", a) == 1
    index.set_capacity("p0", 2)
    assert len(index) == 2 and index.match("p0", a) == 1
