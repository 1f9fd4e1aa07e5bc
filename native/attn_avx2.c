/* AVX2 + FMA + F16C path (FastDecode's choice, runs on any x86 of the last decade). Same structure as the
 * AVX-512 path: 16-token chunks, here as two ymm halves, K columns shared by up to 4 q heads of a group,
 * V rows by up to 4 heads, online softmax once per chunk. 16 ymm registers bound the unrolling. */
#include <immintrin.h>
#include "attn_internal.h"

#define T256 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

T256 INLINE __m256 ld8(int dt, const void *base, int64_t i) {
    if (dt == AIOLLM_DT_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)));
    return _mm256_loadu_ps((const float *)base + i);
}

T256 INLINE __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* exp for x <= 0 with ~1e-4 relative error, as the AVX-512 kernel's exp512_fast: 2^(x log2 e) as 2^n * 2^f, f in
 * [-0.5, 0.5] by its degree-3 polynomial. n comes from one add of M = 1.5 * 2^23 + 127, which rounds x log2 e to an
 * integer and leaves n + 127 in the sum's low mantissa bits, to shift into the exponent of 2^n (n + 127 lies in
 * 1..127 here). Used on the int8 / int4 dot-product path only, where the weights are quantised to 7 bits per chunk
 * next: the full exp256 costs ~18 % of a SmolLM2 int8 item in L2 (1 thread, AVX2 on a Zen 4 core). */
T256 INLINE __m256 exp256_fast(__m256 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f + 127.0f);
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(1.44269504088896341f));
    const __m256 u = _mm256_add_ps(t, magic);
    const __m256 f = _mm256_sub_ps(t, _mm256_sub_ps(u, magic));
    __m256 y = _mm256_set1_ps(5.502930e-2f);
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.4225682e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.9325304e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(0.99995135f));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_castps_si256(u), 23)));
}

T256 INLINE float hmax8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

T256 INLINE float hsum8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* Software prefetch as on the AVX-512 path (attn_avx512_impl.h): each line of the tile PF_NEAR tiles ahead in the
 * item's order asked into L1 while the same line of the current tile is read, so the requests are spread over
 * the chunk's compute, and for fp16/fp32, where attn_args.far_prefetch says so, the tile PF_FAR_BYTES of one tile
 * array ahead into L2. Asking for the whole next tile at once at the start of each tile instead leaves the memory
 * idle during the compute: on a core without AVX-512 (Zen 3 class, from DRAM, 2 threads) the spread requests read
 * fp16 SmolLM2 256 x 1024 at 0.66-0.82 of the read kernel against 0.52, Llama 64 x 1024 at 0.82-0.98 against 0.55.
 * On such a core the far level costs more than it gives (SmolLM2 256 x 1024 0.64-0.76 of the read kernel with it,
 * 0.72-0.82 without; an int8 far level of whole tiles, 16 ahead once per tile as on AVX-512, brings int8 from
 * 1.51-1.70x fp16's tokens/s down to 1.10-1.20x), so without AVX-512 it defaults off (native/cpu.c), except on a Zen
 * 4 core whose AVX-512 a hypervisor hides, whose memory it keeps busy (fp16 up to twice as fast); int8 / int4 dot
 * products take only the line form below, on items of many heads. */
#ifndef PF_NEAR
#define PF_NEAR 1
#endif
#ifndef PF_FAR_BYTES
#define PF_FAR_BYTES 8192
#endif
/* int8 / int4 far level, AIOLLM_FAR_QUANTISED_LINES on items of many heads (Llama): each K and V line this many bytes
 * of int8 tiles ahead into L2 as the score loop reads the same line, as on the AVX-512 kernel. Items of few heads
 * (SmolLM2's 3) never take it: their int8 arithmetic binds, and requests are pure cost there. On a Zen 4 core whose
 * AVX-512 a hypervisor hides the lines lift Llama's int8 from 0.9-1.55x fp16's tokens/s to 1.4-1.85x (from DRAM, 1
 * and 2 threads). Whole tiles 16 ahead once per tile on every item (the AVX-512 kernel's other form) give Llama as
 * much but slow SmolLM2 256 x 1024 by ~15 % (int8 1.04x fp16 against 1.22x), hence the lines, on items of many
 * heads only. */
#define PF_FAR_I8_LINES 16384
#define MANY_HEADS_I8_BYTES 4096 /* items whose int8 K tiles of one chunk pass this are of many heads */

/* Scores of 16 tokens (chunk column `col` of a K tile) as two ymm halves for GB q heads, NP partial sums per
 * half: FMA latency 4 cycles on 2 ports wants >= 8 independent chains (GB * NP * 2). pk / pkf: the K tiles to
 * prefetch near / far (NULL: none), walked in step with this tile's rows. */
T256 INLINE void scores(int dt, const char *kt, int64_t col, int64_t BS, int D, const float *qs, int GB, int NP,
                        __m256 *lo, __m256 *hi, const char *pk, const char *pkf) {
    const int64_t es = dt == AIOLLM_DT_F32 ? 4 : dt == AIOLLM_DT_F16 ? 2 : 1, step = BS * es;
    const char *kp = kt + col * es;
    __m256 a0[4][4], a1[4][4];
    for (int g = 0; g < GB; g++)
        for (int p = 0; p < NP; p++) a0[g][p] = a1[g][p] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += NP, kp += NP * step) {
        /* pk / pkf are loop-invariant and indexed like this tile's rows, so the compiler unswitches the loop on
         * them and each request is one instruction (a pointer walk tested and advanced a pointer per request) */
        for (int64_t o = 0; o < NP * step; o += 64) {
            if (pk) _mm_prefetch(pk + d * step + o, _MM_HINT_T0);
            if (pkf) _mm_prefetch(pkf + d * step + o, _MM_HINT_T1);
        }
        for (int p = 0; p < NP; p++) {
            const __m256 k0 = ld8(dt, kp + p * step, 0), k1 = ld8(dt, kp + p * step, 8);
            for (int g = 0; g < GB; g++) {
                const __m256 qv = _mm256_broadcast_ss(qs + g * D + d + p);
                a0[g][p] = _mm256_fmadd_ps(qv, k0, a0[g][p]);
                a1[g][p] = _mm256_fmadd_ps(qv, k1, a1[g][p]);
            }
        }
    }
    for (int g = 0; g < GB; g++) {
        lo[g] = a0[g][0];
        hi[g] = a1[g][0];
        for (int p = 1; p < NP; p++) {
            lo[g] = _mm256_add_ps(lo[g], a0[g][p]);
            hi[g] = _mm256_add_ps(hi[g], a1[g][p]);
        }
    }
}

