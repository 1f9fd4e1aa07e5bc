"""Keep freed heap memory in the process, so a decode loop's large per-step tensors do not fault in every step.

Why: a decode step allocates the same large tensors every time (SmolLM2's logits of one 64-row mini-batch are
6.3 MB of bf16 and 12.6 MB of fp32). By default glibc hands the top of its heap back to the kernel once more than
its trim threshold is free there, and that threshold follows the largest block freed (twice its size), so a step
that frees a few such blocks at once gives their pages back and the next step faults them in, zeroed by the kernel,
again. On the S-worker of the FastDecode schedule trace's placement (B=128 in two mini-batches, one R-worker
process on the other core, context 1280) that is ~18.8 K page faults/s (~3,800 a step); with the thresholds fixed
as below ~2.2 K/s, and 7-11 ms less S-worker CPU per ~235 ms step. The cost: up to `trim` bytes freed at
the heap's top stay with the process.

Process-wide and effective for allocations made after the call, so each entry point (a node, the bench, the CLIs)
calls it before loading a model. A no-op returning False where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 512 * 2**20


def keep_freed_memory(mmap: int = MMAP_THRESHOLD, trim: int = TRIM_THRESHOLD) -> bool:
    """Serve blocks below `mmap` bytes from the heap and keep up to `trim` freed bytes at its top; True if set."""
    if not 0 < mmap <= MMAP_THRESHOLD or trim < mmap:
        raise ValueError(f"need 0 < mmap <= {MMAP_THRESHOLD} and trim >= mmap, got mmap={mmap}, trim={trim}")
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap)) and bool(mallopt(_M_TRIM_THRESHOLD, trim))


@functools.lru_cache(maxsize=1)
def _mallopt():
    """glibc's mallopt, or None elsewhere (musl and macOS have no such knobs; only glibc has gnu_get_libc_version)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # noqa: B018 (the probe: AttributeError off glibc)
    except (OSError, AttributeError):
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt
