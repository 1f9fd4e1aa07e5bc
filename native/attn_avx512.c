/* AVX-512 path (avx512f/bw/vl + fma + f16c): 16 tokens per chunk, one zmm per K column of a chunk.
 *
 * Per (sequence, kv head) item the `group` q heads share every K/V row: a K column (16 tokens of one
 * dimension, contiguous thanks to the transposed K tile) is loaded and converted once and multiplied into
 * the score accumulators of up to 4 q heads; a V row is loaded once and accumulated into up to 4 heads'
 * outputs. Softmax is online, once per 16-token chunk: new max, rescale factor, exp of the chunk. */
#include <immintrin.h>
#include "attn_internal.h"

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

T512 INLINE __m512 ld16(int dt, const void *base, int64_t i) {
    if (dt == AIOLLM_DT_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)));
    if (dt == AIOLLM_DT_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + i))));
    return _mm512_loadu_ps((const float *)base + i);
}

/* exp for x <= 0 (scores minus the running max); inputs below -87 give ~1e-38, masked lanes are zeroed. */
T512 INLINE __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, fx);
}

/* Scores of 16 tokens (chunk column `col` of a K tile) for GB q heads, NP partial sums each to hide FMA
 * latency. Pointer walks, not index arithmetic: the loop body is loads and FMAs only. */
T512 INLINE void scores(int dt, const char *kt, int64_t col, int64_t BS, int D, const float *qs, int GB, int NP,
                        __m512 *out) {
    const int64_t es = dt == AIOLLM_DT_F32 ? 4 : dt == AIOLLM_DT_F16 ? 2 : 1, step = BS * es;
    const char *kp = kt + col * es;
    __m512 acc[4][4];
    for (int g = 0; g < GB; g++)
        for (int p = 0; p < NP; p++) acc[g][p] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += NP, kp += NP * step) {
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

/* acc[g][16*(dv..dv+VC)] = alpha[g] * acc + sum over the chunk's nv tokens of pb[g][t] * V row t. */
T512 INLINE void vaccum(int dt, const char *vt, int64_t row0, int nv, int D, int dv, int VC, const float *pb,
                        const float *alpha, float *acc, int GB) {
    const int64_t es = dt == AIOLLM_DT_F32 ? 4 : dt == AIOLLM_DT_F16 ? 2 : 1;
    const char *vp = vt + (row0 * D + dv * 16) * es;
    __m512 r[4][4];
    for (int g = 0; g < GB; g++)
        for (int v = 0; v < VC; v++)
            r[g][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + (dv + v) * 16), _mm512_set1_ps(alpha[g]));
    for (int t = 0; t < nv; t++, vp += D * es) {
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

static inline void prefetch_tile(const char *p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

/* One 16-token chunk of one kv head: scores, online-softmax update, V accumulation. */
T512 INLINE void chunk(int dt, const char *kt, const char *vt, const float *ks, const float *vs, int c, int nv,
                       int G, int D, int BS, const float *qs, float *acc, float *m, float *l) {
    const __mmask16 mask = (__mmask16)(nv == 16 ? 0xffffu : (1u << nv) - 1u);
    float alpha[AIOLLM_MAX_GROUP], pb[AIOLLM_MAX_GROUP * 16] __attribute__((aligned(64)));
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gb = G - g0 < 4 ? G - g0 : 4;
        __m512 s[4];
        switch (gb) {
        case 1: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 1, 4, s); break;
        case 2: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 2, 4, s); break;
        case 3: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 3, 2, s); break;
        default: scores(dt, kt, c * 16, BS, D, qs + g0 * D, 4, 2, s); break;
        }
        for (int g = 0; g < gb; g++) {
            __m512 sc = s[g];
            if (dt == AIOLLM_DT_I8) sc = _mm512_mul_ps(sc, _mm512_loadu_ps(ks + c * 16));
            sc = _mm512_mask_blend_ps(mask, _mm512_set1_ps(-INFINITY), sc);
            const float mx = _mm512_reduce_max_ps(sc), mo = m[g0 + g], mn = mx > mo ? mx : mo;
            __m512 p = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mn))));
            const float al = expf(mo - mn);
            l[g0 + g] = l[g0 + g] * al + _mm512_reduce_add_ps(p);
            m[g0 + g] = mn;
            alpha[g0 + g] = al;
            if (dt == AIOLLM_DT_I8) p = _mm512_mul_ps(p, _mm512_maskz_loadu_ps(mask, vs + c * 16));
            _mm512_store_ps(pb + (g0 + g) * 16, p);
        }
    }
    for (int g0 = 0; g0 < G; g0 += 4) {
        const int gb = G - g0 < 4 ? G - g0 : 4;
        const float *pg = pb + g0 * 16, *ag = alpha + g0;
        float *accg = acc + g0 * D;
        int dv = 0;
        for (; dv + 4 <= D / 16; dv += 4) {
            switch (gb) {
            case 1: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 1); break;
            case 2: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 2); break;
            case 3: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 3); break;
            default: vaccum(dt, vt, c * 16, nv, D, dv, 4, pg, ag, accg, 4); break;
            }
        }
        for (; dv < D / 16; dv++) {
            switch (gb) {
            case 1: vaccum(dt, vt, c * 16, nv, D, dv, 1, pg, ag, accg, 1); break;
            case 2: vaccum(dt, vt, c * 16, nv, D, dv, 1, pg, ag, accg, 2); break;
            case 3: vaccum(dt, vt, c * 16, nv, D, dv, 1, pg, ag, accg, 3); break;
            default: vaccum(dt, vt, c * 16, nv, D, dv, 1, pg, ag, accg, 4); break;
            }
        }
    }
}