/* acc[g][8*(dv..dv+VC)] = alpha[g] * acc + sum over nv tokens of pb[g][t] * V row t. pv / pvf: the V tiles to
 * prefetch near / far (NULL: none); each token's slab of them is asked for as the same slab here is read. */
T256 INLINE void vaccum(int dt, const char *vt, int64_t row0, int nv, int D, int dv, int VC, const float *pb,
                        const float *alpha, float *acc, int GB, const char *pv, const char *pvf) {
    const int64_t es = dt == AIOLLM_DT_F32 ? 4 : dt == AIOLLM_DT_F16 ? 2 : 1, at = (row0 * D + dv * 8) * es;
    const char *vp = vt + at;
    if (pv) pv += at;
    if (pvf) pvf += at;
    __m256 r[4][8];
    int same = 1; /* after the first chunks the max rarely moves: no rescale, the loads feed the FMAs directly */
    for (int g = 0; g < GB; g++) same &= alpha[g] == 1.0f;
    for (int g = 0; g < GB; g++)
        for (int v = 0; v < VC; v++) {
            const __m256 x = _mm256_loadu_ps(acc + g * D + (dv + v) * 8);
            r[g][v] = same ? x : _mm256_mul_ps(x, _mm256_set1_ps(alpha[g]));
        }
    for (int t = 0; t < nv; t++, vp += D * es) {
        for (int64_t o = 0; o < VC * 8 * es; o += 64) {
            if (pv) _mm_prefetch(pv + t * D * es + o, _MM_HINT_T0);
            if (pvf) _mm_prefetch(pvf + t * D * es + o, _MM_HINT_T1);
        }
        for (int v = 0; v < VC; v++) {
            const __m256 x = ld8(dt, vp, v * 8);
            for (int g = 0; g < GB; g++) r[g][v] = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + g * 16 + t), x, r[g][v]);
        }
    }
    for (int g = 0; g < GB; g++)
        for (int v = 0; v < VC; v++) _mm256_storeu_ps(acc + g * D + (dv + v) * 8, r[g][v]);
}

/* Byte j of each int32 lane of x, sign-extended, as floats: one dimension (K) or one token (V) out of the
 * int8 layout's 4-byte groups. */
T256 INLINE __m256 byte8(__m256i x, int j) {
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 24 - 8 * j), 24));
}

/* int8 scores of 16 tokens: each 64-byte row of the K tile holds 4 dims of the 16 tokens (attn_internal.h).
 * pk / pv: the K and V tiles to prefetch near (NULL: none), spread over the loop's iterations. */
T256 INLINE void scores_i8(const char *kt, int64_t col, int64_t BS, int D, const float *qs, int GB, __m256 *lo,
                           __m256 *hi, const char *pk, const char *pv) {
    __m256 a0[4][2], a1[4][2];
    for (int g = 0; g < GB; g++)
        for (int p = 0; p < 2; p++) a0[g][p] = a1[g][p] = _mm256_setzero_ps();
    const char *kp = kt + col * 4;
    for (int d = 0; d < D; d += 4, kp += 4 * BS) {
        prefetch_walk(&pk, 4 * BS, _MM_HINT_T0);
        prefetch_walk(&pv, 4 * BS, _MM_HINT_T0);
        const __m256i r0 = _mm256_loadu_si256((const __m256i *)kp), r1 = _mm256_loadu_si256((const __m256i *)(kp + 32));
        for (int j = 0; j < 4; j++) {
            const __m256 k0 = byte8(r0, j), k1 = byte8(r1, j);
            for (int g = 0; g < GB; g++) {
                const __m256 qv = _mm256_broadcast_ss(qs + g * D + d + j);
                a0[g][j & 1] = _mm256_fmadd_ps(qv, k0, a0[g][j & 1]);
                a1[g][j & 1] = _mm256_fmadd_ps(qv, k1, a1[g][j & 1]);
            }
        }
    }
    for (int g = 0; g < GB; g++) {
        lo[g] = _mm256_add_ps(a0[g][0], a0[g][1]);
        hi[g] = _mm256_add_ps(a1[g][0], a1[g][1]);
    }
}

/* int8 V, all D dims for GB heads: each 64-byte row of the V tile holds 16 dims of 4 tokens; tokens past nv have
 * weight 0 (their bytes are never NaN). */
