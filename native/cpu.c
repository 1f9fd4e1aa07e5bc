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

/* The far (L2) software prefetch levels (AIOLLM_FAR_* mask) that pay on this CPU; where they do not, the hardware
 * prefetchers do better alone. Figures below: from DRAM, 2 threads unless said, as fractions of the read kernel's
 * bandwidth or as int8 tokens/s over fp16's.
 * - AuthenticAMD family 0x1A (Zen 5) and later: none. Their hardware prefetchers keep the memory busy on their own
 *   and the requests are only extra instructions: without the far level fp16 reads 1.06-1.08 of the read kernel,
 *   with it 0.98-1.04; int8 0.97-1.03 against 0.81-0.84.
 * - No AVX-512F (the AVX2 kernel runs): none on a Zen 3 class core, where the far level costs fp16 up to 10 % and int8
 *   a third (attn_avx2.c): the core, not the memory, binds. A Zen 4 core whose AVX-512 a hypervisor hides (two ymm
 *   FMAs a cycle, 30-32 GB/s of memory per core) leaves its memory idle without them, so it takes fp32 / fp16 and,
 *   for int8 / int4, the line form on items of many heads: fp16 reads 0.64-0.97 of the read kernel with the far
 *   level against 0.57-0.72 without (1 thread, Llama 64 x 1024: 0.84 against 0.40; SmolLM2, compute-bound there,
 *   no faster), and Llama int8 runs 1.4-1.85x fp16 with the lines against 0.9-1.55x without (SmolLM2's
 *   items of 3 heads never take them; attn_avx2.c).
 * - GenuineIntel: fp32 / fp16, and for int8 / int4 only the line form on items of many heads. With ~15 GB/s of
 *   memory per core fp16 reads 0.85-1.22 of the read kernel with its far level and 0.79-0.92 without. The whole int8
 *   tiles slow items of few heads: SmolLM2's int8 arithmetic already needs most of a core there and the requests are
 *   extra instructions (int8 1.57-1.87x fp16 with them, 1.84-2.33x without; int4 likewise). Items of many heads
 *   (Llama) read the same with or without the whole tiles, and 7-10 % faster with the lines 16 KiB ahead (8 and 32 KiB
 *   within noise of 16).
 * - Every other AVX-512 CPU (Zen 4 with its AVX-512 shown) takes fp32 / fp16 and the whole int8 tiles: they lift
 *   fp16 and int8 there (attn_avx512_impl.h), and the line form is no faster. */
int aiollm_cpu_far_prefetch_default(void) {
    if (amd_family() >= 0x1au) return 0;
    if (!(aiollm_cpu_features() & AIOLLM_CPU_AVX512F)) return zen4() ? AIOLLM_FAR_FLOAT | AIOLLM_FAR_QUANTISED_LINES : 0;
    return intel() ? AIOLLM_FAR_FLOAT | AIOLLM_FAR_QUANTISED_LINES : AIOLLM_FAR_FLOAT | AIOLLM_FAR_QUANTISED;
}

/* How far ahead the AVX-512 kernel's int8 / int4 items ask L1 for tiles, in bytes of int8 tiles (int4 items ask for
 * as many tiles, of half the bytes; attn_avx512_impl.h). 8 KiB on AuthenticAMD family 0x19 with AVX-512 (Zen 4),
 * whose memory latency 4 KiB of compute does not cover: from DRAM, 2 threads, int8 runs 2-11 % more tokens/s at
 * 8 KiB than at 4 KiB (Llama's 2 KiB tiles ~11 %, SmolLM2's 1 KiB ones 2-7 %); 12 and 16 KiB are no better, 16
 * KiB worse on SmolLM2, and int4 on SmolLM2 reads best at 8 tiles too. 4 KiB elsewhere: on Zen 5 Llama reads 0.92 of
 * the read kernel 2 tiles ahead and 0.89 at 4, SmolLM2 0.93 at 4 and 0.92 at 2. */
int aiollm_cpu_int8_near_bytes(void) {
    return amd_family() == 0x19u && (aiollm_cpu_features() & AIOLLM_CPU_AVX512F) ? 8192 : 4096;
}

/* Whether this CPU is one on which an int8 GQA group of 1 runs the AVX2 kernel's MADD dot products instead of the
 * AVX-512 VNNI ones (dispatch.c, int8_group1_madd): AuthenticAMD family 0x1A (Zen 5) and later. Other CPUs keep
 * VNNI, as no other has been shown to read faster with MADD. */
int aiollm_cpu_int8_group1_madd(void) {
    return amd_family() >= 0x1au;
}
