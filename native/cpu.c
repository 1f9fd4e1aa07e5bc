/* CPU feature detection: the one place that asks the processor what it can do. */
#include <cpuid.h>
#include "aiollm_native.h"

uint32_t aiollm_cpu_features(void) {
    uint32_t flags = 0;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) flags |= AIOLLM_CPU_AVX2;
    if (__builtin_cpu_supports("fma")) flags |= AIOLLM_CPU_FMA;
    if (__builtin_cpu_supports("f16c")) flags |= AIOLLM_CPU_F16C;
    if (__builtin_cpu_supports("avx512f")) flags |= AIOLLM_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) flags |= AIOLLM_CPU_AVX512BW;
    if (__builtin_cpu_supports("avx512vnni")) flags |= AIOLLM_CPU_AVX512VNNI;
    if (__builtin_cpu_supports("avx512vbmi")) flags |= AIOLLM_CPU_AVX512VBMI;
    return flags;
}

/* The CPUID vendor string's three words (EBX, EDX, ECX of leaf 0) are "Auth" "enti" "cAMD" / "Genu" "ineI" "ntel". */
static int vendor_is(uint32_t b, uint32_t d, uint32_t c) {
    unsigned a, vb, vc, vd;
    return __get_cpuid(0, &a, &vb, &vc, &vd) && vb == b && vd == d && vc == c;
}

static int intel(void) { return vendor_is(0x756e6547u, 0x49656e69u, 0x6c65746eu); }