T256 INLINE void vaccum_i8(const char *vt, int64_t row0, int nv, int D, const float *pb, const float *alpha, float *acc,
                           int GB) {
    for (int dv = 0; dv < D; dv += 16) {
        __m256 r[4][2];
        for (int g = 0; g < GB; g++)
            for (int v = 0; v < 2; v++)
                r[g][v] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + dv + v * 8), _mm256_set1_ps(alpha[g]));
        for (int t = 0; t < nv; t += 4) {
            const char *vp = vt + (row0 + t) * D + dv * 4;
            const __m256i x0 = _mm256_loadu_si256((const __m256i *)vp), x1 = _mm256_loadu_si256((const __m256i *)(vp + 32));
            for (int j = 0; j < 4; j++) {
                const __m256 v0 = byte8(x0, j), v1 = byte8(x1, j);
                for (int g = 0; g < GB; g++) {
                    const __m256 w = _mm256_broadcast_ss(pb + g * 16 + t + j);
                    r[g][0] = _mm256_fmadd_ps(w, v0, r[g][0]);
                    r[g][1] = _mm256_fmadd_ps(w, v1, r[g][1]);
                }
            }
        }
        for (int g = 0; g < GB; g++)
            for (int v = 0; v < 2; v++) _mm256_storeu_ps(acc + g * D + dv + v * 8, r[g][v]);
    }
}

/* int8 dot products (int8 path MADD): AVX2 has no vpdpbusd, so one u8 x s8 product of 4 bytes is vpmaddubsw
 * (pairs to int16) then vpmaddwd by ones (pairs to int32). The unsigned operand is |k| with k's sign moved onto
 * q (vpsignb), or the weights, which are quantised to 0..127 (not 255): every int16 pair sum stays below 2^15
 * (2 * 128 * 127 at most), so nothing saturates and the integer sums are exact. */

/* q rows as int8: per row scale max|q| / 127, 4 dims per int32 (q4), qsc the scale back, and corr = 8 * sum(q)
 * (int4's codes are offset by 8; NULL: not wanted). cvtps2dq rounds to nearest even, as lrintf does. */
T256 INLINE void quantise_q(const float *qs, int rows, int D, int32_t *q4, int32_t *corr, float *qsc) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int r = 0; r < rows; r++) {
        const float *x = qs + r * D;
        __m256 mx = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_load_ps(x + d), abs_mask));
        const float amax = hmax8(mx), inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i sum = _mm256_setzero_si256();
        for (int d = 0; d < D; d += 8) {
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(x + d), _mm256_set1_ps(inv)));
            sum = _mm256_add_epi32(sum, v);
            const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v, v), _mm256_setzero_si256());
            q4[r * (D / 4) + d / 4] = _mm256_extract_epi32(b, 0); /* dims d..d+3 in lane 0, d+4..d+7 in lane 1 */
            q4[r * (D / 4) + d / 4 + 1] = _mm256_extract_epi32(b, 4);
        }
        qsc[r] = amax / 127.0f;
        if (corr) {
            int32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, sum);
            corr[r] = 8 * (lanes[0] + lanes[1] + lanes[2] + lanes[3] + lanes[4] + lanes[5] + lanes[6] + lanes[7]);
        }
    }
}

/* int8 scores of 16 tokens as dot products: each 32-byte half of a K tile row is 8 lanes of [4 dims of one token]
 * (attn_internal.h). pk / pv: the K and V tiles to prefetch near (NULL: none), spread over the iterations. */
T256 INLINE void scores_madd(const char *kt, int64_t col, int64_t BS, int D, const int32_t *q4, const float *qsc,
                             int GB, __m256 *lo, __m256 *hi, const char *pk, const char *pv, const char *pfk,
                             const char *pfv) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i a0[4], a1[4];
    for (int g = 0; g < GB; g++) a0[g] = a1[g] = _mm256_setzero_si256();
    const char *kp = kt + col * 4;
    for (int j = 0; j < D / 4; j++, kp += 4 * BS) {
        prefetch_walk(&pk, 4 * BS, _MM_HINT_T0);
        prefetch_walk(&pv, 4 * BS, _MM_HINT_T0);
        prefetch_walk(&pfk, 4 * BS, _MM_HINT_T1);
        prefetch_walk(&pfv, 4 * BS, _MM_HINT_T1);
        const __m256i k0 = _mm256_loadu_si256((const __m256i *)kp), k1 = _mm256_loadu_si256((const __m256i *)(kp + 32));
        const __m256i u0 = _mm256_abs_epi8(k0), u1 = _mm256_abs_epi8(k1);
        for (int g = 0; g < GB; g++) {
            const __m256i qb = _mm256_set1_epi32(q4[g * (D / 4) + j]);
            a0[g] = _mm256_add_epi32(a0[g], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_sign_epi8(qb, k0)), ones));
            a1[g] = _mm256_add_epi32(a1[g], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_sign_epi8(qb, k1)), ones));
        }
    }
    for (int g = 0; g < GB; g++) {
        lo[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(a0[g]), _mm256_set1_ps(qsc[g]));
        hi[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(a1[g]), _mm256_set1_ps(qsc[g]));
    }
}

/* int4 scores of 16 tokens: each K tile row pair holds two int8-layout rows in its low and high nibbles
 * (attn_internal.h), stored unsigned (c + 8), so they meet q directly (vpmaddubsw's unsigned operand, no sign
 * moves) and corr = 8 * sum(q) removes the offset. The two rows' int16 pair sums are added before vpmaddwd
 * (|sum| <= 4 * 15 * 127, no saturation). */
