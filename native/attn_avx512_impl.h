/* AVX-512 kernel body, included by attn_avx512.c (WITH_VNNI 0: fp32/fp16/int8 in fp32 math) and by
 * attn_avx512_vnni.c (WITH_VNNI 1: int8 and int4 K scores and P x V as int8 dot products). The includer defines T512 (the
 * target attribute) and WITH_VNNI; everything here is static, so each object file gets its own copy. */
#include <immintrin.h>
#include "attn_internal.h"

#define INLINE static inline __attribute__((always_inline))
#include "exp_avx512.h"


T512 INLINE __m512 ld16(int dt, const void *base, int64_t i) {
    if (dt == AIOLLM_DT_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    return _mm512_loadu_ps((const float *)base + i);
}

/* exp for x <= 0 (scores minus the running max); inputs below -87 give ~1e-38, masked lanes are zeroed. */
T512 INLINE __m512 exp512(__m512 x) { return exp512_clamped(x, -87.0f); }

/* exp for x <= 0 with ~1e-4 relative error: 2^(x log2 e) as 2^round * 2^frac, frac in [-0.5, 0.5] by a
 * degree-3 polynomial (least-squares fit of the relative error). Used on the int8 dot-product path only, where
 * the weights meet 8-bit V values and are themselves quantised to 8 bits per chunk (error 1/510 of the chunk's
 * largest weight): the full exp512 there costs ~7 % of an item. */
T512 INLINE __m512 exp512_fast(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(5.502930e-2f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4225682e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9325304e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.99995135f));
    return _mm512_scalef_ps(y, n);
}

/* Software prefetch, in tiles ahead in the item's order (heads inner, blocks outer; the block table gives the
 * address, which the hardware prefetcher cannot follow across blocks). fp16/fp32 prefetch on two levels, each
 * line asked for while the same line of the current tile is read (K lines in the score loop, V lines in the
 * V loop, so the requests are spread over the whole chunk): PF_NEAR tiles ahead into L1 and PF_FAR_BYTES of
 * each tile array ahead into L2 (in tiles: 4 for SmolLM2's 2 KiB fp16 tiles, 2 for Llama's 4 KiB ones). The L2
 * requests keep many more lines in flight than L1's fill buffers allow, and the L1 requests then hit L2. Against one
 * level (2 tiles ahead into L1, K and V lines both during the score loop) the two levels read 5-17 % more of the read
 * kernel's bandwidth from DRAM (the read kernel itself prefetches on the same two levels, attn_avx512.c; 1 and 2
 * threads, e.g. Llama 32 x 2048 0.95 against 0.81 of it on 1 thread). Far 4 and 8 tiles read alike, and a burst of
 * far prefetches at each item's start gains nothing.
 * int8 spreads its L1 requests attn_args.near_i8_bytes of int8 tiles ahead (whole tiles, at least one; per CPU,
 * aiollm_cpu_int8_near_bytes in native/cpu.c: 4 KiB, 8 KiB on Zen 4) over the score loop (below) and asks L2 for the
 * whole K and V tiles PF_FAR_I8 ahead (the same bytes ahead as fp16's far level) once per tile. Whether that far level
 * pays depends on the memory a core gets. Where it gives a core ~14 GB/s int8 is compute-bound and the prefetches are
 * extra instructions (SmolLM2 64 x 4096 int8 1.82x fp16's tokens/s with them, 1.97x without). Where it gives a core
 * 22-31 GB/s the L1 level alone leaves int8 latency-bound at 1.0-1.3x fp16, far below its in-L2 rate (~1.8x fp16),
 * and the far level lifts it to 1.5-1.9x (2 threads; 8-32 tiles ahead read alike).
 * Block tables that jump between single blocks (a shuffled pool) read ~20-25 % slower than contiguous ones (Zen 4,
 * SmolLM2 32 x 1600, 1 thread: 1.61-1.84 against 1.32 us per entry over 30 layers); runs of 2 blocks already recover
 * most, and prefetching farther or nearer does not help. PF_NEAR and PF_FAR_BYTES may be set at build time
 * for tuning (CFLAGS=-DPF_FAR_BYTES=n with build_ext --force: a changed flag alone rebuilds nothing).
 * The far distance is in bytes, not tiles, so that one distance suits both tile sizes: 8 tiles would put Llama 32 KiB
 * ahead, and 8 KiB reads 10-30 % faster there (Zen 4, Llama 64 x 1024 fp16, 1 and 2 threads; 16 KiB reads like 32).
 * For SmolLM2 8 and 16 KiB read alike (0.83-1.00 of the read over four shapes, shuffled tables too) and 4 KiB 5-20 %
 * slower. int8's far level stays in tiles: 8 and 16 tiles read alike, 4 up to 25 % slower.
 * The far level is issued only where it pays (attn_args.far_prefetch, aiollm_far_prefetch: per CPU, native/cpu.c).
 * On AMD Zen 5 (2 zmm FMAs per cycle) it costs more than it gives: from DRAM, 2 threads, fp16 reads 1.06-1.08 of the
 * read kernel without it and 0.98-1.03 with it (Llama 1 thread 1.16 against 1.00), int8 SmolLM2 256 x 4096 1.03
 * against 0.83. A far request every 128 / 256 / 1024 bytes instead of every line reads 0.93 / 0.97 / 1.01, so the
 * requests themselves are the cost; in L2 the int8 burst alone takes ~15 % of an item. The near level stays: without
 * it int8 falls to 0.79. */
