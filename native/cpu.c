/* CPU feature detection: the one place that asks the processor what it can do. */
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