T256 INLINE void scores_madd4(const char *kt, int64_t col, int64_t BS, int D, const int32_t *q4, const int32_t *corr,
                              const float *qsc, int GB, __m256 *lo, __m256 *hi, const char *pk, const char *pv,
                              const char *pfk, const char *pfv) {
    const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(15);
    __m256i a0[4], a1[4];
    for (int g = 0; g < GB; g++) a0[g] = a1[g] = _mm256_setzero_si256();
    const char *kp = kt + col * 4;
    for (int j = 0; j < D / 4; j += 2, kp += 4 * BS) {
        prefetch_walk(&pk, 4 * BS, _MM_HINT_T0);
        prefetch_walk(&pv, 4 * BS, _MM_HINT_T0);
        prefetch_walk(&pfk, 4 * BS, _MM_HINT_T1);
        prefetch_walk(&pfv, 4 * BS, _MM_HINT_T1);
        const __m256i p0 = _mm256_loadu_si256((const __m256i *)kp), p1 = _mm256_loadu_si256((const __m256i *)(kp + 32));
        const __m256i k00 = _mm256_and_si256(p0, nib), k01 = _mm256_and_si256(_mm256_srli_epi16(p0, 4), nib);
        const __m256i k10 = _mm256_and_si256(p1, nib), k11 = _mm256_and_si256(_mm256_srli_epi16(p1, 4), nib);
        for (int g = 0; g < GB; g++) {
            const __m256i qa = _mm256_set1_epi32(q4[g * (D / 4) + j]), qb = _mm256_set1_epi32(q4[g * (D / 4) + j + 1]);
            a0[g] = _mm256_add_epi32(a0[g], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(k00, qa), _mm256_maddubs_epi16(k01, qb)), ones));
            a1[g] = _mm256_add_epi32(a1[g], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(k10, qa), _mm256_maddubs_epi16(k11, qb)), ones));
        }
    }
    for (int g = 0; g < GB; g++) {
        const __m256i cg = _mm256_set1_epi32(corr[g]);
        lo[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a0[g], cg)), _mm256_set1_ps(qsc[g]));
        hi[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(a1[g], cg)), _mm256_set1_ps(qsc[g]));
    }
}

/* One chunk's weights (already times the V scales, >= 0) as u8 0..127 per q head, scaled to its largest:
 * pw[g * 4 + tg] holds tokens 4 tg .. 4 tg + 3, psc[g] the scale back. */
T256 INLINE void quantise_p(const float *pb, int GB, int32_t *pw, float *psc) {
    for (int g = 0; g < GB; g++) {
        const __m256 p0 = _mm256_load_ps(pb + g * 16), p1 = _mm256_load_ps(pb + g * 16 + 8);
        const float pm = hmax8(_mm256_max_ps(p0, p1)), inv = pm > 0.0f ? 127.0f / pm : 0.0f;
        const __m256 iv = _mm256_set1_ps(inv);
        const __m256i w16 = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(p0, iv)), _mm256_cvtps_epi32(_mm256_mul_ps(p1, iv)));
        const __m256i b = _mm256_packus_epi16(w16, w16); /* words: 0 tokens 0-3, 1: 8-11, 4: 4-7, 5: 12-15 */
        pw[g * 4] = _mm256_extract_epi32(b, 0);
        pw[g * 4 + 1] = _mm256_extract_epi32(b, 4);
        pw[g * 4 + 2] = _mm256_extract_epi32(b, 1);
        pw[g * 4 + 3] = _mm256_extract_epi32(b, 5);
        psc[g] = pm / 127.0f;
    }
}

/* int8 V of one chunk as dot products, dims [8 dv, 8 (dv + VC)): each 32-byte piece of a V tile row is 8 lanes of
 * [one dim of 4 tokens], so 4 u8 weights broadcast as one int32 meet it directly. Tokens past the sequence
 * have weight 0 and add exact zeros. */
T256 INLINE void vaccum_madd(const char *vt, int64_t row0, int D, int dv, int VC, const int32_t *pw, const float *psc,
                             const float *alpha, float *acc, int GB) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i ai[4][8];
    for (int g = 0; g < GB; g++)
        for (int v = 0; v < VC; v++) ai[g][v] = _mm256_setzero_si256();
    for (int tg = 0; tg < 4; tg++) {
        const char *r = vt + (row0 + tg * 4) * D + dv * 32;
        for (int v = 0; v < VC; v++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(r + v * 32));
            for (int g = 0; g < GB; g++)
                ai[g][v] = _mm256_add_epi32(ai[g][v], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(pw[g * 4 + tg]), x), ones));
        }
    }
    for (int g = 0; g < GB; g++) {
        const __m256 al = _mm256_set1_ps(alpha[g]), sc = _mm256_set1_ps(psc[g]);
        const int same = alpha[g] == 1.0f; /* the max rarely moves: no rescale multiply */
        for (int v = 0; v < VC; v++) {
            float *f = acc + g * D + (dv + v) * 8;
            const __m256 x = _mm256_loadu_ps(f);
            _mm256_storeu_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ai[g][v]), sc, same ? x : _mm256_mul_ps(x, al)));
        }
    }
}

/* int4 V of one chunk as dot products for GB <= 4 q heads, over the 16 dims that 32-byte half h of the 64-byte line
 * for dims [32 L, 32 L + 32) of each packed 4-token row holds (attn_internal.h): dims 32 L + 8 h .. + 8 in its low
 * nibbles, 32 L + 16 + 8 h .. + 8 in its high ones, made signed again (- 8) for vpmaddubsw's signed operand. The
 * four rows' int16 pair sums are added before one vpmaddwd (|sum| <= 4 * 2 * 127 * 7, no saturation): against 32
 * dims for 2 heads at a time with vpmaddwd per row, SmolLM2 int4 in L2 reads ~15 % faster (1 thread, a core without
 * AVX-512: 7.5-7.7 against 6.6 GB/s); Llama (one q head) reads the same either way. */