#ifndef PF_NEAR
#define PF_NEAR 1
#endif
#ifndef PF_FAR_BYTES
#define PF_FAR_BYTES 8192
#endif
#define PF_FAR_I8 16
/* AIOLLM_FAR_QUANTISED_LINES: items of many heads (unphased) ask for each K and V line this many bytes of int8 tiles
 * ahead as the score loop reads the same line, as fp16 does (on Intel Llama int8 +7-10 %, native/cpu.c) */
#define PF_FAR_I8_LINES 16384
#define PHASE_I8_BYTES 4096 /* int8 items phase scores and V per chunk while their heads' K tiles fit (item) */

/* int8: each score-loop iteration that consumes `bytes` of this K tile asks for the same share of the K tile and
 * (pv set: unphased items) the V tile the near distance ahead, so one chunk's loop covers both next tiles. Asking
 * for a whole tile at once at the start of each tile would leave the memory idle during the compute (time = memory
 * time + compute time). */
static inline void spread_prefetch(const char **pk, const char **pv, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) {
        _mm_prefetch(*pk + o, _MM_HINT_T0);
        if (*pv) _mm_prefetch(*pv + o, _MM_HINT_T0);
    }
    *pk += bytes;
    if (*pv) *pv += bytes;
}

/* Scores of 16 tokens (chunk column `col` of a K tile) for GB q heads, NP partial sums each to hide FMA
 * latency (4 cycles, 2 ports: GB * NP >= 8 chains, else the chunk is latency-bound; 12 for GQA 3 run
 * faster than 6). Pointer walks, not index arithmetic: the loop body is loads and FMAs only. pk / pkf: the K
 * tiles PF_NEAR / PF_FAR ahead (NULL: none), walked in step with this tile's rows. */
T512 INLINE void scores(int dt, const char *kt, int64_t col, int64_t BS, int D, const float *qs, int GB, int NP,
                        __m512 *out, const char *pk, const char *pkf) {
    const int64_t es = dt == AIOLLM_DT_F32 ? 4 : dt == AIOLLM_DT_F16 ? 2 : 1, step = BS * es;
    const char *kp = kt + col * es;
    __m512 acc[4][8];
    for (int g = 0; g < GB; g++)
        for (int p = 0; p < NP; p++) acc[g][p] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += NP, kp += NP * step) {
        prefetch_walk(&pk, NP * step, _MM_HINT_T0);
        prefetch_walk(&pkf, NP * step, _MM_HINT_T1);
        for (int p = 0; p < NP; p++) {
            const __m512 k = ld16(dt, kp + p * step, 0);
            for (int g = 0; g < GB; g++)
                acc[g][p] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + d + p]), k, acc[g][p]);
        }
    }
    for (int g = 0; g < GB; g++) {
        __m512 s = acc[g][0];
        for (int p = 1; p < NP; p++) s = _mm512_add_ps(s, acc[g][p]);
        out[g] = s;
    }
}

/* int8 K without VNNI: byte j of each int32 lane of x, sign-extended, as floats (one dimension of 16 tokens out
 * of a K row, or one token of 16 dims out of a V row; layouts in attn_internal.h). */
T512 INLINE __m512 byte16(__m512i x, int j) {
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 24 - 8 * j), 24));
}

T512 INLINE void scores_i8(const char *kt, int64_t col, int64_t BS, int D, const float *qs, int GB, __m512 *out,
                           const char *pk, const char *pv) {
    __m512 acc[4][2];
    for (int g = 0; g < GB; g++) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    const char *kp = kt + col * 4;
    for (int d = 0; d < D; d += 4, kp += 4 * BS) {
        if (pk) spread_prefetch(&pk, &pv, 4 * BS);
        const __m512i row = _mm512_loadu_si512((const void *)kp);
        for (int j = 0; j < 4; j++) {
            const __m512 k = byte16(row, j);
            for (int g = 0; g < GB; g++)
                acc[g][j & 1] = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * D + d + j]), k, acc[g][j & 1]);
        }
    }
    for (int g = 0; g < GB; g++) out[g] = _mm512_add_ps(acc[g][0], acc[g][1]);
}

#if WITH_VNNI
/* Four int8-layout K rows (16 dims of 16 tokens, one 64-byte line each) at kp as vpdpbusd's unsigned operand: int8
 * bytes made unsigned (k + 128, xor 0x80); int4's two row pairs (each 64-byte line holds dims d..d+3 in the low
 * nibbles and d+4..d+7 in the high ones; attn_internal.h) unpacked by two nibble masks, their codes stored unsigned
 * (c + 8) already. The offsets come off again in quantise_q's corr. */
T512 INLINE void k_rows_u8(int dt, const char *kp, int64_t BS, __m512i *k) {
    if (dt == AIOLLM_DT_I4) {
        const __m512i nib = _mm512_set1_epi8(15);
        const __m512i p0 = _mm512_loadu_si512((const void *)kp), p1 = _mm512_loadu_si512((const void *)(kp + 4 * BS));
        k[0] = _mm512_and_si512(p0, nib), k[1] = _mm512_and_si512(_mm512_srli_epi16(p0, 4), nib);
        k[2] = _mm512_and_si512(p1, nib), k[3] = _mm512_and_si512(_mm512_srli_epi16(p1, 4), nib);
    } else {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int r = 0; r < 4; r++) k[r] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(kp + r * 4 * BS)), flip);
    }
}

/* int8 / int4 K: scores of 16 tokens as int8 dot products. One 64-byte row of an int8 K tile is 16 lanes of [4 dims
 * of one token] (the layout kv_write stores; int4 pairs two such rows in one line), made unsigned (k_rows_u8) and
 * multiplied into the q row, quantised per row to int8 (q4: 4 dims per int32); corr removes the offset again. */
