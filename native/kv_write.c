/* kv_write: scatter new tokens' K and V into their slots, converting (fp32/fp16/bf16 in) to the pool dtype.
 * One portable implementation for every ISA, so the stored bytes never depend on the dispatch choice.
 * int8 is quantised here: symmetric, one fp32 scale per token per head, scale = max|x| / 127. */
#include "attn_internal.h"

static inline float in_elem(const void *base, int64_t i, int32_t dtype) {
    switch (dtype) {
    case AIOLLM_DT_F16: return half_to_float(((const uint16_t *)base)[i]);
    case AIOLLM_DT_BF16: return bf16_to_float(((const uint16_t *)base)[i]);
    default: return ((const float *)base)[i];
    }
}

static inline int8_t quantise(float x, float inv) {
    float y = fminf(fmaxf(x * inv, -127.0f), 127.0f); /* fmaxf maps NaN to -127 */
    return (int8_t)lrintf(y);
}

/* Store one head's row x[0..D) of token slot `off` in tile `tile`; K transposed (stride BS), V row-major. */
static void store_head(const aiollm_kv_layer *kv, int is_k, int64_t tile, int64_t scale_at, int off,
                       const float *x) {
    const int D = kv->head_dim, BS = kv->block_size;
    const int64_t step = is_k ? BS : 1, at = tile + (is_k ? off : (int64_t)off * D);
    void *dst = is_k ? kv->k : kv->v;
    int d;
    switch (kv->dtype) {
    case AIOLLM_DT_F32:
        for (d = 0; d < D; d++) ((float *)dst)[at + d * step] = x[d];
        break;
    case AIOLLM_DT_F16:
        for (d = 0; d < D; d++) ((uint16_t *)dst)[at + d * step] = float_to_half(x[d]);
        break;
    default: {
        float amax = 0.0f;
        for (d = 0; d < D; d++) amax = fmaxf(amax, fabsf(x[d]));
        const float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (d = 0; d < D; d++) ((int8_t *)dst)[at + d * step] = quantise(x[d], inv);
        (is_k ? kv->k_scale : kv->v_scale)[scale_at] = scale;
    }
    }
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
    if (kv->dtype != AIOLLM_DT_F32 && kv->dtype != AIOLLM_DT_F16 && kv->dtype != AIOLLM_DT_I8)
        return AIOLLM_ERR_UNSUPPORTED;
    if (kv->dtype == AIOLLM_DT_I8 && (!kv->k_scale || !kv->v_scale)) return AIOLLM_ERR_ARG;
    const int H = kv->n_kv_heads, D = kv->head_dim, BS = kv->block_size;
    if (k_token_stride < (int64_t)H * D || v_token_stride < (int64_t)H * D) return AIOLLM_ERR_ARG;
    const int64_t n_slots = kv->n_blocks * BS;
    for (int64_t i = 0; i < n_tokens; i++)
        if (slots[i] < 0 || slots[i] >= n_slots) return AIOLLM_ERR_SLOT;

    float row[AIOLLM_MAX_HEAD_DIM];
    for (int64_t i = 0; i < n_tokens; i++) {
        const int64_t block = slots[i] / BS;
        const int off = (int)(slots[i] % BS);
        for (int h = 0; h < H; h++) {
            const int64_t tile = kv_tile(kv, block, h), scale_at = kv_scale_tile(kv, block, h) + off;
            const int64_t src = (int64_t)h * D;
            for (int d = 0; d < D; d++) row[d] = in_elem(k, i * k_token_stride + src + d, in_dtype);
            store_head(kv, 1, tile, scale_at, off, row);
            for (int d = 0; d < D; d++) row[d] = in_elem(v, i * v_token_stride + src + d, in_dtype);
            store_head(kv, 0, tile, scale_at, off, row);
        }
    }
    return AIOLLM_OK;
}