T256 INLINE void vaccum_madd4(const char *vt, int64_t row0, int D, int L, int h, const int32_t *pw, const float *psc,
                              const float *alpha, float *acc, int GB) {
    const __m256i ones = _mm256_set1_epi16(1), nib = _mm256_set1_epi8(15), eight = _mm256_set1_epi8(8);
    __m256i lo[4], hi[4];
    for (int g = 0; g < GB; g++) lo[g] = hi[g] = _mm256_setzero_si256();
    for (int tg = 0; tg < 4; tg++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(vt + (row0 / 4 + tg) * 2 * D + L * 64 + h * 32));
        const __m256i xl = _mm256_sub_epi8(_mm256_and_si256(x, nib), eight);
        const __m256i xh = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(x, 4), nib), eight);
        for (int g = 0; g < GB; g++) {
            const __m256i w = _mm256_set1_epi32(pw[g * 4 + tg]);
            lo[g] = _mm256_add_epi16(lo[g], _mm256_maddubs_epi16(w, xl));
            hi[g] = _mm256_add_epi16(hi[g], _mm256_maddubs_epi16(w, xh));
        }
    }
    for (int g = 0; g < GB; g++) {
        const __m256 al = _mm256_set1_ps(alpha[g]), sc = _mm256_set1_ps(psc[g]);
        const int same = alpha[g] == 1.0f;
        for (int v = 0; v < 2; v++) {
            float *f = acc + g * D + 32 * L + 8 * h + 16 * v;
            const __m256 y = _mm256_loadu_ps(f);
            const __m256i sum = _mm256_madd_epi16(v ? hi[g] : lo[g], ones);
            _mm256_storeu_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), sc, same ? y : _mm256_mul_ps(y, al)));
        }
    }
}

/* Scores and online-softmax update of one 16-token chunk of one kv head; the weights go to pb (16 per q head)
 * and the rescale factors to alpha. m: running max per q head; l: 8 lane partial sums of the softmax
 * denominator per q head (l + g * 8, reduced once per item). q4 / qsc: the quantised q rows (int8 dot
 * products, else NULL). pk / pkf: the K tiles to prefetch (int8: pkf carries the near V tile); pfk / pfv: int8 / int4
 * dot products' far K and V lines (NULL: none). */
T256 INLINE void chunk_scores(int dt, const char *kt, const uint16_t *ks, const uint16_t *vs, int c, int nv, int lo,
                              int G, int D,
                              int BS, const float *qs, const int32_t *q4, const int32_t *corr, const float *qsc,
                              float *m, float *l,
                              const char *pk, const char *pkf, const char *pfk, const char *pfv, float *pb,
                              float *alpha) {
    const __m256i iota0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), iota1 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    /* lanes [lo, nv) of the chunk: past its last token and before a sliding window's first one are masked */
    const __m256i lov = _mm256_set1_epi32(lo - 1), nvv = _mm256_set1_epi32(nv);
    const __m256 m0 = _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_cmpgt_epi32(nvv, iota0), _mm256_cmpgt_epi32(iota0, lov)));
    const __m256 m1 = _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_cmpgt_epi32(nvv, iota1), _mm256_cmpgt_epi32(iota1, lov)));
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gb = G - g0 < 4 ? G - g0 : 4;
        const char *pkg = g0 ? NULL : pk, *pfg = g0 ? NULL : pkf; /* the first q-head block carries the prefetch */
        const char *fkg = g0 ? NULL : pfk, *fvg = g0 ? NULL : pfv;
        __m256 lo[4], hi[4];
        if (q4 && dt == AIOLLM_DT_I4) {
            const int32_t *qg = q4 + g0 * (D / 4), *cg = corr + g0;
            switch (gb) {
            case 1: scores_madd4(kt, c * 16, BS, D, qg, cg, qsc + g0, 1, lo, hi, pkg, pfg, fkg, fvg); break;
            case 2: scores_madd4(kt, c * 16, BS, D, qg, cg, qsc + g0, 2, lo, hi, pkg, pfg, fkg, fvg); break;
            case 3: scores_madd4(kt, c * 16, BS, D, qg, cg, qsc + g0, 3, lo, hi, pkg, pfg, fkg, fvg); break;
            default: scores_madd4(kt, c * 16, BS, D, qg, cg, qsc + g0, 4, lo, hi, pkg, pfg, fkg, fvg); break;
            }
        } else if (q4) {
            const int32_t *qg = q4 + g0 * (D / 4);
            switch (gb) {
            case 1: scores_madd(kt, c * 16, BS, D, qg, qsc + g0, 1, lo, hi, pkg, pfg, fkg, fvg); break;
            case 2: scores_madd(kt, c * 16, BS, D, qg, qsc + g0, 2, lo, hi, pkg, pfg, fkg, fvg); break;
            case 3: scores_madd(kt, c * 16, BS, D, qg, qsc + g0, 3, lo, hi, pkg, pfg, fkg, fvg); break;
            default: scores_madd(kt, c * 16, BS, D, qg, qsc + g0, 4, lo, hi, pkg, pfg, fkg, fvg); break;
            }
        } else if (dt == AIOLLM_DT_I8) {
            switch (gb) {
            case 1: scores_i8(kt, c * 16, BS, D, qs + g0 * D, 1, lo, hi, pkg, pfg); break;
            case 2: scores_i8(kt, c * 16, BS, D, qs + g0 * D, 2, lo, hi, pkg, pfg); break;
            case 3: scores_i8(kt, c * 16, BS, D, qs + g0 * D, 3, lo, hi, pkg, pfg); break;
            default: scores_i8(kt, c * 16, BS, D, qs + g0 * D, 4, lo, hi, pkg, pfg); break;
            }
        } else
        switch (gb) {
        case 1: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 1, 4, lo, hi, pkg, pfg); break;
        case 2: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 2, 2, lo, hi, pkg, pfg); break;
        case 3: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 3, 2, lo, hi, pkg, pfg); break;
        default: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 4, 1, lo, hi, pkg, pfg); break;
        }
        for (int g = 0; g < gb; g++) {
            __m256 s0 = lo[g], s1 = hi[g];
            if (kv_quantised(dt)) {
                s0 = _mm256_mul_ps(s0, ld8(AIOLLM_DT_F16, ks, c * 16));
                s1 = _mm256_mul_ps(s1, ld8(AIOLLM_DT_F16, ks, c * 16 + 8));
            }
            s0 = _mm256_blendv_ps(ninf, s0, m0);
            s1 = _mm256_blendv_ps(ninf, s1, m1);
            /* The max rarely moves after a few chunks: one compare decides, and only then the horizontal max and
             * the rescale run; l stays 8 lane sums, so the common path has no horizontal reduction. */
            const __m256 mx = _mm256_max_ps(s0, s1);
            const float mo = m[g0 + g];
            float mn = mo, al = 1.0f;
            __m256 lv = _mm256_load_ps(l + (g0 + g) * 8);
            if (_mm256_movemask_ps(_mm256_cmp_ps(mx, _mm256_set1_ps(mo), _CMP_GT_OQ))) {
                mn = hmax8(mx);
                al = expf(mo - mn);
                lv = _mm256_mul_ps(lv, _mm256_set1_ps(al));
            }
            const __m256 mv = _mm256_set1_ps(mn);
            const __m256 x0 = _mm256_sub_ps(s0, mv), x1 = _mm256_sub_ps(s1, mv);
            __m256 p0 = _mm256_and_ps(m0, q4 ? exp256_fast(x0) : exp256(x0));
            __m256 p1 = _mm256_and_ps(m1, q4 ? exp256_fast(x1) : exp256(x1));
            _mm256_store_ps(l + (g0 + g) * 8, _mm256_add_ps(lv, _mm256_add_ps(p0, p1)));
            m[g0 + g] = mn;
            alpha[g0 + g] = al;
            if (kv_quantised(dt)) {
                p0 = _mm256_mul_ps(p0, _mm256_and_ps(m0, ld8(AIOLLM_DT_F16, vs, c * 16)));
                p1 = _mm256_mul_ps(p1, _mm256_and_ps(m1, ld8(AIOLLM_DT_F16, vs, c * 16 + 8)));
            }
            _mm256_store_ps(pb + (g0 + g) * 16, p0);
            _mm256_store_ps(pb + (g0 + g) * 16 + 8, p1);
        }
    }
}

