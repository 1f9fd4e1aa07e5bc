from pathlib import Path

import pytest

from aiollm._native import lib
from aiollm.native import attention


def _cpuinfo_field(name: str) -> str:
    """The first processor's `name` field of /proc/cpuinfo."""
    text = Path("/proc/cpuinfo").read_text()
    return next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(name))


def _proc_flags() -> set[str]:
    return set(_cpuinfo_field("flags").split())


def test_native_library_reports_the_cpu_features_linux_reports():
    flags = _proc_flags()
    features = lib.aiollm_cpu_features()
    assert bool(features & lib.AIOLLM_CPU_AVX2) == ("avx2" in flags)
    assert bool(features & lib.AIOLLM_CPU_FMA) == ("fma" in flags)
    assert bool(features & lib.AIOLLM_CPU_F16C) == ("f16c" in flags)
    assert bool(features & lib.AIOLLM_CPU_AVX512F) == ("avx512f" in flags)
    assert bool(features & lib.AIOLLM_CPU_AVX512BW) == ("avx512bw" in flags)
    assert bool(features & lib.AIOLLM_CPU_AVX512VNNI) == ("avx512_vnni" in flags)
    assert bool(features & lib.AIOLLM_CPU_AVX512VBMI) == ("avx512vbmi" in flags)


def _zen4() -> bool:
    """A Zen 4 core (AuthenticAMD family 0x19, models 0x10-0x1F, 0x60-0x7F, 0xA0-0xAF), AVX-512 shown or not."""
    if _cpuinfo_field("vendor_id") != "AuthenticAMD" or int(_cpuinfo_field("cpu family")) != 0x19:
        return False
    model = int(_cpuinfo_field("model"))
    return 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF


def test_far_prefetch_default_follows_avx512_the_vendor_and_the_amd_family():
    """The kernel's far prefetch rule (native/cpu.c) reads the same flags, vendor, family and model Linux reports: with
    AVX-512 before AMD family 0x1A fp32 / fp16 and whole int8 tiles, on Intel fp32 / fp16 and the int8 lines of items
    of many heads; without AVX-512 the same as Intel on a Zen 4 core (its AVX-512 hidden by a hypervisor), else none;
    none on Zen 5."""
    vendor = _cpuinfo_field("vendor_id")
    family = int(_cpuinfo_field("cpu family"))
    zen5 = vendor == "AuthenticAMD" and family >= 0x1A
    intel = lib.AIOLLM_FAR_FLOAT | lib.AIOLLM_FAR_QUANTISED_LINES
    if zen5:
        expected = 0
    elif "avx512f" not in _proc_flags():
        expected = intel if _zen4() else 0
    else:
        expected = intel if vendor == "GenuineIntel" else lib.AIOLLM_FAR_FLOAT | lib.AIOLLM_FAR_QUANTISED
    assert lib.aiollm_cpu_far_prefetch_default() == expected


def test_int8_near_prefetch_is_8_kib_exactly_on_amd_family_0x19_with_avx512():
    """The AVX-512 kernel's int8 / int4 L1 prefetch distance (native/cpu.c): 8 KiB on Zen 4, 4 KiB elsewhere."""
    amd = _cpuinfo_field("vendor_id") == "AuthenticAMD"
    zen4 = amd and int(_cpuinfo_field("cpu family")) == 0x19 and "avx512f" in _proc_flags()
    assert lib.aiollm_cpu_int8_near_bytes() == (8192 if zen4 else 4096)


def test_fma_peak_counts_the_multiply_adds_of_the_isa_in_use_and_refuses_bad_arguments():
    """aiollm_fma_peak does 12 chains of the ISA's widest vector per round on each thread: 12 x 16 lanes on AVX-512, 12
    x 8 on AVX2, 12 on the portable path; it refuses no rounds or a thread count outside the pool's range."""
    lanes = {"avx512": 12 * 16, "avx2": 12 * 8, "ref": 12}[attention.isa()]
    assert lib.aiollm_fma_peak(1000, 1) == lanes * 1000
    assert lib.aiollm_fma_peak(1000, 2) == lanes * 2000
    assert lib.aiollm_fma_peak(0, 1) == -1
    assert lib.aiollm_fma_peak(10, 0) == -1
    assert lib.aiollm_fma_peak(10, lib.AIOLLM_MAX_THREADS + 1) == -1
    assert attention.fma_peak(1, reps=2, n_iters=10_000) > 1e8  # any core of this century: > 0.1 G multiply-adds/s


def test_fma_peak_names_a_bad_argument():
    with pytest.raises(ValueError, match="n_threads"):
        attention.fma_peak(0)
    with pytest.raises(ValueError, match="reps"):
        attention.fma_peak(1, reps=0)
    with pytest.raises(ValueError, match="n_iters"):
        attention.fma_peak(1, n_iters=-5)