T512 INLINE void scores_vnni(int dt, const char *kt, int64_t col, int64_t BS, int D, const int32_t *q4,
                             const int32_t *corr, const float *qsc, int GB, __m512 *out, const char *pk, const char *pv,
                             const char *pfk, const char *pfv) {
    /* 16 dims per iteration: 16 * BS bytes of an int8 tile, 8 * BS of an int4 one */
    const int64_t step = dt == AIOLLM_DT_I4 ? 8 * BS : 16 * BS;
    /* Four accumulators per head, named rather than indexed: a run-time index kept them on the stack
     * (a store and a reload around every vpdpbusd). D is a multiple of 16, so D / 4 is a multiple of 4. */
    __m512i acc0[4], acc1[4], acc2[4], acc3[4];
    for (int g = 0; g < GB; g++) acc0[g] = acc1[g] = acc2[g] = acc3[g] = _mm512_setzero_si512();
    const char *kp = kt + col * 4;
    for (int j = 0; j < D / 4; j += 4, kp += step) {
        if (pk) spread_prefetch(&pk, &pv, step);
        prefetch_walk(&pfk, step, _MM_HINT_T1);
        prefetch_walk(&pfv, step, _MM_HINT_T1);
        __m512i k[4];
        k_rows_u8(dt, kp, BS, k);
        for (int g = 0; g < GB; g++) {
            acc0[g] = _mm512_dpbusd_epi32(acc0[g], k[0], _mm512_set1_epi32(q4[g * (D / 4) + j]));
            acc1[g] = _mm512_dpbusd_epi32(acc1[g], k[1], _mm512_set1_epi32(q4[g * (D / 4) + j + 1]));
            acc2[g] = _mm512_dpbusd_epi32(acc2[g], k[2], _mm512_set1_epi32(q4[g * (D / 4) + j + 2]));
            acc3[g] = _mm512_dpbusd_epi32(acc3[g], k[3], _mm512_set1_epi32(q4[g * (D / 4) + j + 3]));
        }
    }
    for (int g = 0; g < GB; g++) {
        const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(_mm512_add_epi32(acc0[g], acc1[g]), _mm512_add_epi32(acc2[g], acc3[g])), _mm512_set1_epi32(corr[g]));
        out[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(qsc[g]));
    }
}
#endif

/* acc[g][16*(dv..dv+VC)] = alpha[g] * acc + sum over the chunk's nv tokens of pb[g][t] * V row t. pv / pvf:
 * the V tiles PF_NEAR / PF_FAR ahead (NULL: none); each token's slab of them is prefetched as it is read here. */
T512 INLINE void vaccum(int dt, const char *vt, int64_t row0, int nv, int D, int dv, int VC, const float *pb,
                        const float *alpha, float *acc, int GB, const char *pv, const char *pvf) {
    const int64_t es = dt == AIOLLM_DT_F32 ? 4 : dt == AIOLLM_DT_F16 ? 2 : 1, at = (row0 * D + dv * 16) * es;
    const char *vp = vt + at;
    if (pv) pv += at;
    if (pvf) pvf += at;
    __m512 r[4][8];
    int same = 1; /* after the first chunks the max rarely moves: no rescale, the loads feed the FMAs directly */
    for (int g = 0; g < GB; g++) same &= alpha[g] == 1.0f;
    for (int g = 0; g < GB; g++)
        for (int v = 0; v < VC; v++) {
            const __m512 x = _mm512_loadu_ps(acc + g * D + (dv + v) * 16);
            r[g][v] = same ? x : _mm512_mul_ps(x, _mm512_set1_ps(alpha[g]));
        }
    for (int t = 0; t < nv; t++, vp += D * es) {
        prefetch_walk(&pv, VC * 16 * es, _MM_HINT_T0);
        prefetch_walk(&pvf, VC * 16 * es, _MM_HINT_T1);
        if (pv) pv += D * es - VC * 16 * es;
        if (pvf) pvf += D * es - VC * 16 * es;
        __m512 w[4];
        for (int g = 0; g < GB; g++) w[g] = _mm512_set1_ps(pb[g * 16 + t]);
        for (int v = 0; v < VC; v++) {
            const __m512 x = ld16(dt, vp, v * 16);
            for (int g = 0; g < GB; g++) r[g][v] = _mm512_fmadd_ps(w[g], x, r[g][v]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int v = 0; v < VC; v++) _mm512_storeu_ps(acc + g * D + (dv + v) * 16, r[g][v]);
}

/* int8 V without VNNI, dims [16 dv, 16 (dv + VC)): each 64-byte row of the V tile holds 16 dims of 4 tokens. */
T512 INLINE void vaccum_i8(const char *vt, int64_t row0, int nv, int D, int dv, int VC, const float *pb,
                           const float *alpha, float *acc, int GB, const char *pf) {
    __m512 r[4][8];
    for (int g = 0; g < GB; g++)
        for (int v = 0; v < VC; v++)
            r[g][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + (dv + v) * 16), _mm512_set1_ps(alpha[g]));
    for (int t = 0; t < nv; t += 4) { /* weights past nv are 0 and the bytes there are never NaN */
        const char *vp = vt + (row0 + t) * D + dv * 64;
        for (int v = 0; v < VC; v++) {
            if (pf) _mm_prefetch(pf + (vp - vt) + v * 64, _MM_HINT_T0);
            const __m512i x = _mm512_loadu_si512((const void *)(vp + v * 64));
            for (int j = 0; j < 4; j++) {
                const __m512 y = byte16(x, j);
                for (int g = 0; g < GB; g++) r[g][v] = _mm512_fmadd_ps(_mm512_set1_ps(pb[g * 16 + t + j]), y, r[g][v]);
            }
        }
    }
    for (int g = 0; g < GB; g++)
        for (int v = 0; v < VC; v++) _mm512_storeu_ps(acc + g * D + (dv + v) * 16, r[g][v]);
}

#if WITH_VNNI
/* p (already times the V scales) of one chunk as u8, per q head scaled to its largest weight: pq[g][16 tokens],
 * psc[g] the scale back. */
T512 INLINE void quantise_p(const float *pb, int GB, uint8_t *pq, float *psc) {
    for (int g = 0; g < GB; g++) {
        const __m512 p = _mm512_load_ps(pb + g * 16);
        const float pm = _mm512_reduce_max_ps(p), inv = pm > 0.0f ? 255.0f / pm : 0.0f;
        _mm_store_si128((__m128i *)(pq + g * 16), _mm512_cvtusepi32_epi8(_mm512_cvtps_epu32(_mm512_mul_ps(p, _mm512_set1_ps(inv)))));
        psc[g] = pm / 255.0f;
    }
}

/* acc[g][16*(dv..dv+VC)] = alpha[g] * acc + psc[g] * ai[g]: one chunk's int32 V sums back into the fp32 output. */
T512 INLINE void rescale_add(__m512i ai[4][8], int D, int dv, int VC, const float *psc, const float *alpha, float *acc,
                             int GB) {
    for (int g = 0; g < GB; g++) {
        const __m512 al = _mm512_set1_ps(alpha[g]), sc = _mm512_set1_ps(psc[g]);
        const int same = alpha[g] == 1.0f; /* the max rarely moves: no rescale multiply */
        for (int v = 0; v < VC; v++) {
            float *f = acc + g * D + (dv + v) * 16;
            const __m512 x = _mm512_loadu_ps(f);
            _mm512_storeu_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[g][v]), sc, same ? x : _mm512_mul_ps(x, al)));
        }
    }
}

