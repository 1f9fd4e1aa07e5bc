/* AVX-512 microkernels of the skinny GEMM: y[m, n] = x[m, :] . W[n, :] (+ r[m, n]).
 *
 * One tile is MR rows x NR panels of 16 columns, MR * NR zmm accumulators (8 x 3 = 24 at most). Per k
 * (fp32) or k pair (bf16), NR weight zmm are loaded once and each of the MR rows broadcasts its x element
 * (pair) into NR FMAs (vdpbf16ps for bf16). The tiles of a block walk the same NR panels, so the first
 * tile reads them from memory and the others from L2; meanwhile each tile prefetches its share of the next
 * block's panels into L2, so memory streams at a steady rate while later tiles compute.
 * MR and NR are compile-time constants in every instantiation (a switch picks one), so the accumulators
 * stay in registers. */
#include <immintrin.h>
#include <string.h>
#include "gemm_internal.h"

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define T512BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define INLINE static inline __attribute__((always_inline))

/* Columns of panel p that exist (the last panel may be partial). */
static inline __mmask16 panel_mask(const gemm_args *a, int32_t p) {
    const int32_t left = a->n - p * GEMM_NB;
    return left >= GEMM_NB ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
}

/* Prefetch lines [from, to) of pf into L2 (at most `per` of them; returns the new position). */
/* x element (pair) of row i at the current k: two row pointers and strides 1, 2, 3 rows keep every
 * address one base + index * scale, so the 8 rows need 4 registers. */
#define XROW(x0, x4, l1, l3, i) \
    (((i) < 4 ? (x0) : (x4)) + ((i) % 4 == 0 ? 0 : (i) % 4 == 1 ? (l1) : (i) % 4 == 2 ? 2 * (l1) : (l3)))

INLINE int64_t prefetch_some(const char *pf, int64_t from, int64_t to, int64_t per) {
    int64_t end = from + per < to ? from + per : to;
    for (; from < end; from++) _mm_prefetch(pf + from * 64, _MM_HINT_T1);
    return from;
}

T512 INLINE void tile_f32(const gemm_args *a, int64_t m0, int32_t p0, const int MR, const int NR, const char *pf,
                          int64_t pf_lines) {
    const int64_t K = a->k, ldx = a->ldx, ps = K * GEMM_NB;
    const float *x = (const float *)a->x + m0 * ldx;
    const float *w = (const float *)a->w + (int64_t)p0 * ps;
    const int64_t per = (pf_lines + K - 1) / K;
    int64_t pfi = 0;
    __m512 acc[GEMM_MR][GEMM_NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 3
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const float *x0 = x, *x4 = x + 4 * ldx, *wk = w;
    const int64_t l3 = 3 * ldx;
    for (int64_t k = 0; k < K; k++, x0++, x4++, wk += GEMM_NB) {
        __m512 b[GEMM_NR];
#pragma GCC unroll 3
        for (int j = 0; j < NR; j++) b[j] = _mm512_load_ps(wk + j * ps);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const __m512 xi = _mm512_set1_ps(*XROW(x0, x4, ldx, l3, i));
#pragma GCC unroll 3
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_fmadd_ps(xi, b[j], acc[i][j]);
        }
        if (pfi < pf_lines) pfi = prefetch_some(pf, pfi, pf_lines, per);
        if (a->pf_ahead) {
#pragma GCC unroll 3
            for (int j = 0; j < NR; j++) _mm_prefetch((const char *)(wk + j * ps + a->pf_ahead * GEMM_NB), _MM_HINT_T1);
        }
    }
    const float *r = (const float *)a->r;
    float *y = (float *)a->y;
#pragma GCC unroll 3
    for (int j = 0; j < NR; j++) {
        const __mmask16 mask = panel_mask(a, p0 + j);
        const int64_t col = (int64_t)(p0 + j) * GEMM_NB;
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            __m512 v = acc[i][j];
            if (r) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, r + (m0 + i) * a->ldr + col));
            _mm512_mask_storeu_ps(y + (m0 + i) * a->ldy + col, mask, v);
        }
    }
}

T512BF INLINE void tile_bf16(const gemm_args *a, int64_t m0, int32_t p0, const int MR, const int NR, const char *pf,
                             int64_t pf_lines) {
    const int64_t K = a->k, ldx = a->ldx, ps = (int64_t)a->kp * GEMM_NB, pairs = K / 2;
    const uint16_t *x = (const uint16_t *)a->x + m0 * ldx;
    const uint16_t *w = (const uint16_t *)a->w + (int64_t)p0 * ps;
    const int64_t per = (pf_lines + pairs) / (pairs + 1);
    int64_t pfi = 0;
    __m512 acc[GEMM_MR][GEMM_NR];
#pragma GCC unroll 8
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 3
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t *x0 = x, *x4 = x + 4 * ldx, *wk = w;
    const int64_t l3 = 3 * ldx;
    for (int64_t kk = 0; kk < pairs; kk++, x0 += 2, x4 += 2, wk += 2 * GEMM_NB) {
        __m512i b[GEMM_NR];
#pragma GCC unroll 3
        for (int j = 0; j < NR; j++) b[j] = _mm512_load_si512(wk + j * ps);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            int32_t pair;
            memcpy(&pair, XROW(x0, x4, ldx, l3, i), 4);
            const __m512i xi = _mm512_set1_epi32(pair);
#pragma GCC unroll 3
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xi, (__m512bh)b[j]);
        }
        if (pfi < pf_lines) pfi = prefetch_some(pf, pfi, pf_lines, per);
    }
    if (K & 1) { /* the last k alone: its pair partner is zero in x here and in the packed weights */
        __m512i b[GEMM_NR];
#pragma GCC unroll 3
        for (int j = 0; j < NR; j++) b[j] = _mm512_load_si512(w + j * ps + pairs * 2 * GEMM_NB);
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            const __m512i xi = _mm512_set1_epi32((int32_t)x[i * ldx + K - 1]);
#pragma GCC unroll 3
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xi, (__m512bh)b[j]);
        }
    }
    const uint16_t *r = (const uint16_t *)a->r;
    uint16_t *y = (uint16_t *)a->y;
