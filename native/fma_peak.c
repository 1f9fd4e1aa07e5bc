/* The core's fp32 multiply-add peak: 12 independent FMA chains of the attention ISA's widest vector, nothing else.
 *
 * Why: GQA decode attention over fp16 KV needs 2 * group * head_dim multiply-adds per token and kv head, against 4 *
 * head_dim bytes read, i.e. 2 / group bytes per multiply-add. With a group of 3 (SmolLM2) a core's FMA ports can be as
 * slow as its share of memory: on a Zen 4 core whose AVX-512 a hypervisor hides (two ymm FMAs a cycle at 2.8 GHz) they
 * bound the kernel at ~30 GB/s of KV, one core's read. `python -m bench attention` turns this rate into that bound
 * (fma_bound_*), which no kernel doing those multiply-adds in fp32 can pass. 12 chains cover a 4-cycle FMA latency on
 * two ports with room; the empty asm keeps every accumulator in a register and every FMA in the loop. */
#include <immintrin.h>
#include "attn_internal.h"

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define KEEP() __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), \
                                     "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11))
/* The loop, for the vector type VEC_T with its SET1 and FMADD (defined around each use below): the asm after each
 * round makes every result live, so no FMA can be dropped or merged and nothing needs summing afterwards. */
#define INIT(i) VEC_T a##i = SET1(0.001f * i);
#define STEP(i) a##i = FMADD(a##i, m, c);
#define CHAINS_LOOP()                                       \
    const VEC_T m = SET1(0.999f), c = SET1(1e-4f);          \
    CHAINS(INIT)                                            \
    for (int64_t i = 0; i < n_iters; i++) {                 \
        CHAINS(STEP)                                        \
        KEEP();                                             \
    }

__attribute__((target("avx2,fma"))) static void chains_avx2(int64_t n_iters) {
#define VEC_T __m256
#define SET1 _mm256_set1_ps
#define FMADD _mm256_fmadd_ps
    CHAINS_LOOP()
#undef VEC_T
#undef SET1
#undef FMADD
}

__attribute__((target("avx512f,fma"))) static void chains_avx512(int64_t n_iters) {
#define VEC_T __m512
#define SET1 _mm512_set1_ps
#define FMADD _mm512_fmadd_ps
    CHAINS_LOOP()
#undef VEC_T
#undef SET1
#undef FMADD
}

static void chains_ref(int64_t n_iters) {
    float a[12];
    for (int j = 0; j < 12; j++) a[j] = 0.001f * j;
    for (int64_t i = 0; i < n_iters; i++)
        for (int j = 0; j < 12; j++) a[j] = fmaf(a[j], 0.999f, 1e-4f);
    __asm__ volatile("" : : "m"(a)); /* the results are used: the loop stays */
}

static void fma_task(void *ctx, int64_t item, int thread) {
    (void)item, (void)thread;
    const int64_t *job = (const int64_t *)ctx; /* [n_iters, isa] */
    if (job[1] == AIOLLM_ISA_AVX512) chains_avx512(job[0]);
    else if (job[1] == AIOLLM_ISA_AVX2) chains_avx2(job[0]);
    else chains_ref(job[0]);
}

int64_t aiollm_fma_peak(int64_t n_iters, int32_t n_threads) {
    if (n_iters < 1 || n_threads < 1 || n_threads > AIOLLM_MAX_THREADS) return -1;
    const int isa = aiollm_isa();
    int64_t job[2] = {n_iters, isa};
    pool_run(n_threads, n_threads, fma_task, job);
    return (isa == AIOLLM_ISA_AVX512 ? 12 * 16 : isa == AIOLLM_ISA_AVX2 ? 12 * 8 : 12) * n_iters * n_threads;
}