/* int8 / int4 V, dims [16 dv, 16 (dv + VC)): sum over the chunk's 16 tokens of p[g][t] * V row t as int8 dot products.
 * pf (phased items: the V tile the near distance ahead, else NULL): each line of it asked for as the same line of
 * this tile is read. Tokens past nv have p = 0 and contribute exact zeros.
 * int8: one 64-byte row of the V tile is 16 lanes of [one dim of 4 tokens] (kv_write's layout), so 4 u8 weights
 * broadcast as one int32 meet it directly. int4 (dv and VC even): a 4-token row is 2 * D bytes and its 64-byte line
 * k holds the int8 layout's slabs 2 k (low nibbles) and 2 k + 1 (high), so one load and two masks give two slabs;
 * the codes (c + 8) become signed (c) for vpdpbusd's signed operand. */
T512 INLINE void vaccum_vnni(int dt, const char *vt, int64_t row0, int D, int dv, int VC, const uint8_t *pq,
                             const float *psc, const float *alpha, float *acc, int GB, const char *pf) {
    const int i4 = dt == AIOLLM_DT_I4, step = i4 ? 2 : 1; /* slabs per 64-byte line */
    const __m512i nib = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    __m512i ai[4][8];
    for (int g = 0; g < GB; g++)
        for (int v = 0; v < VC; v++) ai[g][v] = _mm512_setzero_si512();
    for (int tg = 0; tg < 4; tg++) {
        const char *r = i4 ? vt + (row0 + tg * 4) * (D / 2) + dv * 32 : vt + (row0 + tg * 4) * D + dv * 64;
        __m512i w[4];
        for (int g = 0; g < GB; g++) {
            int32_t word;
            memcpy(&word, pq + g * 16 + tg * 4, 4);
            w[g] = _mm512_set1_epi32(word);
        }
        for (int v = 0; v < VC; v += step) {
            const int64_t at = v / step * 64; /* the line holding slab v */
            if (pf) _mm_prefetch(pf + (r - vt) + at, _MM_HINT_T0);
            const __m512i x = _mm512_loadu_si512((const void *)(r + at));
            if (i4) {
                const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(x, nib), eight);
                const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(x, 4), nib), eight);
                for (int g = 0; g < GB; g++) {
                    ai[g][v] = _mm512_dpbusd_epi32(ai[g][v], w[g], lo);
                    ai[g][v + 1] = _mm512_dpbusd_epi32(ai[g][v + 1], w[g], hi);
                }
            } else {
                for (int g = 0; g < GB; g++) ai[g][v] = _mm512_dpbusd_epi32(ai[g][v], w[g], x);
            }
        }
    }
    rescale_add(ai, D, dv, VC, psc, alpha, acc, GB);
}
#endif

/* First half of one 16-token chunk of one kv head: scores and the online-softmax update; the weights go to
 * pb (16 per q head) and the rescale factors to alpha, for chunk_values. m: running max per q head; l: 16 lane
 * partial sums of the softmax denominator per q head (l + g * 16). Prefetch: int8 spreads the K and V tiles
 * the near distance ahead (pk, pv) over the score loop; fp16/fp32 the K tiles PF_NEAR and PF_FAR ahead (pk, pv). */
