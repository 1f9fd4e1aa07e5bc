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
#define KEEP(v) __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), \
                                      "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11))

__attribute__((target("avx2,fma"))) static double chains_avx2(int64_t n_iters) {
#define INIT(i) __m256 a##i = _mm256_set1_ps(0.001f * i);
#define STEP(i) a##i = _mm256_fmadd_ps(a##i, m, c);
#define SUM(i) s = _mm256_add_ps(s, a##i);
    const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-4f);
    CHAINS(INIT)
    for (int64_t i = 0; i < n_iters; i++) {
        CHAINS(STEP)
        KEEP();
    }
    __m256 s = _mm256_setzero_ps();
    CHAINS(SUM)
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    return lanes[0];
#undef INIT
#undef STEP
#undef SUM
}

__attribute__((target("avx512f,fma"))) static double chains_avx512(int64_t n_iters) {
#define INIT(i) __m512 a##i = _mm512_set1_ps(0.001f * i);
#define STEP(i) a##i = _mm512_fmadd_ps(a##i, m, c);
#define SUM(i) s = _mm512_add_ps(s, a##i);
    const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
    CHAINS(INIT)
    for (int64_t i = 0; i < n_iters; i++) {
        CHAINS(STEP)
        KEEP();
    }
    __m512 s = _mm512_setzero_ps();
    CHAINS(SUM)
    return _mm512_reduce_add_ps(s);
#undef INIT
#undef STEP
#undef SUM
}

static double chains_ref(int64_t n_iters) {
    float a[12];
    for (int j = 0; j < 12; j++) a[j] = 0.001f * j;
    for (int64_t i = 0; i < n_iters; i++)
        for (int j = 0; j < 12; j++) a[j] = fmaf(a[j], 0.999f, 1e-4f);
    double s = 0.0;
    for (int j = 0; j < 12; j++) s += a[j];
    return s;
}

typedef struct {
    int64_t n_iters;
    double (*fn)(int64_t);
    double sink[AIOLLM_MAX_THREADS];
} fma_job;

static void fma_task(void *ctx, int64_t item, int thread) {
    fma_job *j = (fma_job *)ctx;
    (void)item;
    j->sink[thread] += j->fn(j->n_iters);
}

int64_t aiollm_fma_peak(int64_t n_iters, int32_t n_threads) {
    if (n_iters < 1 || n_threads < 1 || n_threads > AIOLLM_MAX_THREADS) return -1;
    fma_job job = {.n_iters = n_iters, .fn = chains_ref};
    int64_t lanes = 12;
    const int isa = aiollm_isa();
    if (isa == AIOLLM_ISA_AVX512) job.fn = chains_avx512, lanes = 12 * 16;
    if (isa == AIOLLM_ISA_AVX2) job.fn = chains_avx2, lanes = 12 * 8;
    pool_run(n_threads, n_threads, fma_task, &job);
    return lanes * n_iters * n_threads;
}
