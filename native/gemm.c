/* The skinny GEMM's entry points: CPU probe, weight packing, argument checks, and the split over threads.
 *
 * Threads split the panels into contiguous ranges of whole blocks (GEMM_NR panels), one range per thread,
 * so each thread knows which block comes next and prefetches it while it computes the current one. Rows
 * are walked GEMM_M_CHUNK at a time (the weights are read once per chunk; decode batches are one chunk). */
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <string.h>
#include "attn_internal.h"
#include "gemm_internal.h"

static int gemm_level = 0; /* 0 none, 1 fp32 (AVX-512F), 2 fp32 + bf16 (AVX512_BF16) */
static int gemm_amx = 0;   /* AMX-BF16 usable (CPU has it and Linux granted the tile state) */
static pthread_once_t gemm_once = PTHREAD_ONCE_INIT;

static void gemm_probe(void) {
    unsigned a, b, c, d;
    const uint32_t f = aiollm_cpu_features(), need = AIOLLM_CPU_AVX512F | AIOLLM_CPU_AVX512BW | AIOLLM_CPU_FMA;
    if ((f & need) != need) return;
    gemm_level = 1;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5))) gemm_level = 2; /* AVX512_BF16 */
    const unsigned amx = (1u << 22) | (1u << 24); /* AMX-BF16, AMX-TILE */
    if (gemm_level == 2 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & amx) == amx) gemm_amx = gemm_amx_enable();
}

int aiollm_gemm_supported(int32_t dtype) {
    pthread_once(&gemm_once, gemm_probe);
    if (dtype == AIOLLM_DT_F32) return gemm_level >= 1;
    if (dtype == AIOLLM_DT_BF16) return gemm_level >= 2;
    return 0;
}

static int64_t packed_k(int32_t k, int32_t dtype) {
    return dtype == AIOLLM_DT_BF16 ? ((int64_t)k + GEMM_KP_ALIGN - 1) / GEMM_KP_ALIGN * GEMM_KP_ALIGN : k;
}

int64_t aiollm_gemm_packed_bytes(int32_t n, int32_t k, int32_t dtype) {
    if (n < 1 || k < 1 || (dtype != AIOLLM_DT_F32 && dtype != AIOLLM_DT_BF16)) return -1;
    const int64_t panels = ((int64_t)n + GEMM_NB - 1) / GEMM_NB;
    return panels * packed_k(k, dtype) * GEMM_NB * (dtype == AIOLLM_DT_F32 ? 4 : 2);
}

int aiollm_gemm_pack(const void *w, int64_t ldw, int32_t n, int32_t k, int32_t dtype, void *packed) {
    if (!w || !packed || n < 1 || k < 1 || ldw < k) return AIOLLM_ERR_ARG;
    if (dtype != AIOLLM_DT_F32 && dtype != AIOLLM_DT_BF16) return AIOLLM_ERR_UNSUPPORTED;
    if (((uintptr_t)packed & 63) != 0) return AIOLLM_ERR_ARG;
    memset(packed, 0, (size_t)aiollm_gemm_packed_bytes(n, k, dtype));
    const int64_t kp = packed_k(k, dtype);
    for (int64_t col = 0; col < n; col++) {
        const int64_t p = col / GEMM_NB, lane = col % GEMM_NB;
        if (dtype == AIOLLM_DT_F32) {
            const float *src = (const float *)w + col * ldw;
            float *dst = (float *)packed + p * kp * GEMM_NB + lane;
            for (int64_t i = 0; i < k; i++) dst[i * GEMM_NB] = src[i];
        } else {
            const uint16_t *src = (const uint16_t *)w + col * ldw;
            uint16_t *dst = (uint16_t *)packed + p * kp * GEMM_NB + lane * 2;
            for (int64_t i = 0; i < k; i++) dst[(i / 2) * 2 * GEMM_NB + (i & 1)] = src[i];
        }
    }
    return AIOLLM_OK;
}

typedef struct {
    gemm_args args;
    gemm_block_fn block;
    int64_t n_blocks, n_ranges, block_bytes, panel_bytes;
} gemm_job;

/* Range `item`: blocks [b0, b1) of every row chunk; the block after each is prefetched while it runs. */
static void gemm_task(void *ctx, int64_t item, int thread) {
    const gemm_job *j = (const gemm_job *)ctx;
    const gemm_args *a = &j->args;
    const int64_t b0 = item * j->n_blocks / j->n_ranges, b1 = (item + 1) * j->n_blocks / j->n_ranges;
    const char *w = (const char *)a->w;
    (void)thread;
    for (int64_t m0 = 0; m0 < a->m; m0 += GEMM_M_CHUNK) {
        const int64_t m1 = a->m - m0 < GEMM_M_CHUNK ? a->m : m0 + GEMM_M_CHUNK;
        const int last_chunk = m1 == a->m;
        for (int64_t b = b0; b < b1; b++) {
            const int32_t p0 = (int32_t)(b * GEMM_NR);
            const int32_t np = a->n_panels - p0 < GEMM_NR ? a->n_panels - p0 : GEMM_NR;
            /* next block of this range (or its first again for the next row chunk) */
            const int64_t nb = b + 1 < b1 ? b + 1 : (last_chunk ? -1 : b0);
            const char *pf = nb < 0 ? NULL : w + nb * j->block_bytes;
            int64_t pf_lines = 0;
            if (nb >= 0) {
                const int64_t np_next = a->n_panels - nb * GEMM_NR < GEMM_NR ? a->n_panels - nb * GEMM_NR : GEMM_NR;
                pf_lines = np_next * j->panel_bytes / 64;
            }
            j->block(a, m0, m1, p0, np, pf, pf_lines);
        }
    }
}

int aiollm_gemm(const void *x, int64_t ldx, int32_t m, const void *packed, int32_t n, int32_t k, int32_t dtype,
                const void *residual, int64_t ldr, void *y, int64_t ldy, int32_t n_threads) {
    if (m < 0 || n < 1 || k < 1 || ldx < k || ldy < n || (residual && ldr < n)) return AIOLLM_ERR_ARG;
    if (!aiollm_gemm_supported(dtype)) return AIOLLM_ERR_UNSUPPORTED;
    if (m == 0) return AIOLLM_OK;
    if (!x || !packed || !y || ((uintptr_t)packed & 63) != 0) return AIOLLM_ERR_ARG;
    const int64_t kp = packed_k(k, dtype), elem = dtype == AIOLLM_DT_F32 ? 4 : 2;
    gemm_job job = {
        .args = {x, ldx, packed, residual, ldr, y, ldy, m, n, k, (int32_t)kp, (n + GEMM_NB - 1) / GEMM_NB},
        .block = dtype == AIOLLM_DT_F32 ? gemm_block_f32_avx512
                 : gemm_amx && k % 32 == 0 ? gemm_block_bf16_amx
                                             : gemm_block_bf16_avx512,
        .panel_bytes = kp * GEMM_NB * elem,
    };
    job.block_bytes = job.panel_bytes * GEMM_NR;
    job.n_blocks = (job.args.n_panels + GEMM_NR - 1) / GEMM_NR;
    if (n_threads < 1) n_threads = 1;
    job.n_ranges = n_threads < job.n_blocks ? n_threads : job.n_blocks;
    pool_run((int)job.n_ranges, job.n_ranges, gemm_task, &job);
    return AIOLLM_OK;
}
