/* kv_write: scatter new tokens' K and V into their slots, converting (fp32/fp16/bf16 in) to the pool dtype.
 * The stored bytes never depend on the dispatch choice: the portable loops below are the definition, and the
 * F16C path (taken unless aiollm_isa() is the reference) stores the same bits (hardware fp16 conversion rounds
 * to nearest even as float_to_half does; a NaN is rewritten to float_to_half's quiet NaN).
 * int8 is quantised here: symmetric, one fp16 scale per token per head, s = max|x| / 127 rounded to fp16 (a finite
 * s above fp16's range stored as its largest, 65504), codes x / s. int4 the same way with s = max|x| / 7, codes
 * in [-7, 7] stored as c + 8, two a byte (attn_internal.h). Rounding s to fp16 moves a code's value by at
 * most 127 x 2^-11 ~ 0.06 of a step (rounding x to a code: 0.5), and saves SmolLM2 12 of the 408 bytes a token
 * cost with fp32 scales (2 KV x 3 heads x 64 codes + scales).
 *
 * Each head's row is first converted to floats without a per-element dtype switch, then stored; int8 is
 * quantised with SSE2 on x86-64, whose results equal the portable loop's bit for bit. (An R-worker writes every
 * layer's new K/V once per step: at 256 rows the int8 write takes ~0.2 ms a layer hot, ~0.5 with cold lines as in
 * a real step, against ~0.8 ms hot, a quarter of that layer's attention, for the portable loop with a per-element
 * dtype switch.) The scalar fp16 conversions cost ~2 ns an element; the F16C path converts 8 at once: SmolLM2, 256
 * tokens into 256 blocks, 0.21 us a token hot against 0.50 scalar. With cold lines (an R-worker's step) it is 0.85
 * against 0.97 us a token: each token's K touches every line of its transposed K tile, and the read-for-ownership
 * of those lines binds (software prefetch a few tokens ahead gains nothing). */
#include <float.h>

#include "attn_internal.h"

/* One head's D inputs starting at element `at` of `base`, as floats. */
static void load_head(const void *base, int64_t at, int32_t dtype, int D, float *restrict row) {
    int d;
    if (dtype == AIOLLM_DT_F16) {
        const uint16_t *src = (const uint16_t *)base + at;
        for (d = 0; d < D; d++) row[d] = half_to_float(src[d]);
    } else if (dtype == AIOLLM_DT_BF16) {
        const uint16_t *src = (const uint16_t *)base + at;
        for (d = 0; d < D; d++) row[d] = bf16_to_float(src[d]);
    } else {
        memcpy(row, (const float *)base + at, (size_t)D * sizeof(float));
    }
}

/* The stored scale of a row whose largest magnitude is amax (never NaN) for codes in [-qmax, qmax], and through
 * *inv the factor that turns the row into codes: 1 / the stored scale, 0 where it is 0 or infinite. */
static uint16_t row_scale(float amax, float qmax, float *inv) {
    const float s = amax / qmax;
    const uint16_t h = float_to_half(s > 65504.0f && s <= FLT_MAX ? 65504.0f : s);
    const float back = half_to_float(h);
    *inv = back > 0.0f && back <= FLT_MAX ? 1.0f / back : 0.0f;
    return h;
}

/* The portable quantiser (and the SSE2 one's fallback for a head_dim that is not a multiple of 16). */
static uint16_t quantise_head_scalar(const float *restrict x, int D, float qmax, int8_t *restrict q) {
    float amax = 0.0f, inv;
    int d;
    for (d = 0; d < D; d++) amax = fmaxf(amax, fabsf(x[d]));
    const uint16_t scale = row_scale(amax, qmax, &inv);
    for (d = 0; d < D; d++) q[d] = (int8_t)lrintf(fminf(fmaxf(x[d] * inv, -qmax), qmax)); /* fmaxf: NaN -> -qmax */
    return scale;
}

/* Codes of one head's row and its fp16 scale: x / s (row_scale) clamped to [-qmax, qmax] (NaN -> -qmax), rounded
 * to the nearest integer, ties to even; qmax is 127 (int8) or 7 (int4). */
#if defined(__SSE2__)
#include <emmintrin.h>
/* SSE2 (every x86-64): maxps/minps return their second operand for a NaN, which gives fmaxf/fminf's answers
 * here, and cvtps2dq rounds as lrintf does (the default rounding mode): the same bytes as the scalar loop. */
static uint16_t quantise_head(const float *restrict x, int D, float qmax, int8_t *restrict q) {
    if (D % 16) return quantise_head_scalar(x, D, qmax, q);
    const __m128 sign = _mm_set1_ps(-0.0f);
    __m128 m = _mm_setzero_ps();
    int d;
    for (d = 0; d < D; d += 4) m = _mm_max_ps(_mm_andnot_ps(sign, _mm_loadu_ps(x + d)), m);
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
    float inv;
    const uint16_t scale = row_scale(_mm_cvtss_f32(m), qmax, &inv);
    const __m128 vinv = _mm_set1_ps(inv), lo = _mm_set1_ps(-qmax), hi = _mm_set1_ps(qmax);
    for (d = 0; d < D; d += 16) {
        __m128i c[4];
        for (int j = 0; j < 4; j++)
            c[j] = _mm_cvtps_epi32(_mm_min_ps(_mm_max_ps(_mm_mul_ps(_mm_loadu_ps(x + d + 4 * j), vinv), lo), hi));
        _mm_storeu_si128((__m128i *)(q + d), _mm_packs_epi16(_mm_packs_epi32(c[0], c[1]), _mm_packs_epi32(c[2], c[3])));
    }
    return scale;
}
#else
#define quantise_head quantise_head_scalar
#endif

/* int4: one head's codes q of token slot `off` into its K or V tile (byte offset `tile`), whole bytes: each holds
 * this token's dims d and d + 4 (K) or d and d + 16 (V), as c + 8 (attn_internal.h). */
static void store_i4(const aiollm_kv_layer *kv, int is_k, int64_t tile, int off, const int8_t *restrict q) {
    const int D = kv->head_dim, BS = kv->block_size, pair = is_k ? 4 : 16;
    uint8_t *out = (uint8_t *)(is_k ? kv->k : kv->v) + tile;
    for (int d = 0; d < D; d++) {
        if (d & pair) continue; /* the high nibble of the byte written for d - pair */
        const uint8_t b = (uint8_t)((q[d] + 8) | (q[d + pair] + 8) << 4);
        out[is_k ? i4_k_at(BS, d, off) : i4_v_at(D, off, d)] = b;
    }
}

/* Store one head's row x[0..D) of token slot `off` in tile `tile` (elements: the tile's byte offset / 2 for
 * int4); fp32/fp16: K transposed (stride BS), V row-major; int8 and int4: the interleaved layouts of
 * attn_internal.h. */
static void store_head(const aiollm_kv_layer *kv, int is_k, int64_t tile, int64_t scale_at, int off,
                       const float *restrict x) {
    const int D = kv->head_dim, BS = kv->block_size;
    const int64_t step = is_k ? BS : 1, at = tile + (is_k ? off : (int64_t)off * D);
    void *dst = is_k ? kv->k : kv->v;
    int d;
    if (kv->dtype == AIOLLM_DT_F32) {
        float *out = (float *)dst + at;
        for (d = 0; d < D; d++) out[d * step] = x[d];
    } else if (kv->dtype == AIOLLM_DT_F16) {
        uint16_t *out = (uint16_t *)dst + at;
        for (d = 0; d < D; d++) out[d * step] = float_to_half(x[d]);
    } else if (kv->dtype == AIOLLM_DT_I4) {
        int8_t q[AIOLLM_MAX_HEAD_DIM];
        (is_k ? kv->k_scale : kv->v_scale)[scale_at] = quantise_head(x, D, 7.0f, q);
        store_i4(kv, is_k, tile / 2, off, q);
    } else { /* int8: the dot-product layout of attn_internal.h (i8_k_at, i8_v_at) */
        int8_t q[AIOLLM_MAX_HEAD_DIM];
        int8_t *out = (int8_t *)dst + tile;
        (is_k ? kv->k_scale : kv->v_scale)[scale_at] = quantise_head(x, D, 127.0f, q);
        for (d = 0; d < D; d++) out[is_k ? i8_k_at(D, BS, d, off) : i8_v_at(D, BS, off, d)] = q[d];
    }
}

#if defined(__x86_64__)
#include <immintrin.h>
#define F16C_PATH 1
#define T_F16C __attribute__((target("avx2,f16c")))

/* load_head with 8 elements at a time (D a multiple of 8). */
T_F16C static void load_head_f16c(const void *base, int64_t at, int32_t dtype, int D, float *restrict row) {
    for (int d = 0; d < D; d += 8) {
        __m256 x;
        if (dtype == AIOLLM_DT_F32) {
            x = _mm256_loadu_ps((const float *)base + at + d);
        } else {
            const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + at + d));
            x = dtype == AIOLLM_DT_F16 ? _mm256_cvtph_ps(h)
                                       : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        _mm256_storeu_ps(row + d, x);
    }
}

/* fp16 storage of one head's row: out[d * step] = float_to_half(x[d]) for D a multiple of 8. */
T_F16C static void store_f16_f16c(uint16_t *restrict out, int64_t step, const float *restrict x, int D) {
    for (int d = 0; d < D; d += 8) {
        const __m256 f = _mm256_loadu_ps(x + d);
        uint16_t h[8];
        _mm_storeu_si128((__m128i *)h, _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const int nan = _mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
        for (int j = 0; nan && j < 8; j++)
            if (nan >> j & 1) h[j] = float_to_half(x[d + j]);
        if (step == 1) {
            memcpy(out + d, h, sizeof h);
        } else {
            for (int j = 0; j < 8; j++) out[(d + j) * step] = h[j];
        }
    }
}
#else
#define load_head_f16c load_head /* f16c is never set without the F16C path */
#endif

/* Token slot `off` of tile `tile`: one head's K (is_k) or V row from element `at` of src, through row. */
static void write_head(const aiollm_kv_layer *kv, int is_k, int64_t tile, int64_t scale_at, int off,
                       const void *src, int64_t at, int32_t in_dtype, int f16c, float *restrict row) {
    if (f16c)
        load_head_f16c(src, at, in_dtype, kv->head_dim, row);
    else
        load_head(src, at, in_dtype, kv->head_dim, row);
#ifdef F16C_PATH
    if (f16c && kv->dtype == AIOLLM_DT_F16) {
        uint16_t *dst = (uint16_t *)(is_k ? kv->k : kv->v) + tile + (is_k ? off : (int64_t)off * kv->head_dim);
        store_f16_f16c(dst, is_k ? kv->block_size : 1, row, kv->head_dim);
        return;
    }
#endif
    store_head(kv, is_k, tile, scale_at, off, row);
}

int aiollm_kv_write(const aiollm_kv_layer *kv, const int64_t *slots, int64_t n_tokens,
                    const void *k, int64_t k_token_stride, const void *v, int64_t v_token_stride,
                    int32_t in_dtype) {
    if (!kv || n_tokens < 0 || kv->block_size < 1 || kv->n_kv_heads < 1 || kv->head_dim < 1 ||
        kv->head_dim > AIOLLM_MAX_HEAD_DIM || kv->n_blocks < 0)
        return AIOLLM_ERR_ARG;
    if (n_tokens == 0) return AIOLLM_OK;
    if (!slots || !k || !v || !kv->k || !kv->v) return AIOLLM_ERR_ARG;
    if (in_dtype != AIOLLM_DT_F32 && in_dtype != AIOLLM_DT_F16 && in_dtype != AIOLLM_DT_BF16)
        return AIOLLM_ERR_UNSUPPORTED;
    const int storage = kv_storage_check(kv);
    if (storage != AIOLLM_OK) return storage;
    const int H = kv->n_kv_heads, D = kv->head_dim, BS = kv->block_size;
    if (k_token_stride < (int64_t)H * D || v_token_stride < (int64_t)H * D) return AIOLLM_ERR_ARG;
    const int64_t n_slots = kv->n_blocks * BS;
    for (int64_t i = 0; i < n_tokens; i++)
        if (slots[i] < 0 || slots[i] >= n_slots) return AIOLLM_ERR_SLOT;

    const int f16c = D % 8 == 0 && aiollm_isa() != AIOLLM_ISA_REF; /* the F16C path where it is compiled */
    float row[AIOLLM_MAX_HEAD_DIM];
    for (int64_t i = 0; i < n_tokens; i++) {
        const int64_t block = slots[i] / BS;
        const int off = (int)(slots[i] % BS);
        for (int h = 0; h < H; h++) {
            const int64_t tile = kv_tile(kv, block, h), scale_at = kv_scale_tile(kv, block, h) + off;
            write_head(kv, 1, tile, scale_at, off, k, i * k_token_stride + (int64_t)h * D, in_dtype, f16c, row);
            write_head(kv, 0, tile, scale_at, off, v, i * v_token_stride + (int64_t)h * D, in_dtype, f16c, row);
        }
    }
    return AIOLLM_OK;
}