/* The x86 family and model of an AuthenticAMD CPU (family 0x19 Zen 3/4, 0x1A Zen 5), family 0 for any other vendor. */
static unsigned amd_family_model(unsigned *model) {
    unsigned a, b, c, d;
    *model = 0;
    if (!vendor_is(0x68747541u, 0x69746e65u, 0x444d4163u) || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    unsigned family = (a >> 8) & 0xfu;
    *model = (a >> 4) & 0xfu;
    if (family == 0xfu) family += (a >> 20) & 0xffu, *model |= ((a >> 16) & 0xfu) << 4;
    return family;
}

static unsigned amd_family(void) {
    unsigned model;
    return amd_family_model(&model);
}

/* A Zen 4 core (family 0x19, models 0x10-0x1F, 0x60-0x7F, 0xA0-0xAF), whether or not a hypervisor shows its AVX-512:
 * the other family 0x19 models are Zen 3. */
static int zen4(void) {
    unsigned model;
    const unsigned family = amd_family_model(&model);
    return family == 0x19u && ((model >= 0x10u && model <= 0x1fu) || (model >= 0x60u && model <= 0x7fu) ||
                               (model >= 0xa0u && model <= 0xafu));
}

/* The far (L2) software prefetch levels (AIOLLM_FAR_* mask) that pay on this CPU. None where the CPU lacks
 * AVX-512F (the AVX2 kernel runs): on an AMD Zen 3 host it cost fp16 up to 10 % and int8 a third (attn_avx2.c);
 * except on a Zen 4 core whose AVX-512 a hypervisor hides (the AVX2 kernel runs there): fp32 / fp16, and int8 / int4
 * lines on items of many heads. On such a host (family 0x19 model 0x11, 2 vCPUs, 30-32 GB/s of memory per core) on
 * 2026-12-07, paired in-process A/B from DRAM, fp16 / read without / with its far level: 2 threads SmolLM2 256 x 1024
 * 0.57 / 0.64, 64 x 4096 0.61 / 0.77, Llama 64 x 1024 0.72 / 0.97; 1 thread Llama 64 x 1024 0.40 / 0.84, SmolLM2
 * (compute-bound there) 0.34 / 0.35 and 0.52 / 0.46; the bench's eight rows 42-74 % / 57-96 % of the read in one
 * run. int8 / fp16 tokens/s without / with the lines (Llama; SmolLM2's items of 3 heads never take them): 2 threads
 * 64 x 1024 1.28 / 1.84, 32 x 4096 1.54 / 1.85, 128 x 1024 0.90 / 1.54; 1 thread 1.09 / 1.41, 0.87 / 1.50, 1.14 /
 * 1.73 (attn_avx2.c). None on
 * AuthenticAMD family 0x1A (Zen 5) and later: measured on a Zen 5 host (paired in-process A/B against the read
 * kernel, from DRAM, 2 threads) without the far level fp16 read 1.06-1.08 of the read kernel instead of 0.98-1.04 and
 * int8 0.97-1.03 instead of 0.81-0.84.
 * GenuineIntel: fp32 / fp16, and for int8 / int4 only the line form on items of many heads. On the Xeon (family 6
 * model 0xCF, AMX, ~15 GB/s of memory per core) of 2026-12-05, paired in-process A/B from DRAM, 2 threads: fp16 read
 * 0.85-1.22 of the read kernel with its far level and 0.79-0.92 without; int8 / fp16 tokens/s (fp16 with its far
 * level), whole int8 tiles on / off: SmolLM2 64 x 1024 1.57 / 1.84, 256 x 1024 1.79 / 2.07, 64 x 4096 1.87 / 2.33
 * (1 thread 1.50-2.06 / 2.00-2.62; int4 2.03-2.29 / 2.15-2.71): SmolLM2's int8 arithmetic already needs most of a
 * core there and the requests are extra instructions. Llama (many heads an item) read the same either way (1.75 /
 * 1.72, 32 x 4096 1.78 / 1.83) and 7-10 % faster with the line form (no far level / lines 16 KiB ahead: 64 x 1024
 * 1.70 / 1.87, 32 x 4096 1.72 / 1.82, 128 x 1024 1.77 / 1.88; 8 and 32 KiB within noise of 16). The Intel host of
 * the first sessions had measured the whole tiles slower for SmolLM2 int8 too (64 x 4096 int8 / fp16 1.97 without,
 * 1.82 with).
 * Every other AVX-512 CPU takes fp32 / fp16 and the whole int8 tiles: on the Zen 4 host they lifted fp16 and int8
 * (attn_avx512_impl.h), and a line form measured within noise of them or slower there. */
int aiollm_cpu_far_prefetch_default(void) {
    if (amd_family() >= 0x1au) return 0;
    if (!(aiollm_cpu_features() & AIOLLM_CPU_AVX512F)) return zen4() ? AIOLLM_FAR_FLOAT | AIOLLM_FAR_QUANTISED_LINES : 0;
    return intel() ? AIOLLM_FAR_FLOAT | AIOLLM_FAR_QUANTISED_LINES : AIOLLM_FAR_FLOAT | AIOLLM_FAR_QUANTISED;
}

/* How far ahead the AVX-512 kernel's int8 / int4 items ask L1 for tiles, in bytes of int8 tiles (int4 items ask for
 * as many tiles, of half the bytes; attn_avx512_impl.h). 8 KiB on AuthenticAMD family 0x19 with AVX-512 (Zen 4):
 * paired in-process A/B from DRAM, 2 threads, int8 / fp16 tokens/s at 4 KiB against 8 KiB: Llama (2 KiB tiles)
 * 64 x 1024 1.50 / 1.67, 1.67 / 1.85, 32 x 4096 1.49 / 1.65; SmolLM2 (1 KiB tiles) 64 x 1024 1.40 / 1.50, 256 x
 * 1024 1.55 / 1.58, 64 x 4096 1.70 / 1.76 (12 and 16 KiB no better, 16 KiB on SmolLM2 up to 0.3 worse); int4 on
 * SmolLM2 read best at 8 tiles too (2 and 16 slower). 4 KiB elsewhere: on the Zen 5 host Llama read 0.92 of the read
 * kernel 2 tiles ahead and 0.89 at 4, SmolLM2 0.93 at 4 and 0.92 at 2. */
int aiollm_cpu_int8_near_bytes(void) {
    return amd_family() == 0x19u && (aiollm_cpu_features() & AIOLLM_CPU_AVX512F) ? 8192 : 4096;
}

/* Whether this CPU is one on which an int8 GQA group of 1 runs the AVX2 kernel's MADD dot products instead of the
 * AVX-512 VNNI ones (dispatch.c, int8_group1_madd): AuthenticAMD family 0x1A (Zen 5) and later, the only one
 * measured. */
int aiollm_cpu_int8_group1_madd(void) {
    return amd_family() >= 0x1au;
}