T512 INLINE void chunk_scores(int dt, const char *kt, const uint16_t *ks, const uint16_t *vs, int c, int nv, int lo,
                              int G, int D, int BS, const float *qs, float *m, float *l,
                              const int32_t *q4, const int32_t *corr, const float *qsc, const char *pk, const char *pv,
                              const char *pfk, const char *pfv, float *pb, float *alpha) {
    /* lanes [lo, nv) of the chunk: past its last token and before a sliding window's first one are masked */
    const __mmask16 mask = (__mmask16)((nv == 16 ? 0xffffu : (1u << nv) - 1u) & ~((1u << lo) - 1u));
    (void)q4, (void)corr, (void)qsc; /* int8 dot-product inputs, used only WITH_VNNI */
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gb = G - g0 < 4 ? G - g0 : 4;
        __m512 s[4];
        const char *pkg = g0 ? NULL : pk, *pvg = g0 ? NULL : pv; /* the first q-head block carries the prefetch */
#if WITH_VNNI
        if (q4) {
            const int32_t *qg = q4 + g0 * (D / 4), *cg = corr + g0;
            switch (gb) {
            case 1: scores_vnni(dt, kt, c * 16, BS, D, qg, cg, qsc + g0, 1, s, pkg, pvg, g0 ? NULL : pfk, g0 ? NULL : pfv); break;
            case 2: scores_vnni(dt, kt, c * 16, BS, D, qg, cg, qsc + g0, 2, s, pkg, pvg, g0 ? NULL : pfk, g0 ? NULL : pfv); break;
            case 3: scores_vnni(dt, kt, c * 16, BS, D, qg, cg, qsc + g0, 3, s, pkg, pvg, g0 ? NULL : pfk, g0 ? NULL : pfv); break;
            default: scores_vnni(dt, kt, c * 16, BS, D, qg, cg, qsc + g0, 4, s, pkg, pvg, g0 ? NULL : pfk, g0 ? NULL : pfv); break;
            }
        } else
#endif
        if (dt == AIOLLM_DT_I8) {
            switch (gb) {
            case 1: scores_i8(kt, c * 16, BS, D, qs + g0 * D, 1, s, pkg, pvg); break;
            case 2: scores_i8(kt, c * 16, BS, D, qs + g0 * D, 2, s, pkg, pvg); break;
            case 3: scores_i8(kt, c * 16, BS, D, qs + g0 * D, 3, s, pkg, pvg); break;
            default: scores_i8(kt, c * 16, BS, D, qs + g0 * D, 4, s, pkg, pvg); break;
            }
        } else
        switch (gb) {
        case 1: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 1, 8, s, pkg, pvg); break;
        case 2: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 2, 4, s, pkg, pvg); break;
        case 3: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 3, 4, s, pkg, pvg); break;
        default: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 4, 4, s, pkg, pvg); break;
        }
        for (int g = 0; g < gb; g++) {
            __m512 sc = s[g];
            if (kv_quantised(dt)) sc = _mm512_mul_ps(sc, ld16(AIOLLM_DT_F16, ks, c * 16));
            sc = _mm512_mask_blend_ps(mask, _mm512_set1_ps(-INFINITY), sc);
            /* The max rarely moves after a few chunks: one compare decides, and only then the horizontal max
             * and the rescale run. l is kept as 16 lane sums (reduced once per item), so the common path has
             * no horizontal reduction at all (SmolLM2 256 x 4096: hot-cache compute 26 GB/s against 23 with a
             * reduction per chunk, DRAM-bound 10.0 against 8.9 GB/s on 1 thread, 19.0 against 16.2 on 2). */
            const float mo = m[g0 + g];
            float mn = mo, al = 1.0f;
            __m512 lv = _mm512_load_ps(l + (g0 + g) * 16);
            if (_mm512_cmp_ps_mask(sc, _mm512_set1_ps(mo), _CMP_GT_OQ)) {
                const float mx = _mm512_reduce_max_ps(sc);
                mn = mx > mo ? mx : mo;
                al = expf(mo - mn);
                lv = _mm512_mul_ps(lv, _mm512_set1_ps(al));
            }
            const __m512 xs = _mm512_sub_ps(sc, _mm512_set1_ps(mn));
            __m512 p = _mm512_maskz_mov_ps(mask, q4 ? exp512_fast(xs) : exp512(xs));
            _mm512_store_ps(l + (g0 + g) * 16, _mm512_add_ps(lv, p));
            m[g0 + g] = mn;
            alpha[g0 + g] = al;
            if (kv_quantised(dt)) p = _mm512_mul_ps(p, _mm512_maskz_mov_ps(mask, ld16(AIOLLM_DT_F16, vs, c * 16)));
            _mm512_store_ps(pb + (g0 + g) * 16, p);
        }
    }
}

/* Second half: V accumulation of the chunk with chunk_scores' weights pb and rescale factors alpha. pv / pvf:
 * the V tiles to prefetch near / far (see vaccum; int8 takes pv only, from phased items). */
