/* The skinny GEMM's entry points: CPU probe, weight packing, argument checks, and the split over threads.
 *
 * Threads share out blocks (GEMM_NR panels of every row) in an order each thread can predict, so it
 * prefetches its next block while it computes the current one. Rows are walked GEMM_M_CHUNK at a time
 * (the weights are read once per chunk; decode batches are one chunk). */
#include <cpuid.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdatomic.h>
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

/* Work units are (row chunk, block) pairs, unit u = chunk * n_blocks + block. Threads walk them in pairs
 * from both ends of a shared range (one front to back, one back to front, claiming one unit at a time
 * until they meet): each knows the unit it will take next and prefetches it, and a thread that starts
 * late (the pool wakes its workers from sleep) simply takes fewer units. */
typedef struct {
    gemm_args args;
    gemm_block_fn block;
    int64_t n_blocks, n_units, block_bytes, panel_bytes;
    int32_t n_walkers;
    _Atomic uint64_t ends[AIOLLM_MAX_THREADS / 2 + 1]; /* per range: next front unit (low 32 bits), end (high) */
} gemm_job;

/* Claim the next unit of range r from the front (or the back); -1 when the walkers have met. */
static int64_t claim(gemm_job *j, int64_t r, int back) {
    uint64_t v = atomic_load(&j->ends[r]);
    for (;;) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return -1;
        const uint64_t next = back ? ((uint64_t)(hi - 1) << 32) | lo : ((uint64_t)hi << 32) | (lo + 1);
        if (atomic_compare_exchange_weak(&j->ends[r], &v, next)) return back ? hi - 1 : lo;
    }
}

static void run_unit(const gemm_job *j, int64_t u, int64_t next) {
    const gemm_args *a = &j->args;
    const int64_t b = u % j->n_blocks, m0 = u / j->n_blocks * GEMM_M_CHUNK;
    const int64_t m1 = a->m - m0 < GEMM_M_CHUNK ? a->m : m0 + GEMM_M_CHUNK;
    const int32_t p0 = (int32_t)(b * GEMM_NR), np = a->n_panels - p0 < GEMM_NR ? a->n_panels - p0 : GEMM_NR;
    const char *pf = NULL;
    int64_t pf_lines = 0;
    if (next >= 0 && next < j->n_units && !a->pf_ahead) {
        const int64_t nb = next % j->n_blocks;
        const int64_t np_next = a->n_panels - nb * GEMM_NR < GEMM_NR ? a->n_panels - nb * GEMM_NR : GEMM_NR;
        pf = (const char *)a->w + nb * j->block_bytes;
        pf_lines = np_next * j->panel_bytes / 64;
    }
    j->block(a, m0, m1, p0, np, pf, pf_lines);
}

/* Walker `item`: range item / 2, from the front if item is even, else from the back. */
static void gemm_task(void *ctx, int64_t item, int thread) {
    gemm_job *j = (gemm_job *)ctx;
    const int back = (int)(item & 1);
    (void)thread;
    for (int64_t u = claim(j, item / 2, back); u >= 0;) {
        const int64_t next = claim(j, item / 2, back); /* claimed now, so it can be prefetched during u */
        run_unit(j, u, next);
        u = next;
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
    /* fp32 at small m: one or two tiles a block, so the weights stream straight into the FMAs. A prefetch of
     * the next block (spread over this block's few k steps) then leaves memory idle between blocks: SmolLM2's
     * step at batch 8 reads ~20 GB/s that way, ~26 with each tile prefetching its own panels 64 lines ahead.
     * The own-panel prefetch makes the step 1.3x faster at batch 8 and 1.1x at 16, but 0.92x at 32, where tiles
     * reuse the block from L2 and the next-block prefetch pays. */
    if (dtype == AIOLLM_DT_F32 && m <= GEMM_SMALL_M) job.args.pf_ahead = GEMM_PF_AHEAD;
    job.block_bytes = job.panel_bytes * GEMM_NR;
    job.n_blocks = (job.args.n_panels + GEMM_NR - 1) / GEMM_NR;
    job.n_units = job.n_blocks * (((int64_t)m + GEMM_M_CHUNK - 1) / GEMM_M_CHUNK);
    if (n_threads < 1) n_threads = 1;
    if (n_threads > AIOLLM_MAX_THREADS) n_threads = AIOLLM_MAX_THREADS;
    const int64_t walkers = n_threads < job.n_units ? n_threads : job.n_units, ranges = (walkers + 1) / 2;
    for (int64_t r = 0; r < ranges; r++) {
        const uint64_t lo = (uint64_t)(r * job.n_units / ranges), hi = (uint64_t)((r + 1) * job.n_units / ranges);
        atomic_init(&job.ends[r], (hi << 32) | lo);
    }
    gemm_run((int)walkers, walkers, gemm_task, &job);
    return AIOLLM_OK;
}
