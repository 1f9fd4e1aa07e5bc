"""cffi (API mode) build of the native kernel library into `aiollm._native`.

The header `aiollm_native.h` is the cdef: one declaration list shared by C and Python.
Each source file may carry per-function `target` attributes; dispatch happens in C at run time.
"""

import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
HEADER = HERE / "aiollm_native.h"
SOURCES = [
    "cpu.c",
    "dispatch.c",
    "threadpool.c",
    "kv_write.c",
    "attn_ref.c",
    "attn_avx2.c",
    "attn_avx512.c",
    "attn_avx512_vnni.c",
    "gemm.c",
    "gemm_avx512.c",
    "gemm_amx.c",
    "gemm_team.c",
]
SOURCES += ["fused_ops.c", "fma_peak.c"]  # the decode step's RMSNorm, RoPE, SiLU*up, argmax


def _cdef_text() -> str:
    """The header without include guards and includes, which cffi's cdef does not accept.

    Integer `#define NAME value` constants are kept: cffi exposes them as `lib.NAME`.
    """
    keep = []
    for line in HEADER.read_text().splitlines():
        stripped = line.lstrip()
        if stripped.startswith("#") and not re.match(r"#define\s+\w+\s+\S+", stripped):
            continue
        keep.append(line)
    return "\n".join(keep)


ffibuilder = FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.set_source(
    "aiollm._native",
    '#include "aiollm_native.h"',
    sources=[str(HERE / name) for name in SOURCES],
    include_dirs=[str(HERE)],
    depends=[str(path) for path in sorted(HERE.glob("*.h"))],  # a header edit rebuilds the library
    extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