#pragma GCC unroll 3
    for (int j = 0; j < NR; j++) {
        const __mmask16 mask = panel_mask(a, p0 + j);
        const int64_t col = (int64_t)(p0 + j) * GEMM_NB;
#pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            __m512 v = acc[i][j];
            if (r) {
                const __m256i rv = _mm256_maskz_loadu_epi16(mask, r + (m0 + i) * a->ldr + col);
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rv), 16)));
            }
            _mm256_mask_storeu_epi16(y + (m0 + i) * a->ldy + col, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

/* One instantiation per (MR, NR): the switch hands the tile compile-time sizes. */
#define CASES(TILE)                                                                   \
    switch ((rows - 1) * GEMM_NR + (np - 1)) {                                        \
    case 0: TILE(a, m, p0, 1, 1, pf + at * 64, share); break;                             \
    case 1: TILE(a, m, p0, 1, 2, pf + at * 64, share); break;                             \
    case 2: TILE(a, m, p0, 1, 3, pf + at * 64, share); break;                             \
    case 3: TILE(a, m, p0, 2, 1, pf + at * 64, share); break;                             \
    case 4: TILE(a, m, p0, 2, 2, pf + at * 64, share); break;                             \
    case 5: TILE(a, m, p0, 2, 3, pf + at * 64, share); break;                             \
    case 6: TILE(a, m, p0, 3, 1, pf + at * 64, share); break;                             \
    case 7: TILE(a, m, p0, 3, 2, pf + at * 64, share); break;                             \
    case 8: TILE(a, m, p0, 3, 3, pf + at * 64, share); break;                             \
    case 9: TILE(a, m, p0, 4, 1, pf + at * 64, share); break;                             \
    case 10: TILE(a, m, p0, 4, 2, pf + at * 64, share); break;                            \
    case 11: TILE(a, m, p0, 4, 3, pf + at * 64, share); break;                            \
    case 12: TILE(a, m, p0, 5, 1, pf + at * 64, share); break;                            \
    case 13: TILE(a, m, p0, 5, 2, pf + at * 64, share); break;                            \
    case 14: TILE(a, m, p0, 5, 3, pf + at * 64, share); break;                            \
    case 15: TILE(a, m, p0, 6, 1, pf + at * 64, share); break;                            \
    case 16: TILE(a, m, p0, 6, 2, pf + at * 64, share); break;                            \
    case 17: TILE(a, m, p0, 6, 3, pf + at * 64, share); break;                            \
    case 18: TILE(a, m, p0, 7, 1, pf + at * 64, share); break;                            \
    case 19: TILE(a, m, p0, 7, 2, pf + at * 64, share); break;                            \
    case 20: TILE(a, m, p0, 7, 3, pf + at * 64, share); break;                            \
    case 21: TILE(a, m, p0, 8, 1, pf + at * 64, share); break;                            \
    case 22: TILE(a, m, p0, 8, 2, pf + at * 64, share); break;                            \
    default: TILE(a, m, p0, 8, 3, pf + at * 64, share); break;                            \
    }

/* The block's prefetch lines are split evenly over its tiles. */
#define BLOCK_BODY(TILE)                                                              \
    const int64_t n_tiles = (m1 - m0 + GEMM_MR - 1) / GEMM_MR;                        \
    const int64_t share_max = (pf_lines + n_tiles - 1) / n_tiles;                     \
    int64_t at = 0;                                                                   \
    for (int64_t m = m0; m < m1; m += GEMM_MR) {                                      \
        const int rows = m1 - m < GEMM_MR ? (int)(m1 - m) : GEMM_MR;                   \
        const int64_t share = pf_lines - at < share_max ? pf_lines - at : share_max;  \
        CASES(TILE)                                                                   \
        at += share;                                                                  \
    }

T512 void gemm_block_f32_avx512(const gemm_args *a, int64_t m0, int64_t m1, int32_t p0, int32_t np, const char *pf,
                                int64_t pf_lines) {
    BLOCK_BODY(tile_f32)
}

T512BF void gemm_block_bf16_avx512(const gemm_args *a, int64_t m0, int64_t m1, int32_t p0, int32_t np,
                                   const char *pf, int64_t pf_lines) {
    BLOCK_BODY(tile_bf16)
}
