/* Portable reference path: plain C, fp32 math, one token at a time with an online softmax.
 * It is the oracle the SIMD variants are tested against and the fallback for shapes they do not cover. */
#include "attn_internal.h"

static inline float kv_elem(const void *base, int64_t i, int32_t dtype) {
    switch (dtype) {
    case AIOLLM_DT_F16: return half_to_float(((const uint16_t *)base)[i]);
    case AIOLLM_DT_I8: return (float)((const int8_t *)base)[i];
    default: return ((const float *)base)[i];
    }
}

/* An int4 code at byte `at` of a tile array, nibble `hi`, as its value c (stored c + 8). */
static inline float i4_elem(const void *base, int64_t at, int hi) {
    const uint8_t b = ((const uint8_t *)base)[at];
    return (float)((hi ? b >> 4 : b & 15) - 8);
}

/* K element (d, t) and V element (t, d) of the tile at element offset `tile` (unscaled codes for int8 / int4,
 * whose tiles have their own interleaved layouts). */
static inline float k_elem(const aiollm_kv_layer *kv, int64_t tile, int d, int t) {
    switch (kv->dtype) {
    case AIOLLM_DT_I4: return i4_elem(kv->k, tile / 2 + i4_k_at(kv->block_size, d, t), (d >> 2) & 1);
    case AIOLLM_DT_I8: return kv_elem(kv->k, tile + i8_k_at(kv->head_dim, kv->block_size, d, t), AIOLLM_DT_I8);
    default: return kv_elem(kv->k, tile + (int64_t)d * kv->block_size + t, kv->dtype);
    }
}
static inline float v_elem(const aiollm_kv_layer *kv, int64_t tile, int t, int d) {
    switch (kv->dtype) {
    case AIOLLM_DT_I4: return i4_elem(kv->v, tile / 2 + i4_v_at(kv->head_dim, t, d), (d >> 4) & 1);
    case AIOLLM_DT_I8: return kv_elem(kv->v, tile + i8_v_at(kv->head_dim, kv->block_size, t, d), AIOLLM_DT_I8);
    default: return kv_elem(kv->v, tile + (int64_t)t * kv->head_dim + d, kv->dtype);
    }
}

static void one_head(const attn_args *a, int32_t seq, int32_t head) {
    const aiollm_kv_layer *kv = a->kv;
    const int G = a->group, D = kv->head_dim, BS = kv->block_size, dt = kv->dtype;
    const int32_t n = a->seq_lens[seq];
    const int32_t *table = a->block_tables + (int64_t)seq * a->max_blocks;
    const float *q = a->q + seq * a->q_seq_stride + (int64_t)head * G * D;
    float qs[AIOLLM_MAX_GROUP * AIOLLM_MAX_HEAD_DIM], acc[AIOLLM_MAX_GROUP * AIOLLM_MAX_HEAD_DIM];
    float m[AIOLLM_MAX_GROUP], l[AIOLLM_MAX_GROUP];
    int g, d;

    for (g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (d = 0; d < D; d++) {
            qs[g * D + d] = q[g * D + d] * a->scale;
            acc[g * D + d] = 0.0f;
        }
    }
    for (int32_t t = kv_first_token(kv, n); t < n; t++) {
        const int64_t block = table[t / BS];
        const int off = t % BS;
        const int64_t tile = kv_tile(kv, block, head);
        const float ks = kv_quantised(dt) ? half_to_float(kv->k_scale[kv_scale_tile(kv, block, head) + off]) : 1.0f;
        const float vs = kv_quantised(dt) ? half_to_float(kv->v_scale[kv_scale_tile(kv, block, head) + off]) : 1.0f;
        for (g = 0; g < G; g++) {
            float s = 0.0f;
            for (d = 0; d < D; d++) s += qs[g * D + d] * k_elem(kv, tile, d, off);
            s *= ks;
            const float m_new = s > m[g] ? s : m[g];
            const float alpha = expf(m[g] - m_new), p = expf(s - m_new), pv = p * vs;
            l[g] = l[g] * alpha + p;
            m[g] = m_new;
            for (d = 0; d < D; d++)
                acc[g * D + d] = acc[g * D + d] * alpha + pv * v_elem(kv, tile, off, d);
        }
    }
    for (g = 0; g < G; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (d = 0; d < D; d++) acc[g * D + d] *= inv;
    }
    store_row_ref(a->out, ((int64_t)seq * a->n_q_heads + (int64_t)head * G) * D, acc, G * D, a->out_dtype);
}

void attn_item_ref(const attn_args *a, int32_t seq, int32_t h0, int32_t h1) {
    for (int32_t h = h0; h < h1; h++) one_head(a, seq, h);
}

double read_sum_ref(const void *buf, int64_t n64) {
    const float *p = (const float *)buf;
    float s[16] = {0};
    for (int64_t i = 0; i < n64; i++)
        for (int j = 0; j < 16; j++) s[j] += p[i * 16 + j];
    double total = 0.0;
    for (int j = 0; j < 16; j++) total += s[j];
    return total;
}