/* V accumulation of one chunk with chunk_scores' weights pb and rescale factors alpha, over dims in slabs of
 * VC x 8 and q heads in blocks of 4: one q head takes 8-wide slabs (8 chains), 2 or 3 heads 4-wide (8 or 12),
 * 4 heads 2-wide (8); the 16 ymm registers bound the rest. pv / pvf: the V tiles to prefetch near / far. */
T256 INLINE void chunk_values(int dt, const char *vt, int c, int nv, int G, int D, const float *pb, const float *alpha,
                              float *acc, int dot, const char *pv, const char *pvf) {
    if (dot) { /* slabs of 4 x 8 dims (2 x 8 for 3 or 4 heads) and q heads in blocks of 4, as below */
        int32_t pw[AIOLLM_MAX_GROUP * 4];
        float psc[AIOLLM_MAX_GROUP];
        quantise_p(pb, G, pw, psc);
        for (int g0 = 0; dt == AIOLLM_DT_I4 && g0 < G; g0 += 4) { /* int4: line halves, q heads in blocks of 4 */
            const int gb = G - g0 < 4 ? G - g0 : 4;
            const int32_t *wg = pw + g0 * 4;
            for (int half = 0; half < D / 16; half++) {
                const int L = half / 2, h = half % 2;
                switch (gb) {
                case 1: vaccum_madd4(vt, c * 16, D, L, h, wg, psc + g0, alpha + g0, acc + g0 * D, 1); break;
                case 2: vaccum_madd4(vt, c * 16, D, L, h, wg, psc + g0, alpha + g0, acc + g0 * D, 2); break;
                case 3: vaccum_madd4(vt, c * 16, D, L, h, wg, psc + g0, alpha + g0, acc + g0 * D, 3); break;
                default: vaccum_madd4(vt, c * 16, D, L, h, wg, psc + g0, alpha + g0, acc + g0 * D, 4); break;
                }
            }
        }
        for (int g0 = 0; dt != AIOLLM_DT_I4 && g0 < G; g0 += 4) {
            const int gb = G - g0 < 4 ? G - g0 : 4;
            const int32_t *wg = pw + g0 * 4;
            for (int dv = 0; dv < D / 8;) {
                const int vc = D / 8 - dv >= 4 && gb < 3 ? 4 : 2;
                switch (gb * 16 + vc) {
                case 20: vaccum_madd(vt, c * 16, D, dv, 4, wg, psc + g0, alpha + g0, acc + g0 * D, 1); break;
                case 36: vaccum_madd(vt, c * 16, D, dv, 4, wg, psc + g0, alpha + g0, acc + g0 * D, 2); break;
                case 18: vaccum_madd(vt, c * 16, D, dv, 2, wg, psc + g0, alpha + g0, acc + g0 * D, 1); break;
                case 34: vaccum_madd(vt, c * 16, D, dv, 2, wg, psc + g0, alpha + g0, acc + g0 * D, 2); break;
                case 50: vaccum_madd(vt, c * 16, D, dv, 2, wg, psc + g0, alpha + g0, acc + g0 * D, 3); break;
                default: vaccum_madd(vt, c * 16, D, dv, 2, wg, psc + g0, alpha + g0, acc + g0 * D, 4); break;
                }
                dv += vc;
            }
        }
        return;
    }
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gb = G - g0 < 4 ? G - g0 : 4;
        const float *pg = pb + g0 * 16, *ag = alpha + g0;
        float *accg = acc + g0 * D;
        if (dt == AIOLLM_DT_I8) {
            switch (gb) {
            case 1: vaccum_i8(vt, c * 16, nv, D, pg, ag, accg, 1); break;
            case 2: vaccum_i8(vt, c * 16, nv, D, pg, ag, accg, 2); break;
            case 3: vaccum_i8(vt, c * 16, nv, D, pg, ag, accg, 3); break;
            default: vaccum_i8(vt, c * 16, nv, D, pg, ag, accg, 4); break;
            }
            continue;
        }
        const char *pvg = g0 ? NULL : pv, *pfg = g0 ? NULL : pvf; /* the first q-head block carries the prefetch */
        for (int dv = 0; dv < D / 8;) {
            const int rem = D / 8 - dv;
            const int vc = gb == 1 && rem >= 8 ? 8 : gb < 4 && rem >= 4 ? 4 : 2; /* D % 16 == 0: rem is even */
            switch (gb * 16 + vc) {
            case 24: vaccum(dt, vt, c * 16, nv, D, dv, 8, pg, ag, accg, 1, pvg, pfg); break;
            case 20: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 1, pvg, pfg); break;
            case 36: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 2, pvg, pfg); break;
            case 52: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 3, pvg, pfg); break;
            case 18: vaccum(dt, vt, c * 16, nv, D, dv, 2, pg, ag, accg, 1, pvg, pfg); break;
            case 34: vaccum(dt, vt, c * 16, nv, D, dv, 2, pg, ag, accg, 2, pvg, pfg); break;
            case 50: vaccum(dt, vt, c * 16, nv, D, dv, 2, pg, ag, accg, 3, pvg, pfg); break;
            default: vaccum(dt, vt, c * 16, nv, D, dv, 2, pg, ag, accg, 4, pvg, pfg); break;
            }
            dv += vc;
        }
    }
}

