/* Internal declarations shared by the kernel sources (not part of the cffi cdef). */
#ifndef AIOLLM_ATTN_INTERNAL_H
#define AIOLLM_ATTN_INTERNAL_H
#include <math.h>
#include <string.h>
#include <xmmintrin.h>
#include "aiollm_native.h"

/* Everything one (sequence, kv-head) work item needs; arguments already validated. */
typedef struct {
    const aiollm_kv_layer *kv;
    const float *q;
    int64_t q_seq_stride;
    int32_t n_q_heads;
    int32_t group; /* q heads per kv head */
    const int32_t *block_tables;
    int32_t max_blocks;
    const int32_t *seq_lens;
    float scale;
    void *out;
    int32_t out_dtype;
    int32_t int8_dot; /* int8: AIOLLM_INT8_FP32, _VNNI or _MADD, see aiollm_int8_path */
    int32_t far_prefetch; /* the far (L2) prefetch levels to issue: aiollm_far_prefetch's bits for this storage's
                           * class (AIOLLM_FAR_FLOAT, or AIOLLM_FAR_QUANTISED / _QUANTISED_LINES) */
    int32_t near_i8_bytes; /* AVX-512 int8 / int4 L1 prefetch distance in int8 tile bytes (aiollm_cpu_int8_near_bytes) */
} attn_args;

/* One work item: sequence `seq`, kv heads [h0, h1), all `group` q heads of each at once. The SIMD paths keep
 * the item's q and accumulators on the stack: (h1 - h0) * group * head_dim <= AIOLLM_ITEM_FLOATS. */
#define AIOLLM_ITEM_FLOATS 8192
typedef void (*attn_item_fn)(const attn_args *a, int32_t seq, int32_t h0, int32_t h1);
void attn_item_ref(const attn_args *a, int32_t seq, int32_t h0, int32_t h1);
void attn_item_avx2(const attn_args *a, int32_t seq, int32_t h0, int32_t h1);
void attn_item_avx512(const attn_args *a, int32_t seq, int32_t h0, int32_t h1);
void attn_item_i4_vnni(const attn_args *a, int32_t seq, int32_t h0, int32_t h1); /* AVX-512 VNNI int4 */

/* Read-bandwidth kernels: fp32 sum of n64 * 64 bytes. */
double read_sum_ref(const void *buf, int64_t n64);
double read_sum_avx2(const void *buf, int64_t n64);
double read_sum_avx512(const void *buf, int64_t n64);

/* Thread pool: runs fn(ctx, item, thread) for item in [0, n_items) on n_threads threads (the caller is
 * thread 0); items are claimed one at a time from a shared counter, so callers order them longest first. */
typedef void (*pool_task_fn)(void *ctx, int64_t item, int thread);
int pool_run(int n_threads, int64_t n_items, pool_task_fn fn, void *ctx);
int pool_size(void);

/* Software prefetch shared by the SIMD kernels: `bytes` from *p (when set) with `hint`, and advance *p past them. */
static inline __attribute__((always_inline)) void prefetch_walk(const char **p, int64_t bytes, int hint) {
    if (!*p) return;
    for (int64_t o = 0; o < bytes; o += 64) {
        if (hint == _MM_HINT_T0) _mm_prefetch(*p + o, _MM_HINT_T0);
        else _mm_prefetch(*p + o, _MM_HINT_T1);
    }
    *p += bytes;
}

/* Element offsets of one (block, head) tile. */
static inline int64_t kv_tile(const aiollm_kv_layer *kv, int64_t block, int32_t head) {
    return (block * kv->n_kv_heads + head) * (int64_t)kv->head_dim * kv->block_size;
}
/* Byte offset of one (block, head) tile in a K or V array of storage dtype dt (int4: two codes a byte). */
static inline int64_t kv_tile_bytes(const aiollm_kv_layer *kv, int dt, int64_t block, int32_t head) {
    const int64_t e = kv_tile(kv, block, head);
    return dt == AIOLLM_DT_F32 ? 4 * e : dt == AIOLLM_DT_F16 ? 2 * e : dt == AIOLLM_DT_I4 ? e / 2 : e;
}
/* The first token a query at sequence length n attends to: n - window under a sliding window, else 0. */
static inline int32_t kv_first_token(const aiollm_kv_layer *kv, int32_t n) {
    return kv->window > 0 && n > kv->window ? n - kv->window : 0;
}
static inline int kv_quantised(int dt) { return dt == AIOLLM_DT_I8 || dt == AIOLLM_DT_I4; }

/* The storage checks every entry point makes on a layer whose sizes are already checked: a storage dtype, the
 * scales of a quantised one, and int4's geometry (attn_internal.h's layout needs it). */