T512 INLINE void chunk_values(int dt, const char *vt, int c, int nv, int G, int D, const float *pb, const float *alpha,
                              float *acc, int vnni, const char *pv, const char *pvf) {
/* call(VC, GB) over dims in slabs of 4 x 16 (8 x 16 for a single q head, then NW x 16: 1 for int8, 2 for int4,
 * whose lines hold slabs in pairs) and q heads in blocks of 4.
 * One q head takes 8: a 4-wide slab would read each 4-token row of an int8 V tile in two passes (bytes 0-255 of the
 * 4 rows, then 256-511 at head_dim 128), which the hardware prefetcher follows badly: with 8, Llama int8 64 x 1024
 * reads 0.89 of the read kernel from DRAM instead of 0.78 (Zen 5, 2 threads), 0.92 with the near distance of 4 KiB
 * below (in L2 up to ~5 % slower, within noise). */
#define VSLABS(call, NW)                                                                                         \
    for (int g0 = 0; g0 < G; g0 += 4) {                                                                          \
        const int gb = G - g0 < 4 ? G - g0 : 4;                                                                  \
        for (int dv = 0; dv < D / 16;) {                                                                         \
            const int vc = gb == 1 && D / 16 - dv >= 8 ? 8 : D / 16 - dv >= 4 ? 4 : NW;                          \
            switch (gb * 8 + vc) {                                                                               \
            case 16: call(8, 1); break;                                                                          \
            case 12: call(4, 1); break;                                                                          \
            case 20: call(4, 2); break;                                                                          \
            case 28: call(4, 3); break;                                                                          \
            case 36: call(4, 4); break;                                                                          \
            case 8 + NW: call(NW, 1); break;                                                                     \
            case 16 + NW: call(NW, 2); break;                                                                    \
            case 24 + NW: call(NW, 3); break;                                                                    \
            default: call(NW, 4); break;                                                                         \
            }                                                                                                    \
            dv += vc;                                                                                            \
        }                                                                                                        \
    }
    (void)vnni;
#if WITH_VNNI
    if (vnni) {
        uint8_t pq[AIOLLM_MAX_GROUP * 16] __attribute__((aligned(64)));
        float psc[AIOLLM_MAX_GROUP];
        quantise_p(pb, G, pq, psc);
#define VNNI_CALL(VC, GB) \
    vaccum_vnni(dt, vt, c * 16, D, dv, VC, pq + g0 * 16, psc + g0, alpha + g0, acc + g0 * D, GB, g0 ? NULL : pv)
        if (dt == AIOLLM_DT_I4) VSLABS(VNNI_CALL, 2)
        else VSLABS(VNNI_CALL, 1)
#undef VNNI_CALL
        return;
    }
#endif
    if (dt == AIOLLM_DT_I8) {
#define I8_CALL(VC, GB) vaccum_i8(vt, c * 16, nv, D, dv, VC, pb + g0 * 16, alpha + g0, acc + g0 * D, GB, g0 ? NULL : pv)
        VSLABS(I8_CALL, 1)
#undef I8_CALL
        return;
    }
#undef VSLABS
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gb = G - g0 < 4 ? G - g0 : 4;
        const float *pg = pb + g0 * 16, *ag = alpha + g0;
        const char *pvg = g0 ? NULL : pv, *pvfg = g0 ? NULL : pvf; /* the first q-head block carries the prefetch */
        float *accg = acc + g0 * D;
        int dv = 0;
        if (gb == 1)
            for (; dv + 8 <= D / 16; dv += 8) vaccum(dt, vt, c * 16, nv, D, dv, 8, pg, ag, accg, 1, pvg, pvfg);
        for (; dv + 4 <= D / 16; dv += 4) {
            switch (gb) {
            case 1: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 1, pvg, pvfg); break;
            case 2: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 2, pvg, pvfg); break;
            case 3: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 3, pvg, pvfg); break;
            default: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 4, pvg, pvfg); break;
            }
        }
        for (; dv < D / 16; dv++) {
            switch (gb) {
            case 1: vaccum(dt, vt, c * 16, nv, D, dv, 1, pg, ag, accg, 1, pvg, pvfg); break;
            case 2: vaccum(dt, vt, c * 16, nv, D, dv, 1, pg, ag, accg, 2, pvg, pvfg); break;
            case 3: vaccum(dt, vt, c * 16, nv, D, dv, 1, pg, ag, accg, 3, pvg, pvfg); break;
            default: vaccum(dt, vt, c * 16, nv, D, dv, 1, pg, ag, accg, 4, pvg, pvfg); break;
            }
        }
    }
}

/* q rows as int8 for the int8 dot products: per row scale max|q| / 127, 4 dims packed per int32, and
 * corr = offset * sum(q_int8) (the K bytes are offset to be unsigned: int8 by 128, int4's codes by 8). */
T512 INLINE void quantise_q(const float *qs, int rows, int D, int32_t offset, int32_t *q4, int32_t *corr, float *qsc) {
    /* Vectorised (16 dims at a time, D is a multiple of 16): a scalar lrintf / fmaxf loop goes through libm
     * calls, ~4 % of an item at context 1024. cvtps_epi32 rounds to nearest even, as lrintf does. */
    for (int r = 0; r < rows; r++) {
        const float *x = qs + r * D;
        __m512 mx = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_load_ps(x + d)));
        const float amax = _mm512_reduce_max_ps(mx), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m512i sum = _mm512_setzero_si512();
        for (int d = 0; d < D; d += 16) {
            const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(x + d), _mm512_set1_ps(inv)));
            sum = _mm512_add_epi32(sum, v);
            _mm_storeu_si128((__m128i *)(q4 + r * (D / 4) + d / 4), _mm512_cvtsepi32_epi8(v));
        }
        corr[r] = offset * _mm512_reduce_add_epi32(sum);
        qsc[r] = amax / 127.0f;
    }
}

/* Heads [h0, h1) of one sequence. Blocks outer, heads inner: the item walks each block's K region and V
 * region of its heads front to back (contiguous in the pool), so the hardware streams them; the next block
 * of each head is prefetched while the current one is processed. */