/* Heads [h0, h1) of one sequence, blocks outer and heads inner (see attn_avx512_impl.h); Dc / BSc: head_dim and
 * block_size as compile-time constants (0: read from the layer). */
T256 INLINE void item(const attn_args *a, int32_t seq, int32_t h0, int32_t h1, int dt, int dot, int Dc, int BSc) {
    const aiollm_kv_layer *kv = a->kv;
    const int G = a->group, D = Dc ? Dc : kv->head_dim, BS = BSc ? BSc : kv->block_size, NH = h1 - h0, GD = G * D;
    const int64_t es = dt == AIOLLM_DT_F32 ? 4 : dt == AIOLLM_DT_F16 ? 2 : 1;
    const int32_t n = a->seq_lens[seq], n_used = (n + BS - 1) / BS;
    const int32_t *table = a->block_tables + (int64_t)seq * a->max_blocks;
    const float *q = a->q + seq * a->q_seq_stride + (int64_t)h0 * GD;
    float qs[AIOLLM_ITEM_FLOATS] __attribute__((aligned(32)));
    float acc[AIOLLM_ITEM_FLOATS] __attribute__((aligned(32)));
    float m[AIOLLM_ITEM_FLOATS / 16], alpha[AIOLLM_MAX_GROUP];       /* alpha: one head's rescale factors */
    float l[AIOLLM_ITEM_FLOATS / 2] __attribute__((aligned(32)));     /* 8 lane sums per q head */
    float pb[AIOLLM_MAX_GROUP * 16] __attribute__((aligned(32)));     /* one head's chunk weights, 16 per q head */
    int32_t q4[AIOLLM_ITEM_FLOATS / 4];                           /* int8 dot products: q as int8, 4 dims each */
    int32_t corr[AIOLLM_ITEM_FLOATS / 16];                        /* int4: 8 * sum(q) per q head */
    float qsc[AIOLLM_ITEM_FLOATS / 16];

    for (int r = 0; r < NH * G; r++) {
        m[r] = -INFINITY;
        _mm256_store_ps(l + r * 8, _mm256_setzero_ps());
    }
    for (int i = 0; i < NH * GD; i += 8) {
        _mm256_store_ps(qs + i, _mm256_mul_ps(_mm256_loadu_ps(q + i), _mm256_set1_ps(a->scale)));
        _mm256_store_ps(acc + i, _mm256_setzero_ps());
    }
    if (dot) quantise_q(qs, NH * G, D, q4, dt == AIOLLM_DT_I4 ? corr : NULL, qsc);
    const int32_t far_tiles = (int32_t)(PF_FAR_BYTES / (D * BS * es));
    const int32_t pf_far = far_tiles > PF_NEAR ? far_tiles : PF_NEAR + 1;
    /* int8 / int4 dot products' far lines: tiles ahead (past the near level), 0 where not issued */
    const int32_t lines_i8 = PF_FAR_I8_LINES / (D * BS) > PF_NEAR ? PF_FAR_I8_LINES / (D * BS) : PF_NEAR + 1;
    const int32_t far_lines = dot && (a->far_prefetch & AIOLLM_FAR_QUANTISED_LINES) &&
                              (int64_t)NH * D * BS > MANY_HEADS_I8_BYTES ? lines_i8 : 0;
    const int32_t first = kv_first_token(kv, n); /* a sliding window's first token, else 0 */
    for (int32_t blk = first / BS; blk < n_used; blk++) {
        const int64_t block = table[blk];
        for (int c = 0; c * 16 < BS; c++) {
            const int nv = n - (blk * BS + c * 16), lo = first - (blk * BS + c * 16);
            if (nv <= 0) break;
            if (lo >= 16) continue;
            const int w = nv > 16 ? 16 : nv;
            for (int h = 0; h < NH; h++) {
                const int64_t tile = kv_tile_bytes(kv, dt, block, h0 + h);
                const char *kt = (const char *)kv->k + tile, *vt = (const char *)kv->v + tile;
                const uint16_t *ks = kv_quantised(dt) ? kv->k_scale + kv_scale_tile(kv, block, h0 + h) : NULL;
                const uint16_t *vs = kv_quantised(dt) ? kv->v_scale + kv_scale_tile(kv, block, h0 + h) : NULL;
                /* Tiles ahead in this item's order (heads inner): the K tiles by the first chunk's score loop (it
                 * covers whole K rows), the V tiles by every chunk's V loop (its own rows); int8 both K and V in
                 * the first chunk's score loop. */
                const char *pk = NULL, *pkf = NULL, *vn = NULL, *vf = NULL, *pfk = NULL, *pfv = NULL;
                const int32_t t0 = blk * NH + h, nb = (t0 + PF_NEAR) / NH, fb = (t0 + pf_far) / NH;
                if (nb < n_used) {
                    const int64_t at = kv_tile_bytes(kv, dt, table[nb], h0 + (t0 + PF_NEAR) % NH);
                    if (kv_quantised(dt)) {
                        if (c == 0) pk = (const char *)kv->k + at, pkf = (const char *)kv->v + at;
                    } else {
                        vn = (const char *)kv->v + at;
                        if (c == 0) pk = (const char *)kv->k + at;
                    }
                }
                const int32_t lb = (t0 + far_lines) / NH;
                if (far_lines && c == 0 && lb < n_used) {
                    const int64_t at = kv_tile_bytes(kv, dt, table[lb], h0 + (t0 + far_lines) % NH);
                    pfk = (const char *)kv->k + at, pfv = (const char *)kv->v + at;
                }
                if (!kv_quantised(dt) && a->far_prefetch && fb < n_used) {
                    const int64_t at = kv_tile_bytes(kv, dt, table[fb], h0 + (t0 + pf_far) % NH);
                    vf = (const char *)kv->v + at;
                    if (c == 0) pkf = (const char *)kv->k + at;
                }
                float *mh = m + h * G, *lh = l + h * G * 8;
                const int32_t *q4h = dot ? q4 + h * G * (D / 4) : NULL;
                chunk_scores(dt, kt, ks, vs, c, w, lo > 0 ? lo : 0, G, D, BS, qs + h * GD, q4h, corr + h * G, qsc + h * G, mh, lh, pk, pkf,
                             pfk, pfv, pb, alpha);
                chunk_values(dt, vt, c, w, G, D, pb, alpha, acc + h * GD, dot, vn, vf);
            }
        }
    }
    for (int r = 0; r < NH * G; r++) {
        const float lr = hsum8(_mm256_load_ps(l + r * 8));
        const __m256 inv = _mm256_set1_ps(lr > 0.0f ? 1.0f / lr : 0.0f);
        for (int d = 0; d < D; d += 8) _mm256_store_ps(acc + r * D + d, _mm256_mul_ps(_mm256_load_ps(acc + r * D + d), inv));
    }
    store_row_ref(a->out, ((int64_t)seq * a->n_q_heads + (int64_t)h0 * G) * D, acc, NH * GD, a->out_dtype);
}

/* The item specialised for the common shapes (head_dim 64 or 128, block_size 16): with both constant every loop
 * inside has a fixed trip count and is unrolled; other shapes take the general body. */
#define ITEM_SPECIALISED(name, dt, dot)                                             \
    T256 static void name(const attn_args *a, int32_t s, int32_t h0, int32_t h1) {  \
        const int D = a->kv->head_dim, BS = a->kv->block_size;                      \
        if (D == 64 && BS == 16) item(a, s, h0, h1, dt, dot, 64, 16);               \
        else if (D == 128 && BS == 16) item(a, s, h0, h1, dt, dot, 128, 16);        \
        else item(a, s, h0, h1, dt, dot, 0, 0);                                     \
    }
ITEM_SPECIALISED(item_f32, AIOLLM_DT_F32, 0)
ITEM_SPECIALISED(item_f16, AIOLLM_DT_F16, 0)
ITEM_SPECIALISED(item_i8, AIOLLM_DT_I8, 0)
ITEM_SPECIALISED(item_i8_madd, AIOLLM_DT_I8, 1)
ITEM_SPECIALISED(item_i4_madd, AIOLLM_DT_I4, 1)
#undef ITEM_SPECIALISED

void attn_item_avx2(const attn_args *a, int32_t seq, int32_t h0, int32_t h1) {
    switch (a->kv->dtype) {
    case AIOLLM_DT_F16: item_f16(a, seq, h0, h1); break;
    case AIOLLM_DT_I8: /* the AVX2 kernel's int8 dot products serve any dot-product path (see aiollm_int8_path) */
        if (a->int8_dot != AIOLLM_INT8_FP32) item_i8_madd(a, seq, h0, h1);
        else item_i8(a, seq, h0, h1);
        break;
    case AIOLLM_DT_I4: item_i4_madd(a, seq, h0, h1); break; /* int4 always runs dot products (dispatch.c) */
    default: item_f32(a, seq, h0, h1); break;
    }
}

T256 double read_sum_avx2(const void *buf, int64_t n64) {
    const float *p = (const float *)buf;
    __m256 s[8];
    for (int j = 0; j < 8; j++) s[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n64; i += 1) {
        s[0] = _mm256_add_ps(s[0], _mm256_loadu_ps(p + i * 16));
        s[1] = _mm256_add_ps(s[1], _mm256_loadu_ps(p + i * 16 + 8));
        if (++i >= n64) break;
        s[2] = _mm256_add_ps(s[2], _mm256_loadu_ps(p + i * 16));
        s[3] = _mm256_add_ps(s[3], _mm256_loadu_ps(p + i * 16 + 8));
        if (++i >= n64) break;
        s[4] = _mm256_add_ps(s[4], _mm256_loadu_ps(p + i * 16));
        s[5] = _mm256_add_ps(s[5], _mm256_loadu_ps(p + i * 16 + 8));
        if (++i >= n64) break;
        s[6] = _mm256_add_ps(s[6], _mm256_loadu_ps(p + i * 16));
        s[7] = _mm256_add_ps(s[7], _mm256_loadu_ps(p + i * 16 + 8));
    }
    for (int j = 1; j < 8; j++) s[0] = _mm256_add_ps(s[0], s[j]);
    return (double)hsum8(s[0]);
}