/* Heads [h0, h1) of one sequence. Blocks outer, heads inner: the item walks each block's K region and V
 * region of its heads front to back (contiguous in the pool), so the hardware streams them; the next block
 * of each head is prefetched while the current one is processed. */
T512 INLINE void item(const attn_args *a, int32_t seq, int32_t h0, int32_t h1, int dt) {
    const aiollm_kv_layer *kv = a->kv;
    const int G = a->group, D = kv->head_dim, BS = kv->block_size, NH = h1 - h0, GD = G * D;
    const int64_t es = dt == AIOLLM_DT_F32 ? 4 : dt == AIOLLM_DT_F16 ? 2 : 1, tile_bytes = (int64_t)D * BS * es;
    const int32_t n = a->seq_lens[seq], n_used = (n + BS - 1) / BS;
    const int32_t *table = a->block_tables + (int64_t)seq * a->max_blocks;
    const float *q = a->q + seq * a->q_seq_stride + (int64_t)h0 * GD;
    float qs[AIOLLM_ITEM_FLOATS] __attribute__((aligned(64)));
    float acc[AIOLLM_ITEM_FLOATS] __attribute__((aligned(64)));
    float m[AIOLLM_ITEM_FLOATS / 16], l[AIOLLM_ITEM_FLOATS / 16];

    for (int r = 0; r < NH * G; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (int i = 0; i < NH * GD; i += 16) {
        _mm512_store_ps(qs + i, _mm512_mul_ps(_mm512_loadu_ps(q + i), _mm512_set1_ps(a->scale)));
        _mm512_store_ps(acc + i, _mm512_setzero_ps());
    }
    for (int32_t blk = 0; blk < n_used; blk++) {
        const int64_t block = table[blk];
        for (int h = 0; h < NH; h++) {
            const int64_t tile = kv_tile(kv, block, h0 + h) * es;
            const char *kt = (const char *)kv->k + tile, *vt = (const char *)kv->v + tile;
            const float *ks = dt == AIOLLM_DT_I8 ? kv->k_scale + kv_scale_tile(kv, block, h0 + h) : NULL;
            const float *vs = dt == AIOLLM_DT_I8 ? kv->v_scale + kv_scale_tile(kv, block, h0 + h) : NULL;
            if (blk + 1 < n_used) {
                const int64_t next = kv_tile(kv, table[blk + 1], h0 + h) * es;
                prefetch_tile((const char *)kv->k + next, tile_bytes);
                prefetch_tile((const char *)kv->v + next, tile_bytes);
            }
            for (int c = 0; c * 16 < BS; c++) {
                int nv = n - (blk * BS + c * 16);
                if (nv <= 0) break;
                const int w = nv > 16 ? 16 : nv;
                float *ah = acc + h * GD, *mh = m + h * G, *lh = l + h * G;
                if (D == 64) chunk(dt, kt, vt, ks, vs, c, w, G, 64, BS, qs + h * GD, ah, mh, lh);
                else if (D == 128) chunk(dt, kt, vt, ks, vs, c, w, G, 128, BS, qs + h * GD, ah, mh, lh);
                else chunk(dt, kt, vt, ks, vs, c, w, G, D, BS, qs + h * GD, ah, mh, lh);
            }
        }
    }
    for (int r = 0; r < NH * G; r++) {
        const __m512 inv = _mm512_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
        for (int d = 0; d < D; d += 16) _mm512_store_ps(acc + r * D + d, _mm512_mul_ps(_mm512_load_ps(acc + r * D + d), inv));
    }
    store_row_ref(a->out, ((int64_t)seq * a->n_q_heads + (int64_t)h0 * G) * D, acc, NH * GD, a->out_dtype);
}

T512 static void item_f32(const attn_args *a, int32_t s, int32_t h0, int32_t h1) { item(a, s, h0, h1, AIOLLM_DT_F32); }
T512 static void item_f16(const attn_args *a, int32_t s, int32_t h0, int32_t h1) { item(a, s, h0, h1, AIOLLM_DT_F16); }
T512 static void item_i8(const attn_args *a, int32_t s, int32_t h0, int32_t h1) { item(a, s, h0, h1, AIOLLM_DT_I8); }

void attn_item_avx512(const attn_args *a, int32_t seq, int32_t h0, int32_t h1) {
    switch (a->kv->dtype) {
    case AIOLLM_DT_F16: item_f16(a, seq, h0, h1); break;
    case AIOLLM_DT_I8: item_i8(a, seq, h0, h1); break;
    default: item_f32(a, seq, h0, h1); break;
    }
}

T512 double read_sum_avx512(const void *buf, int64_t n64) {
    const float *p = (const float *)buf;
    __m512 s[8];
    int64_t i = 0;
    for (int j = 0; j < 8; j++) s[j] = _mm512_setzero_ps();
    for (; i + 8 <= n64; i += 8)
        for (int j = 0; j < 8; j++) s[j] = _mm512_add_ps(s[j], _mm512_loadu_ps(p + (i + j) * 16));
    for (; i < n64; i++) s[0] = _mm512_add_ps(s[0], _mm512_loadu_ps(p + i * 16));
    for (int j = 1; j < 8; j++) s[0] = _mm512_add_ps(s[0], s[j]);
    return (double)_mm512_reduce_add_ps(s[0]);
}
