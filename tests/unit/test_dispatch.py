"""DistServe dispatch, prefill batching to L_m and decode admission: the pure policies."""

import pytest

from aiollm.sched.decode_admission import DecodeAdmission, blocks_for
from aiollm.sched.dispatch import Dispatcher
from aiollm.sched.prefill_batching import take_batch


def _dispatcher(n_prefill=2, n_decode=2, capacity=1000):
    d = Dispatcher()
    for i in range(n_prefill):
        d.add_prefill(f"p{i}")
    for i in range(n_decode):
        d.add_decode(f"d{i}", capacity_tokens=capacity)
    return d


def test_prefill_goes_to_shortest_queue_and_spreads_a_burst():
    d = _dispatcher(n_prefill=3)
    chosen = []
    for _ in range(6):
        name = d.choose_prefill()
        d.assign_prefill(name, 10)
        chosen.append(name)
    assert sorted(chosen) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    d.prefill_done("p1", 10)
    d.prefill_done("p1", 10)
    assert d.choose_prefill() == "p1"


def test_prefill_tie_broken_by_queued_tokens():
    d = _dispatcher(n_prefill=2)
    d.assign_prefill("p0", 500)
    d.assign_prefill("p1", 20)
    assert d.choose_prefill() == "p1"


def test_decode_least_loaded_by_capacity_share():
    d = Dispatcher()
    d.add_decode("small", capacity_tokens=100)
    d.add_decode("big", capacity_tokens=1000)
    d.assign_decode("big", 300)  # 30 % of big
    assert d.choose_decode(50) == "big"  # big -> 35 %, small -> 50 %
    d.assign_decode("big", 500)
    assert d.choose_decode(50) == "small"
    d.decode_done("big", 500)
    assert d.choose_decode(50) == "big"


def test_dead_instances_get_nothing():
    d = _dispatcher()
    d.mark_dead("p0")
    d.mark_dead("d0")
    assert {d.choose_prefill() for _ in range(3)} == {"p1"}
    assert d.choose_decode(10) == "d1"
    d.mark_dead("p1")
    d.mark_dead("d1")
    assert d.choose_prefill() is None and d.choose_decode(10) is None


def test_done_without_assignment_is_an_error():
    d = _dispatcher()
    with pytest.raises(ValueError, match="p0"):
        d.prefill_done("p0", 1)
    with pytest.raises(ValueError, match="d0"):
        d.decode_done("d0", 1)
    with pytest.raises(ValueError, match="need_tokens"):
        d.choose_decode(0)


@pytest.mark.parametrize(
    "lengths, l_m, size, expected",
    [
        ([], 512, 0, 0),
        ([100, 100, 100], 512, 0, 3),
        ([300, 300, 10], 512, 0, 1),  # FCFS: the short third prompt does not jump the second
        ([2000, 10], 512, 0, 1),  # a long prompt runs alone
        ([10, 2000], 512, 0, 1),  # ... and is not glued behind a short one
        ([256, 256, 1], 512, 0, 2),  # exactly L_m closes the batch
        ([1] * 10, 512, 4, 4),  # the batch-size cap
    ],
)
def test_take_batch(lengths, l_m, size, expected):
    assert take_batch(lengths, l_m, size) == expected


def test_take_batch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="L_m"):
        take_batch([1], 0)
    with pytest.raises(ValueError, match="prompt lengths"):
        take_batch([0], 10)


def test_decode_admission_reserves_to_the_end_and_stays_fcfs():
    adm = DecodeAdmission(total_blocks=10, block_size=16, max_running=8)
    adm.enqueue("a", 16 * 6)  # 6 blocks
    adm.enqueue("b", 16 * 5)  # 5 blocks: does not fit beside a
    adm.enqueue("c", 16)  # 1 block: would fit, but FCFS keeps it behind b
    assert [a.seq_id for a in adm.admit()] == ["a"]
    assert adm.free_blocks == 4 and adm.waiting == 2
    adm.release("a")
    assert [(a.seq_id, a.blocks) for a in adm.admit()] == [("b", 5), ("c", 1)]
    assert adm.running == 2 and adm.free_blocks == 4


def test_decode_admission_limits():
    adm = DecodeAdmission(total_blocks=4, block_size=16, max_running=1)
    with pytest.raises(ValueError, match="needs 5 blocks"):
        adm.enqueue("huge", 16 * 4 + 1)
    adm.enqueue("x", 1)
    adm.enqueue("y", 1)
    assert len(adm.admit()) == 1  # max_running
    with pytest.raises(ValueError, match="already"):
        adm.enqueue("x", 1)
    adm.release("x")
    assert [a.seq_id for a in adm.admit()] == ["y"]
    assert blocks_for(17, 16) == 2 and blocks_for(16, 16) == 1


def test_revived_instance_gets_work_again_with_fresh_counters():
    d = _dispatcher(n_prefill=1, n_decode=1)
    d.assign_prefill("p0", 10)
    d.assign_decode("d0", 500)
    d.mark_dead("p0")
    d.mark_dead("d0")
    assert not d.any_alive("prefill") and not d.any_alive("decode")
    d.revive("p0")
    d.revive("d0", capacity_tokens=2000)
    assert d.any_alive("prefill") and d.any_alive("decode")
    assert d.prefill["p0"].queued == 0 and d.decode["d0"].reserved_tokens == 0
    assert d.decode["d0"].capacity_tokens == 2000
    assert d.choose_prefill() == "p0" and d.choose_decode(10) == "d0"