static inline int kv_storage_check(const aiollm_kv_layer *kv) {
    const int dt = kv->dtype;
    if (dt != AIOLLM_DT_F32 && dt != AIOLLM_DT_F16 && dt != AIOLLM_DT_I8 && dt != AIOLLM_DT_I4)
        return AIOLLM_ERR_UNSUPPORTED;
    if (kv_quantised(dt) && (!kv->k_scale || !kv->v_scale)) return AIOLLM_ERR_ARG;
    if (dt == AIOLLM_DT_I4 && (kv->head_dim % 32 || kv->block_size % 4)) return AIOLLM_ERR_ARG;
    if (kv->window < 0) return AIOLLM_ERR_ARG;
    return AIOLLM_OK;
}
static inline int64_t kv_scale_tile(const aiollm_kv_layer *kv, int64_t block, int32_t head) {
    return (block * kv->n_kv_heads + head) * (int64_t)kv->block_size;
}

/* int8 tiles are stored in the layout the int8 dot products consume (VNNI / AMX B-tile order), 4 bytes per
 * int32 lane: K as [head_dim / 4][block_size][4] (one 64-byte row = 4 dims of 16 tokens, so one vpdpbusd gives
 * 16 tokens' partial scores), V as [block_size / 4][head_dim][4] (one 64-byte row = 4 tokens of 16 dims, so one
 * vpdpbusd accumulates 4 tokens into 16 output dims). A last group narrower than 4 (head_dim or block_size not
 * a multiple of 4) is packed `w` wide instead, so the tile stays D * BS bytes with no padding. */
static inline int64_t i8_k_at(int D, int BS, int d, int t) {
    const int g = d & ~3, w = D - g < 4 ? D - g : 4;
    return (int64_t)g * BS + (int64_t)t * w + (d & 3);
}
static inline int64_t i8_v_at(int D, int BS, int t, int d) {
    const int g = t & ~3, w = BS - g < 4 ? BS - g : 4;
    return (int64_t)g * D + (int64_t)d * w + (t & 3);
}

/* int4 tiles pair the int8 layout's 4-byte-lane rows, so one load and two nibble masks give two int8 rows: K row
 * pair d / 8 ([4 dims][block_size tokens] twice, 4 * BS bytes) holds dims d & ~7 .. +3 in the low nibbles and the
 * next 4 dims in the high ones; in V each 64-byte line of a 4-token row holds dims [32 k, 32 k + 16) low and
 * [32 k + 16, 32 k + 32) high. Every byte holds two codes of one token (so tokens are written independently),
 * and a 64-byte line unpacks into two lines of the int8 layout. Codes are stored as c + 8, c in [-7, 7].
 * Byte offsets inside a tile (head_dim % 32 == 0, block_size % 4 == 0); the nibble is (d >> 2) & 1 for K and
 * (d >> 4) & 1 for V. */
static inline int64_t i4_k_at(int BS, int d, int t) { return (int64_t)(d >> 3) * 4 * BS + t * 4 + (d & 3); }
static inline int64_t i4_v_at(int D, int t, int d) {
    return (int64_t)(t >> 2) * 2 * D + (d >> 5) * 64 + (d & 15) * 4 + (t & 3);
}

/* Portable fp16 / bf16 conversions (round to nearest even), used by the reference path and kv_write. */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    float f;
    if (e == 0) {
        f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24: zero or subnormal */
        return sign ? -f : f;
    }
    bits = e == 31 ? (sign | 0x7f800000u | (m << 13)) : (sign | ((e + 112u) << 23) | (m << 13));
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_half(float f) {
    uint32_t x, ax, sign;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000u;
    ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past 65504: inf */
    if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal half */
        float af;
        memcpy(&af, &ax, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(af * 16777216.0f));
    }
    ax += 0xfffu + ((ax >> 13) & 1u);
    return (uint16_t)(sign | ((ax - 0x38000000u) >> 13));
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* Store a row of fp32 results as out_dtype. */
static inline void store_row_ref(void *out, int64_t offset, const float *src, int n, int32_t out_dtype) {
    int i;
    if (out_dtype == AIOLLM_DT_F32) {
        memcpy((float *)out + offset, src, (size_t)n * 4);
    } else if (out_dtype == AIOLLM_DT_F16) {
        for (i = 0; i < n; i++) ((uint16_t *)out)[offset + i] = float_to_half(src[i]);
    } else {
        for (i = 0; i < n; i++) ((uint16_t *)out)[offset + i] = float_to_bf16(src[i]);
    }
}

#endif