T512 INLINE void item(const attn_args *a, int32_t seq, int32_t h0, int32_t h1, int dt, int vnni, int Dc, int BSc) {
    const aiollm_kv_layer *kv = a->kv;
    const int G = a->group, D = Dc ? Dc : kv->head_dim, BS = BSc ? BSc : kv->block_size, NH = h1 - h0, GD = G * D;
    const int64_t es = dt == AIOLLM_DT_F32 ? 4 : dt == AIOLLM_DT_F16 ? 2 : 1;
    const int64_t tile_bytes = dt == AIOLLM_DT_I4 ? D * BS / 2 : D * BS * es; /* one (block, head) tile of K or V */
    const int32_t n = a->seq_lens[seq], n_used = (n + BS - 1) / BS;
    const int32_t *table = a->block_tables + (int64_t)seq * a->max_blocks;
    const float *q = a->q + seq * a->q_seq_stride + (int64_t)h0 * GD;
    float qs[AIOLLM_ITEM_FLOATS] __attribute__((aligned(64)));
    float acc[AIOLLM_ITEM_FLOATS] __attribute__((aligned(64)));
    float m[AIOLLM_ITEM_FLOATS / 16], l[AIOLLM_ITEM_FLOATS] __attribute__((aligned(64))); /* l: 16 lane sums per row */
    int32_t q4[AIOLLM_ITEM_FLOATS / 4], corr[AIOLLM_ITEM_FLOATS / 16];
    float qsc[AIOLLM_ITEM_FLOATS / 16], alpha[AIOLLM_ITEM_FLOATS / 16];
    float pb[AIOLLM_ITEM_FLOATS] __attribute__((aligned(64))); /* one chunk's softmax weights, 16 per q head */

    for (int r = 0; r < NH * G; r++) {
        m[r] = -INFINITY;
        _mm512_store_ps(l + r * 16, _mm512_setzero_ps());
    }
    for (int i = 0; i < NH * GD; i += 16) {
        _mm512_store_ps(qs + i, _mm512_mul_ps(_mm512_loadu_ps(q + i), _mm512_set1_ps(a->scale)));
        _mm512_store_ps(acc + i, _mm512_setzero_ps());
    }
    if (vnni) quantise_q(qs, NH * G, D, dt == AIOLLM_DT_I4 ? 8 : 128, q4, corr, qsc);
    /* int8 (compute-bound: half the bytes of fp16 per token) runs per chunk the scores of every head of the
     * item first, then every head's V accumulation: each head's V work waits on a softmax finished several heads
     * earlier, so the out-of-order core overlaps the heads' dependency chains (dot products -> max -> exp ->
     * weights -> V); so SmolLM2 in cache runs ~24 % faster on 1 thread. fp16/fp32 keep each head's scores and V
     * together: phased, they run ~5 % slower from DRAM (the K and V reads of a block would no longer alternate head
     * by head). Only while the item's K tiles of one chunk fit in PHASE_I8_BYTES: the V lines the score loop asks L1
     * for must survive the other heads' K reads until the V phase. Past that, phasing costs: Llama (32 heads x 2
     * KiB) 64 x 1024 / 64 x 4096 reads 0.73 / 0.82 of the read kernel phased against 0.81 / 0.90 not (Zen 4, from
     * DRAM, 2 threads; groups of 2 or 4 heads fall between), while SmolLM2 (3 x 1 KiB) phased is 0-6 % faster (in L2
     * and from DRAM). int4 (kv_quantised) is laid out and run as int8 is, in half the bytes. Running each chunk's V
     * phase one chunk later (after the next chunk's scores, two chunks' weights kept) would give the same results bit
     * for bit and no speed (in L2, SmolLM2 1 thread: 26.0 GB/s that way against 27.0; fp16 with each head's V after
     * the next head's scores reads the same both ways): the core already overlaps these chains, issue throughput
     * binds. */
    const int phased = kv_quantised(dt) && NH * tile_bytes <= PHASE_I8_BYTES;
    /* Phased items ask for each head's V tile ahead during its V phase (like fp16), not in the score loop: from
     * DRAM, SmolLM2 int8 256 x 4096 / 256 x 1024 then reads 0.98 / 1.04 of the read kernel against 0.90 / 0.95
     * (Zen 5, 2 threads; 1 thread +1 %); unphased Llama items keep both in the score loop (the other way round is 3 %
     * slower for them on 2 threads). */
    const char *vnext[PHASE_I8_BYTES / 16] = {0}; /* phased: NH * 16 * 16 <= NH * tile_bytes, D >= 16 (int4: 32) */
    /* fp16/fp32 far prefetch distance in tiles: PF_FAR_BYTES of one tile array ahead, past the near level */
    const int32_t far_tiles = (int32_t)(PF_FAR_BYTES / (D * BS * es));
    const int32_t pf_far = far_tiles > PF_NEAR ? far_tiles : PF_NEAR + 1;
    /* int8 / int4 near distance in tiles: near_i8_bytes of int8 tiles (int4 the same count of its half-size tiles:
     * the compute per tile, which must cover the memory's latency, is the same), at least one tile */
    const int32_t near_i8 = a->near_i8_bytes / (D * BS) > 1 ? a->near_i8_bytes / (D * BS) : 1;
    /* int8 / int4 far level: items of many heads (unphased) with AIOLLM_FAR_QUANTISED_LINES ask for each line
     * PF_FAR_I8_LINES of int8 tiles ahead in the score loop (tiles ahead here, past the near level; 0: not this form),
     * else with AIOLLM_FAR_QUANTISED every item asks for the whole tiles PF_FAR_I8 ahead once per tile */
    const int32_t lines_i8 = PF_FAR_I8_LINES / (D * BS) > near_i8 ? PF_FAR_I8_LINES / (D * BS) : near_i8 + 1;
    const int32_t far_lines = kv_quantised(dt) && !phased && (a->far_prefetch & AIOLLM_FAR_QUANTISED_LINES) ? lines_i8 : 0;
    const int far_tiles_i8 = !far_lines && (a->far_prefetch & AIOLLM_FAR_QUANTISED);
    const int32_t first = kv_first_token(kv, n); /* a sliding window's first token, else 0 */
    for (int32_t blk = first / BS; blk < n_used; blk++) {
        const int64_t block = table[blk];
        for (int c = 0; c * 16 < BS; c++) {
            const int nv = n - (blk * BS + c * 16), lo = first - (blk * BS + c * 16);
            if (nv <= 0) break;
            if (lo >= 16) continue;
            const int w = nv > 16 ? 16 : nv;
            for (int h = 0; h < NH; h++) {
                const char *kt = (const char *)kv->k + kv_tile_bytes(kv, dt, block, h0 + h);
                const uint16_t *ks = kv_quantised(dt) ? kv->k_scale + kv_scale_tile(kv, block, h0 + h) : NULL;
                const uint16_t *vs = kv_quantised(dt) ? kv->v_scale + kv_scale_tile(kv, block, h0 + h) : NULL;
                /* Tiles ahead in this item's order (heads inner). The K tiles are prefetched by the first chunk's
                 * score loop (it covers whole K rows); the V tiles by every chunk's V loop (its own rows). */
                const char *pk = NULL, *pv = NULL, *vn = NULL, *vf = NULL, *pfk = NULL, *pfv = NULL;
                const int32_t t0 = blk * NH + h;
                if (kv_quantised(dt)) {
                    const int32_t nblk = (t0 + near_i8) / NH, nh = h0 + (t0 + near_i8) % NH;
                    const int64_t next = nblk < n_used ? kv_tile_bytes(kv, dt, table[nblk], nh) : -1;
                    if (phased) vnext[h] = next >= 0 ? (const char *)kv->v + next : NULL;
                    if (c == 0 && next >= 0) {
                        pk = (const char *)kv->k + next, pv = phased ? NULL : (const char *)kv->v + next;
                        _mm_prefetch((const char *)(kv->k_scale + kv_scale_tile(kv, table[nblk], nh)), _MM_HINT_T0);
                        _mm_prefetch((const char *)(kv->v_scale + kv_scale_tile(kv, table[nblk], nh)), _MM_HINT_T0);
                    }
                    const int32_t lblk = (t0 + far_lines) / NH, lhead = h0 + (t0 + far_lines) % NH;
                    if (far_lines && c == 0 && lblk < n_used) {
                        const int64_t far = kv_tile_bytes(kv, dt, table[lblk], lhead);
                        pfk = (const char *)kv->k + far, pfv = (const char *)kv->v + far;
                    }
                    const int32_t fblk = (t0 + PF_FAR_I8) / NH, fh = h0 + (t0 + PF_FAR_I8) % NH;
                    if (far_tiles_i8 && c == 0 && fblk < n_used) {
                        const int64_t far = kv_tile_bytes(kv, dt, table[fblk], fh);
                        const char *fk = (const char *)kv->k + far, *fv = (const char *)kv->v + far;
                        prefetch_walk(&fk, tile_bytes, _MM_HINT_T1);
                        prefetch_walk(&fv, tile_bytes, _MM_HINT_T1);
                    }
                } else {
                    const int32_t nb = (t0 + PF_NEAR) / NH, fb = (t0 + pf_far) / NH;
                    if (nb < n_used) {
                        const int64_t at = kv_tile_bytes(kv, dt, table[nb], h0 + (t0 + PF_NEAR) % NH);
                        vn = (const char *)kv->v + at;
                        if (c == 0) pk = (const char *)kv->k + at;
                    }
                    if (a->far_prefetch && fb < n_used) {
                        const int64_t at = kv_tile_bytes(kv, dt, table[fb], h0 + (t0 + pf_far) % NH);
                        vf = (const char *)kv->v + at;
                        if (c == 0) pv = (const char *)kv->k + at; /* the far K tile rides in chunk_scores' pv */
                    }
                }
                float *mh = m + h * G, *lh = l + h * G * 16, *pbh = pb + h * G * 16, *alh = alpha + h * G;
                const int32_t *q4h = vnni ? q4 + h * G * (D / 4) : NULL, *ch = corr + h * G;
                const float *qh = qsc + h * G;
                chunk_scores(dt, kt, ks, vs, c, w, lo > 0 ? lo : 0, G, D, BS, qs + h * GD, mh, lh, q4h, ch, qh, pk, pv, pfk, pfv, pbh, alh);
                if (!phased)
                    chunk_values(dt, (const char *)kv->v + kv_tile_bytes(kv, dt, block, h0 + h), c, w, G, D, pbh, alh,
                                 acc + h * GD, vnni, vn, vf);
            }
            for (int h = 0; phased && h < NH; h++) {
                const char *vt = (const char *)kv->v + kv_tile_bytes(kv, dt, block, h0 + h);
                const float *pbh = pb + h * G * 16, *alh = alpha + h * G;
                chunk_values(dt, vt, c, w, G, D, pbh, alh, acc + h * GD, vnni, vnext[h], NULL);
            }
        }
    }
    for (int r = 0; r < NH * G; r++) {
        const float lr = _mm512_reduce_add_ps(_mm512_load_ps(l + r * 16));
        const __m512 inv = _mm512_set1_ps(lr > 0.0f ? 1.0f / lr : 0.0f);
        for (int d = 0; d < D; d += 16) _mm512_store_ps(acc + r * D + d, _mm512_mul_ps(_mm512_load_ps(acc + r * D + d), inv));
    }
    store_row_ref(a->out, ((int64_t)seq * a->n_q_heads + (int64_t)h0 * G) * D, acc, NH * GD, a->out_dtype);
}


/* The item specialised for the common shapes (head_dim 64 or 128, block_size 16): with both constant every
 * loop inside has a fixed trip count and is unrolled; other shapes take the general body. */
#define ITEM_SPECIALISED(name, dt, vnni)                                                        \
    T512 static void name(const attn_args *a, int32_t s, int32_t h0, int32_t h1) {              \
        const int D = a->kv->head_dim, BS = a->kv->block_size;                                  \
        if (D == 64 && BS == 16) item(a, s, h0, h1, dt, vnni, 64, 16);                          \
        else if (D == 128 && BS == 16) item(a, s, h0, h1, dt, vnni, 128, 16);                   \
        else item(a, s, h0, h1, dt, vnni, 0, 0);                                                \
    }
