"""The offloaded decode executor's bookkeeping, with stand-in R-worker refs: placement by expected length
among R-workers with room, a sequence no single R-worker can hold fails its pull, freeing gives the booking
back and sends `Release`, and R-workers whose KV format differs from the prefill instances' are refused."""

import asyncio

import pytest

from aiollm.errors import KVCacheFull
from aiollm.model.sampling import SamplingParams
from aiollm.model.sequence import Sequence
from aiollm.serving.fastdecode.messages import Admit, Release, RLoad
from aiollm.serving.fastdecode.offloaded_executor import OffloadedExecutor


class FakeWorker:
    def __init__(self, url: str, load: RLoad) -> None:
        self.url, self.load, self.asked, self.told = url, load, [], []

    async def ask(self, msg, timeout=None):
        self.asked.append(msg)
        return self.load

    async def tell(self, msg):
        self.told.append(msg)


class FakeNode:
    def __init__(self, workers: dict[str, FakeWorker]) -> None:
        self.workers = workers

    def ref(self, url: str) -> FakeWorker:
        return self.workers[url]


def _load(blocks: int, block_size: int = 16, dtype: str = "fp32") -> RLoad:
    return RLoad(
        sequences=0, tokens=0, reserved_tokens=0, blocks_used=0, blocks_total=blocks, block_size=block_size, dtype=dtype
    )


def _seq(rid: str, prompt_len: int, max_tokens: int) -> Sequence:
    seq = Sequence(rid, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), frozenset(), None, 4096)
    seq.output.append(7)  # the first token, from the prefill instance
    return seq


async def _executor(*blocks: int) -> tuple[OffloadedExecutor, list[FakeWorker]]:
    workers = {f"tcp://w{i}/r-worker": FakeWorker(f"tcp://w{i}/r-worker", _load(b)) for i, b in enumerate(blocks)}
    executor = await OffloadedExecutor.connect(FakeNode(workers), list(workers), None, 16, "fp32")
    return executor, list(workers.values())


async def test_places_by_expected_length_admits_with_the_prefill_source_and_releases():
    executor, workers = await _executor(10, 10)
    assert executor.total_blocks == 20 and executor.block_size == 16
    long, short, third = _seq("long", 40, 40), _seq("short", 10, 6), _seq("third", 10, 6)  # 80, 16, 16 tokens
    for seq in (long, short, third):
        executor.reserve(seq)
    assert executor.booked == [5, 2] and executor.used_blocks == 7  # short and third both go to the lighter one
    await executor.load_kv(short, source="prefill-ref")
    admit = workers[1].asked[-1]
    assert isinstance(admit, Admit) and admit.request_id == "short" and admit.source == "prefill-ref"
    assert (admit.n_tokens, admit.max_len) == (10, 16)  # the prompt's KV; room for the whole completion
    executor.free(short)
    await asyncio.sleep(0)
    assert executor.booked == [5, 1] and workers[1].told == [Release([admit.seq])]


async def test_a_sequence_no_single_r_worker_can_hold_fails_its_pull():
    executor, workers = await _executor(4, 4)
    executor.reserve(_seq("a", 30, 20))  # 4 blocks: fills worker 0
    big = _seq("big", 40, 40)  # 5 blocks: fits the 4 free in total on neither worker
    executor.reserve(big)
    with pytest.raises(KVCacheFull):
        await executor.load_kv(big, source="prefill-ref")
    executor.free(big)
    assert executor.booked == [4, 0] and not any(w.asked[1:] for w in workers)


async def test_r_workers_must_store_kv_like_the_prefill_instances():
    workers = {"tcp://w0/r-worker": FakeWorker("tcp://w0/r-worker", _load(8, dtype="fp16"))}
    with pytest.raises(ValueError, match="fp16"):
        await OffloadedExecutor.connect(FakeNode(workers), list(workers), None, 16, "fp32")
