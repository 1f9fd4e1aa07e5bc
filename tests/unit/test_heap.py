"""aiollm.heap: with the thresholds fixed, a loop that allocates and frees the same large blocks stops faulting
their pages in again each round (each case in a fresh process: the setting is process-wide)."""

import subprocess
import sys

import pytest

from aiollm.heap import MMAP_THRESHOLD, _mallopt, keep_freed_memory

# three 12.6 MB blocks (a 64-row mini-batch's fp32 logits each) allocated together and freed each round: more
# than glibc's dynamic trim threshold (twice the largest block freed) comes free at the heap's top at once
_PATTERN = """
import resource, sys
import numpy as np
if sys.argv[1] == "1":
    from aiollm.heap import keep_freed_memory
    assert keep_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(25):
    if i == 5:
        before = faults()
    blocks = [np.ones(64 * 49152, np.float32) for _ in range(3)]
    del blocks
print((faults() - before) / 20)
"""


def _faults_per_round(tuned: bool) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _PATTERN, "1" if tuned else "0"], capture_output=True, text=True, check=True, timeout=60
    )
    return float(out.stdout.strip())


@pytest.mark.skipif(_mallopt() is None, reason="the C library is not glibc")
def test_freed_blocks_stay_mapped():
    plain, tuned = _faults_per_round(False), _faults_per_round(True)
    assert plain > 500, f"the pattern did not fault without the tuning ({plain} a round): the test shows nothing"
    assert tuned < 10, f"{tuned} page faults a round with the thresholds fixed, {plain} without"


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="mmap"):
        keep_freed_memory(mmap=MMAP_THRESHOLD + 1)
    with pytest.raises(ValueError, match="trim"):
        keep_freed_memory(mmap=2**20, trim=2**19)
