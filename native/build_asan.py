"""Build `aiollm._native` with AddressSanitizer and UBSan into a separate directory (used by `make asan`).

Usage: python native/build_asan.py OUTDIR  ->  OUTDIR/aiollm/_native*.so
The library in the source tree is left alone; the Makefile copies the package next to this build and runs
the kernel tests there with libasan preloaded (Python itself is not instrumented).
"""

import sys
from pathlib import Path

from cffi import FFI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build import HERE, SOURCES, _cdef_text

SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]

ffi = FFI()
ffi.cdef(_cdef_text())
ffi.set_source(
    "aiollm._native",
    '#include "aiollm_native.h"',
    sources=[str(HERE / name) for name in SOURCES],
    include_dirs=[str(HERE)],
    extra_compile_args=["-O1", "-g", "-std=c11", "-fno-strict-aliasing", *SANITIZE],
    extra_link_args=SANITIZE,
)

if __name__ == "__main__":
    out = Path(sys.argv[1]).resolve()
    ffi.compile(tmpdir=str(out / "cffi-build"), target=str(out / "aiollm" / "_native.abi3.so"))
