/* aiollm native kernel library: the one header, also used as the cffi cdef. */
#ifndef AIOLLM_NATIVE_H
#define AIOLLM_NATIVE_H
#include <stdint.h>
#include <stddef.h>

/* CPU features probed once at load; bit flags below. */
#define AIOLLM_CPU_AVX2 1
#define AIOLLM_CPU_FMA 2
#define AIOLLM_CPU_F16C 4
#define AIOLLM_CPU_AVX512F 8
#define AIOLLM_CPU_AVX512BW 16
uint32_t aiollm_cpu_features(void);

#endif
