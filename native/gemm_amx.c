/* AMX bf16 block of the skinny GEMM (Sapphire Rapids and later): the bf16 packed layout's 16 consecutive k
 * pairs of a panel are exactly one B tile (16 rows of 64 bytes), so weights load straight from the packed
 * buffer and x rows load straight from x (K a multiple of 32).
 *
 * Per 16-row tile of a block: one A tile (16 rows x 32 k of x), up to 3 B tiles (the block's panels) and
 * 3 C tiles (fp32 16 x 16), tmm0-2 = C, tmm3 = A, tmm4-6 = B. Per 32-wide k step: 4 tile loads, 3
 * TDPBF16PS. The C tiles go through a stack buffer to be rounded to bf16 (plus the residual) under the
 * column mask of a partial last panel. Like the AVX-512 blocks, each tile prefetches its share of the
 * next block's weights into L2. vdpbf16ps runs at half the fp32 FMA rate on these CPUs; AMX is what makes
 * bf16 faster than fp32 beyond a few rows. */
#define _GNU_SOURCE /* syscall() */
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "gemm_internal.h"

#define TAMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

int gemm_amx_enable(void) {
    /* Linux hands out the 8 KiB tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

TAMX static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 7; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = (uint8_t)(t <= 3 ? rows : 16); /* C and A: the tile's rows; B: 16 k pairs */
    }
    _tile_loadconfig(&cfg);
}

TAMX static void store_rows(const gemm_args *a, int64_t m0, int rows, int32_t p0, int np, float c[3][16][16]) {
    const uint16_t *r = (const uint16_t *)a->r;
    uint16_t *y = (uint16_t *)a->y;
    for (int j = 0; j < np; j++) {
        const int32_t left = a->n - (p0 + j) * GEMM_NB;
        const __mmask16 mask = left >= GEMM_NB ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        const int64_t col = (int64_t)(p0 + j) * GEMM_NB;
        for (int i = 0; i < rows; i++) {
            __m512 v = _mm512_loadu_ps(c[j][i]);
            if (r) {
                const __m256i rv = _mm256_maskz_loadu_epi16(mask, r + (m0 + i) * a->ldr + col);
                v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(rv), 16)));
            }
            _mm256_mask_storeu_epi16(y + (m0 + i) * a->ldy + col, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

TAMX void gemm_block_bf16_amx(const gemm_args *a, int64_t m0, int64_t m1, int32_t p0, int32_t np, const char *pf,
                              int64_t pf_lines) {
    const int64_t steps = a->kp / 32, ps = (int64_t)a->kp * GEMM_NB, ldx = a->ldx * 2;
    const uint16_t *w = (const uint16_t *)a->w + (int64_t)p0 * ps;
    const int64_t n_tiles = (m1 - m0 + 15) / 16, share_max = (pf_lines + n_tiles - 1) / n_tiles;
    float c[3][16][16];
    int configured = 0;
    int64_t at = 0;
    for (int64_t m = m0; m < m1; m += 16) {
        const int rows = m1 - m < 16 ? (int)(m1 - m) : 16;
        if (rows != configured) {
            configure(rows);
            configured = rows;
        }
        const int64_t share = pf_lines - at < share_max ? pf_lines - at : share_max;
        const int64_t per = (share + steps - 1) / steps;
        const char *x = (const char *)((const uint16_t *)a->x + m * a->ldx);
        int64_t pfi = 0;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t s = 0; s < steps; s++) {
            const uint16_t *ws = w + s * 512;
            _tile_loadd(3, x + s * 64, ldx);
            _tile_loadd(4, ws, 64);
            _tile_dpbf16ps(0, 3, 4);
            if (np > 1) {
                _tile_loadd(5, ws + ps, 64);
                _tile_dpbf16ps(1, 3, 5);
            }
            if (np > 2) {
                _tile_loadd(6, ws + 2 * ps, 64);
                _tile_dpbf16ps(2, 3, 6);
            }
            for (int64_t q = 0; q < per && pfi < share; q++, pfi++) _mm_prefetch(pf + (at + pfi) * 64, _MM_HINT_T1);
        }
        _tile_stored(0, c[0], 64);
        if (np > 1) _tile_stored(1, c[1], 64);
        if (np > 2) _tile_stored(2, c[2], 64);
        store_rows(a, m, rows, p0, np, c);
        at += share;
    }
    _tile_release();
}
