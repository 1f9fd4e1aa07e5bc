/* Internal declarations of the skinny GEMM (not part of the cffi cdef).
 *
 * Packed weight layout (aiollm_gemm_pack), panels of GEMM_NB = 16 output columns, zero-padded past N:
 *   fp32:  panel p at float offset p * K * 16: [K][16], column j of the panel at lane j
 *   bf16:  panel p at element offset p * KP * 16, KP = K rounded up to 32: [KP / 2][16][2] (k pairs
 *          interleaved per column: one zmm is one vdpbf16ps operand, and 16 consecutive pairs are one AMX
 *          B tile of 1 KiB), zero-padded past K
 * A zmm of weights thus holds 16 columns, and a microkernel's MR x NR accumulators are MR rows x NR panels. */
#ifndef AIOLLM_GEMM_INTERNAL_H
#define AIOLLM_GEMM_INTERNAL_H
#include <stdint.h>
#include "aiollm_native.h"

#define GEMM_NB 16   /* columns per panel: one zmm of fp32 outputs */
#define GEMM_MR 8    /* rows per microkernel */
#define GEMM_NR 3    /* panels per microkernel (48 columns): 8 x 3 = 24 accumulators */
#define GEMM_KP_ALIGN 32
#define GEMM_M_CHUNK 256 /* rows whose x slice stays cache-resident while a thread walks its panels */
/* fp32 with at most this many rows is bound by the weights' read: each tile then prefetches its own panels
 * GEMM_PF_AHEAD k steps (cache lines per panel) ahead into L2 instead of the next block (see gemm.c) */
#define GEMM_SMALL_M 16
#define GEMM_PF_AHEAD 64

typedef struct {
    const void *x;
    int64_t ldx;
    const void *w;
    const void *r; /* residual, NULL for none */
    int64_t ldr;
    void *y;
    int64_t ldy;
    int32_t m, n, k, kp;
    int32_t n_panels;
    int32_t pf_ahead; /* fp32: k steps ahead at which a tile prefetches its own panels (0: none) */
} gemm_args;

/* Rows [m0, m1) x panels [p0, p0 + np) (np <= GEMM_NR) of y; pf/pf_lines: cache lines of the weights to
 * prefetch into L2 during this block (the next block's), spread over its k loop. */
typedef void (*gemm_block_fn)(const gemm_args *a, int64_t m0, int64_t m1, int32_t p0, int32_t np,
                              const char *pf, int64_t pf_lines);
void gemm_block_f32_avx512(const gemm_args *a, int64_t m0, int64_t m1, int32_t p0, int32_t np, const char *pf,
                           int64_t pf_lines);
void gemm_block_bf16_avx512(const gemm_args *a, int64_t m0, int64_t m1, int32_t p0, int32_t np, const char *pf,
                            int64_t pf_lines);
/* AMX (K % 32 == 0): 16-row tiles; gemm_amx_enable asks Linux for the tile state (1 if granted). */
void gemm_block_bf16_amx(const gemm_args *a, int64_t m0, int64_t m1, int32_t p0, int32_t np, const char *pf,
                         int64_t pf_lines);
int gemm_amx_enable(void);

/* Run fn(ctx, item, thread) for items [0, n_items) on n_threads threads: torch's OpenMP team if the process
 * has loaded one, else the library's pool (gemm_team.c); gemm_uses_team says which. */
typedef void (*pool_task_fn)(void *ctx, int64_t item, int thread);
void gemm_run(int n_threads, int64_t n_items, pool_task_fn fn, void *ctx);
int gemm_uses_team(void);

#endif
