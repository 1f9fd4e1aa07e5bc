/* The decode step's small ops that are not matrix products: RMSNorm, RoPE, SiLU(gate) * up, greedy argmax.
 *
 * Why native: at decode batch sizes each of these touches a few hundred KB at most, so through PyTorch
 * their cost is dispatch, temporaries and an OpenMP fork/join per op (RMSNorm in fp32 is six ATen ops),
 * ~3x their arithmetic. Here each is one call on the calling thread (argmax, the one op that reads MBs,
 * runs on the library's pool), no allocation, the GIL released by cffi.
 *
 * Activations are AIOLLM_DT_F32 or AIOLLM_DT_BF16; math is fp32 throughout and a bf16 result is rounded
 * once (to nearest even). Two variants, picked by aiollm_isa(): AVX-512 (F + BW) and portable C; both
 * follow the same formulas, so they differ only by fp32 rounding (the sum of squares is accumulated in
 * another order). fp32 RoPE and the RMSNorm scaling use separate multiplies and adds (this file is built
 * with -std=c11, which keeps GCC from contracting them into FMAs), as transformers' formulas do. */
#include <immintrin.h>
#include <time.h>
#include "attn_internal.h"
#include "gemm_internal.h"

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define INLINE static inline __attribute__((always_inline))
#include "exp_avx512.h"

static int use_avx512(void) { return aiollm_isa() == AIOLLM_ISA_AVX512; }

static inline float ld_ref(const void *p, int64_t i, int32_t dt) {
    return dt == AIOLLM_DT_BF16 ? bf16_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st_ref(void *p, int64_t i, float x, int32_t dt) {
    if (dt == AIOLLM_DT_BF16)
        ((uint16_t *)p)[i] = float_to_bf16(x);
    else
        ((float *)p)[i] = x;
}

/* ---- AVX-512 helpers: n <= 16 lanes at p + i, masked (tails never read or write past the row) ---- */

T512 INLINE __mmask16 lanes(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

T512 INLINE __m512 ld512(const void *p, int64_t i, int n, int32_t dt) {
    if (dt == AIOLLM_DT_BF16) {
        const __m256i h = _mm256_maskz_loadu_epi16(lanes(n), (const uint16_t *)p + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(lanes(n), (const float *)p + i);
}

/* fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN, as float_to_bf16 does. */
T512 INLINE __m256i to_bf16_512(__m512 x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

T512 INLINE __m512 round512(__m512 x, int32_t dt) {
    if (dt != AIOLLM_DT_BF16) return x;
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_512(x)), 16));
}

T512 INLINE void st512(void *p, int64_t i, __m512 x, int n, int32_t dt) {
    if (dt == AIOLLM_DT_BF16)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, lanes(n), to_bf16_512(x));
    else
        _mm512_mask_storeu_ps((float *)p + i, lanes(n), x);
}

/* ---- RMSNorm ---- */

static void rms_norm_ref(const void *x, int64_t xs, const void *w, void *out, int64_t os, int64_t rows,
                         int32_t dim, float eps, int32_t dt) {
    for (int64_t r = 0; r < rows; r++) {
        float acc[16] = {0};
        for (int32_t i = 0; i < dim; i++) {
            const float v = ld_ref(x, r * xs + i, dt);
            acc[i & 15] += v * v;
        }
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += acc[j];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int32_t i = 0; i < dim; i++)
            st_ref(out, r * os + i, ld_ref(w, i, dt) * (ld_ref(x, r * xs + i, dt) * inv), dt);
    }
}

T512 static void rms_norm_avx512(const void *x, int64_t xs, const void *w, void *out, int64_t os, int64_t rows,
                                 int32_t dim, float eps, int32_t dt) {
    for (int64_t r = 0; r < rows; r++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
        int32_t i = 0;
        for (; i + 32 <= dim; i += 32) {
            const __m512 v0 = ld512(x, r * xs + i, 16, dt), v1 = ld512(x, r * xs + i + 16, 16, dt);
            a0 = _mm512_fmadd_ps(v0, v0, a0);
            a1 = _mm512_fmadd_ps(v1, v1, a1);
        }
        for (; i < dim; i += 16) {
            const __m512 v = ld512(x, r * xs + i, dim - i, dt);
            a0 = _mm512_fmadd_ps(v, v, a0);
        }
        const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(sum / (float)dim + eps));
        for (i = 0; i < dim; i += 16) {
            const int n = dim - i;
            const __m512 y = _mm512_mul_ps(ld512(x, r * xs + i, n, dt), inv);
            st512(out, r * os + i, _mm512_mul_ps(ld512(w, i, n, dt), y), n, dt);
        }
    }
}

int aiollm_rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int64_t out_stride,
                    int64_t n_rows, int32_t dim, float eps, int32_t dtype) {
    if (n_rows < 0 || dim < 1 || !(eps >= 0.0f)) return AIOLLM_ERR_ARG;
    if (dtype != AIOLLM_DT_F32 && dtype != AIOLLM_DT_BF16) return AIOLLM_ERR_UNSUPPORTED;
    if (n_rows == 0) return AIOLLM_OK;
    if (!x || !weight || !out || x_stride < dim || out_stride < dim) return AIOLLM_ERR_ARG;
    if (use_avx512())
        rms_norm_avx512(x, x_stride, weight, out, out_stride, n_rows, dim, eps, dtype);
    else
        rms_norm_ref(x, x_stride, weight, out, out_stride, n_rows, dim, eps, dtype);
    return AIOLLM_OK;
}

/* ---- RoPE (half-split, sign-folded sin table: out = x * cos + roll(x, D/2) * sin) ---- */

typedef struct {
    const void *cos, *sin; /* [n_positions, head_dim] of dtype */
    int32_t head_dim, dtype;
} rope_table;

/* Rotate heads [0, n_heads) of one token: x at xi (dtype), out at oi (out_dtype); out may alias x. The result
 * is rounded to x's dtype even when out is fp32, so a bf16 model's fp32 q equals its bf16 q widened: what an
 * R-worker computes from the bf16 q it receives (colocated and offloaded decode give the same tokens). */
static inline float round_to(float x, int32_t dt) { return dt == AIOLLM_DT_BF16 ? bf16_to_float(float_to_bf16(x)) : x; }

static void rope_token_ref(const void *x, int64_t xi, void *out, int64_t oi, int32_t out_dt, int32_t n_heads,
                           const rope_table *t, int64_t pos, int32_t dt) {
    const int32_t D = t->head_dim, half = D / 2;
    const int64_t ti = pos * D;
    for (int32_t h = 0; h < n_heads; h++) {
        for (int32_t i = 0; i < half; i++) {
            const float a = ld_ref(x, xi + (int64_t)h * D + i, dt), b = ld_ref(x, xi + (int64_t)h * D + half + i, dt);
            const float ra = a * ld_ref(t->cos, ti + i, t->dtype) + b * ld_ref(t->sin, ti + i, t->dtype);
            const float rb = b * ld_ref(t->cos, ti + half + i, t->dtype) + a * ld_ref(t->sin, ti + half + i, t->dtype);
            st_ref(out, oi + (int64_t)h * D + i, round_to(ra, dt), out_dt);
            st_ref(out, oi + (int64_t)h * D + half + i, round_to(rb, dt), out_dt);
        }
    }
}

T512 static void rope_token_avx512(const void *x, int64_t xi, void *out, int64_t oi, int32_t out_dt,
                                   int32_t n_heads, const rope_table *t, int64_t pos, int32_t dt) {
    const int32_t D = t->head_dim, half = D / 2;
    const int64_t ti = pos * D;
    for (int32_t i = 0; i < half; i += 16) {
        const int n = half - i;
        const __m512 ca = ld512(t->cos, ti + i, n, t->dtype), cb = ld512(t->cos, ti + half + i, n, t->dtype);
        const __m512 sa = ld512(t->sin, ti + i, n, t->dtype), sb = ld512(t->sin, ti + half + i, n, t->dtype);
        for (int32_t h = 0; h < n_heads; h++) {
            const int64_t xa = xi + (int64_t)h * D + i, oa = oi + (int64_t)h * D + i;
            const __m512 a = ld512(x, xa, n, dt), b = ld512(x, xa + half, n, dt);
            st512(out, oa, round512(_mm512_add_ps(_mm512_mul_ps(a, ca), _mm512_mul_ps(b, sa)), dt), n, out_dt);
            st512(out, oa + half, round512(_mm512_add_ps(_mm512_mul_ps(b, cb), _mm512_mul_ps(a, sb)), dt), n, out_dt);
        }
    }
}

int aiollm_rope_qk(void *qkv, int64_t row_stride, int64_t n_rows, int32_t n_q_heads, int32_t n_kv_heads,
                   int32_t head_dim, const int64_t *positions, const void *cos, const void *sin,
                   int64_t n_positions, void *q_out, int64_t q_out_stride, int32_t q_out_dtype, int32_t dtype) {
    if (n_rows < 0 || n_q_heads < 0 || n_kv_heads < 0 || head_dim < 2 || head_dim % 2 || n_positions < 0)
        return AIOLLM_ERR_ARG;
    if ((dtype != AIOLLM_DT_F32 && dtype != AIOLLM_DT_BF16) ||
        (q_out_dtype != AIOLLM_DT_F32 && q_out_dtype != AIOLLM_DT_BF16))
        return AIOLLM_ERR_UNSUPPORTED;
    if (n_rows == 0) return AIOLLM_OK;
    const int64_t q_size = (int64_t)n_q_heads * head_dim;
    if (!qkv || !positions || !cos || !sin || !q_out || row_stride < q_size + (int64_t)n_kv_heads * head_dim ||
        q_out_stride < q_size)
        return AIOLLM_ERR_ARG;
    for (int64_t r = 0; r < n_rows; r++)
        if (positions[r] < 0 || positions[r] >= n_positions) return AIOLLM_ERR_ARG;
    const rope_table t = {cos, sin, head_dim, dtype};
    const int simd = use_avx512();
    for (int64_t r = 0; r < n_rows; r++) {
        const int64_t xi = r * row_stride;
        if (simd) {
            rope_token_avx512(qkv, xi, q_out, r * q_out_stride, q_out_dtype, n_q_heads, &t, positions[r], dtype);
            rope_token_avx512(qkv, xi + q_size, qkv, xi + q_size, dtype, n_kv_heads, &t, positions[r], dtype);
        } else {
            rope_token_ref(qkv, xi, q_out, r * q_out_stride, q_out_dtype, n_q_heads, &t, positions[r], dtype);
            rope_token_ref(qkv, xi + q_size, qkv, xi + q_size, dtype, n_kv_heads, &t, positions[r], dtype);
        }
    }
    return AIOLLM_OK;
}

/* ---- SiLU(gate) * up, gate and up the two halves of one row ---- */

static void silu_mul_ref(const void *gu, int64_t is, void *out, int64_t os, int64_t rows, int32_t dim, int32_t dt) {
    for (int64_t r = 0; r < rows; r++)
        for (int32_t i = 0; i < dim; i++) {
            const float g = ld_ref(gu, r * is + i, dt), u = ld_ref(gu, r * is + dim + i, dt);
            st_ref(out, r * os + i, g / (1.0f + expf(-g)) * u, dt);
        }
}

/* exp of x clamped to [-104, 88]: small arguments underflow to 0 as expf does, and the top stays finite (silu's
 * 1 / (1 + e) then stays a finite reciprocal: its value there, below 1e-38, is lost either way). */
T512 INLINE __m512 exp_full(__m512 x) { return exp512_clamped(x, -104.0f); }

T512 static void silu_mul_avx512(const void *gu, int64_t is, void *out, int64_t os, int64_t rows, int32_t dim,
                                 int32_t dt) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t r = 0; r < rows; r++)
        for (int32_t i = 0; i < dim; i += 16) {
            const int n = dim - i;
            const __m512 g = ld512(gu, r * is + i, n, dt), u = ld512(gu, r * is + dim + i, n, dt);
            /* 1 / (1 + e) as rcp14 and one Newton step (~1 ulp): a vdivps costs ~16 cycles, more than the rest */
            const __m512 d = _mm512_add_ps(one, exp_full(_mm512_sub_ps(_mm512_setzero_ps(), g)));
            __m512 rcp = _mm512_rcp14_ps(d);
            rcp = _mm512_mul_ps(rcp, _mm512_fnmadd_ps(d, rcp, _mm512_set1_ps(2.0f)));
            st512(out, r * os + i, _mm512_mul_ps(_mm512_mul_ps(g, rcp), u), n, dt);
        }
}

int aiollm_silu_mul(const void *gate_up, int64_t in_stride, void *out, int64_t out_stride, int64_t n_rows,
                    int32_t dim, int32_t dtype) {
    if (n_rows < 0 || dim < 1) return AIOLLM_ERR_ARG;
    if (dtype != AIOLLM_DT_F32 && dtype != AIOLLM_DT_BF16) return AIOLLM_ERR_UNSUPPORTED;
    if (n_rows == 0) return AIOLLM_OK;
    if (!gate_up || !out || in_stride < 2 * (int64_t)dim || out_stride < dim) return AIOLLM_ERR_ARG;
    if (use_avx512())
        silu_mul_avx512(gate_up, in_stride, out, out_stride, n_rows, dim, dtype);
    else
        silu_mul_ref(gate_up, in_stride, out, out_stride, n_rows, dim, dtype);
    return AIOLLM_OK;
}

/* ---- argmax of fp32 rows: the first maximal index, or the first NaN's (torch.argmax's answer) ---- */

static int64_t argmax_ref(const float *x, int32_t n) {
    int64_t best = 0;
    for (int32_t i = 0; i < n; i++) {
        if (isnan(x[i])) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

T512 static int64_t argmax_avx512(const float *x, int32_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int32_t i = 0; i < n; i += 16) {
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(n - i), x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    if (nan) return argmax_ref(x, n);
    const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    for (int32_t i = 0; i < n; i += 16) {
        const __mmask16 hit = _mm512_mask_cmp_ps_mask(lanes(n - i), _mm512_maskz_loadu_ps(lanes(n - i), x + i), best, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    return 0;
}

typedef struct {
    const float *x;
    int64_t stride;
    int32_t n;
    int64_t *out;
    int64_t (*fn)(const float *, int32_t);
} argmax_job;

static void argmax_task(void *ctx, int64_t row, int thread) {
    const argmax_job *j = (const argmax_job *)ctx;
    (void)thread;
    j->out[row] = j->fn(j->x + row * j->stride, j->n);
}

int aiollm_argmax_rows(const float *x, int64_t row_stride, int64_t n_rows, int32_t n_cols, int64_t *out,
                       int32_t n_threads) {
    if (n_rows < 0 || n_cols < 1) return AIOLLM_ERR_ARG;
    if (n_rows == 0) return AIOLLM_OK;
    if (!x || !out || row_stride < n_cols) return AIOLLM_ERR_ARG;
    argmax_job job = {x, row_stride, n_cols, out, use_avx512() ? argmax_avx512 : argmax_ref};
    gemm_run(n_threads < n_rows ? n_threads : (int)n_rows, n_rows, argmax_task, &job);
    return AIOLLM_OK;
}

/* ---- one decode layer's S-part in one call: the ops above and the GEMM back to back ----
 *
 * Through Python a layer's S-part would be ~12 calls (each with argument checks, a tensor allocation and a
 * cffi crossing): ~0.15 ms per layer, 4-5 ms of a 30-layer step, more than the norms, RoPE and SiLU
 * themselves. Here it is two calls per layer. The row-wise ops run on the GEMM's threads (torch's OpenMP
 * team, see gemm_team.c) when the batch is large enough to pay for the fork, split by rows, so every
 * result is the same bits as the single-threaded calls above. */

typedef void (*rows_fn)(void *ctx, int64_t r0, int64_t r1);
typedef struct {
    rows_fn fn;
    void *ctx;
    int64_t n_rows, per;
} rows_job;

static void rows_task(void *ctx, int64_t item, int thread) {
    const rows_job *j = (const rows_job *)ctx;
    (void)thread;
    const int64_t r0 = item * j->per, r1 = r0 + j->per < j->n_rows ? r0 + j->per : j->n_rows;
    j->fn(j->ctx, r0, r1);
}

/* fn over rows [0, n_rows), split in pieces of at least ROWS_MIN_ELEMS elements over n_threads threads. */
#define ROWS_MIN_ELEMS 16384
static void run_rows(int32_t n_threads, int64_t n_rows, int64_t row_elems, rows_fn fn, void *ctx) {
    const int64_t min_rows = row_elems >= ROWS_MIN_ELEMS ? 1 : ROWS_MIN_ELEMS / row_elems;
    int64_t items = n_rows / min_rows;
    if (items > 4 * (int64_t)n_threads) items = 4 * (int64_t)n_threads;
    if (n_threads <= 1 || items <= 1) {
        fn(ctx, 0, n_rows);
        return;
    }
    rows_job job = {fn, ctx, n_rows, (n_rows + items - 1) / items};
    const int64_t n_items = (n_rows + job.per - 1) / job.per;
    gemm_run(n_threads < n_items ? n_threads : (int32_t)n_items, n_items, rows_task, &job);
}

static inline size_t elem_size(int32_t dt) { return dt == AIOLLM_DT_BF16 ? 2 : 4; }

typedef struct {
    const void *x, *w;
    void *out;
    int64_t xs, os;
    int32_t dim, dt;
    float eps;
} norm_ctx;

static void norm_rows(void *ctx, int64_t r0, int64_t r1) {
    const norm_ctx *c = (const norm_ctx *)ctx;
    const size_t e = elem_size(c->dt);
    const void *x = (const char *)c->x + (size_t)(r0 * c->xs) * e;
    void *out = (char *)c->out + (size_t)(r0 * c->os) * e;
    if (use_avx512())
        rms_norm_avx512(x, c->xs, c->w, out, c->os, r1 - r0, c->dim, c->eps, c->dt);
    else
        rms_norm_ref(x, c->xs, c->w, out, c->os, r1 - r0, c->dim, c->eps, c->dt);
}

typedef struct {
    void *qkv, *q_out;
    int64_t rs, qs;
    const int64_t *positions;
    rope_table t;
    int32_t n_q_heads, n_kv_heads, q_dt, dt;
    const aiollm_kv_layer *kv; /* NULL: leave k and v in qkv only */
    const int64_t *slots;
} rope_ctx;

static void rope_rows(void *ctx, int64_t r0, int64_t r1) {
    const rope_ctx *c = (const rope_ctx *)ctx;
    const int64_t q_size = (int64_t)c->n_q_heads * c->t.head_dim;
    const int simd = use_avx512();
    for (int64_t r = r0; r < r1; r++) {
        const int64_t xi = r * c->rs;
        if (simd) {
            rope_token_avx512(c->qkv, xi, c->q_out, r * c->qs, c->q_dt, c->n_q_heads, &c->t, c->positions[r], c->dt);
            rope_token_avx512(c->qkv, xi + q_size, c->qkv, xi + q_size, c->dt, c->n_kv_heads, &c->t, c->positions[r],
                              c->dt);
        } else {
            rope_token_ref(c->qkv, xi, c->q_out, r * c->qs, c->q_dt, c->n_q_heads, &c->t, c->positions[r], c->dt);
            rope_token_ref(c->qkv, xi + q_size, c->qkv, xi + q_size, c->dt, c->n_kv_heads, &c->t, c->positions[r],
                           c->dt);
        }
        if (c->kv) { /* this row's k and v into the cache while they are in L1 (checked by the caller) */
            const char *k = (const char *)c->qkv + (size_t)(xi + q_size) * elem_size(c->dt);
            const char *v = k + (size_t)c->n_kv_heads * c->t.head_dim * elem_size(c->dt);
            aiollm_kv_write(c->kv, c->slots + r, 1, k, c->rs, v, c->rs, c->dt);
        }
    }
}

typedef struct {
    const void *gu;
    void *out;
    int64_t is, os;
    int32_t dim, dt;
} silu_ctx;

static void silu_rows(void *ctx, int64_t r0, int64_t r1) {
    const silu_ctx *c = (const silu_ctx *)ctx;
    const size_t e = elem_size(c->dt);
    const void *gu = (const char *)c->gu + (size_t)(r0 * c->is) * e;
    void *out = (char *)c->out + (size_t)(r0 * c->os) * e;
    if (use_avx512())
        silu_mul_avx512(gu, c->is, out, c->os, r1 - r0, c->dim, c->dt);
    else
        silu_mul_ref(gu, c->is, out, c->os, r1 - r0, c->dim, c->dt);
}

/* The cache layer and slots aiollm_layer_pre_kv may write: every check aiollm_kv_write makes, done once up
 * front so the per-row writes inside the row tasks cannot fail. */
static int check_kv_target(const aiollm_kv_layer *kv, const int64_t *slots, int64_t n_rows, int32_t n_kv_heads,
                           int32_t head_dim) {
    if (!slots || !kv->k || !kv->v || kv->block_size < 1 || kv->n_blocks < 0 || kv->n_kv_heads != n_kv_heads ||
        kv->head_dim != head_dim || head_dim > AIOLLM_MAX_HEAD_DIM)
        return AIOLLM_ERR_ARG;
    const int storage = kv_storage_check(kv);
    if (storage != AIOLLM_OK) return storage;
    const int64_t n_slots = kv->n_blocks * kv->block_size;
    for (int64_t r = 0; r < n_rows; r++)
        if (slots[r] < 0 || slots[r] >= n_slots) return AIOLLM_ERR_SLOT;
    return AIOLLM_OK;
}

int aiollm_layer_pre(const void *h, int64_t n_rows, int32_t hidden, const void *norm_weight, float eps,
                     const void *w_qkv, int32_t n_qkv, void *xn, void *qkv, int32_t n_q_heads, int32_t n_kv_heads,
                     int32_t head_dim, const int64_t *positions, const void *cos, const void *sin,
                     int64_t n_positions, void *q_out, int64_t q_out_stride, int32_t q_out_dtype, int32_t dtype,
                     int32_t n_threads) {
    return aiollm_layer_pre_kv(h, n_rows, hidden, norm_weight, eps, w_qkv, n_qkv, xn, qkv, n_q_heads, n_kv_heads,
                               head_dim, positions, cos, sin, n_positions, q_out, q_out_stride, q_out_dtype, dtype,
                               NULL, NULL, n_threads);
}

int aiollm_layer_pre_kv(const void *h, int64_t n_rows, int32_t hidden, const void *norm_weight, float eps,
                        const void *w_qkv, int32_t n_qkv, void *xn, void *qkv, int32_t n_q_heads, int32_t n_kv_heads,
                        int32_t head_dim, const int64_t *positions, const void *cos, const void *sin,
                        int64_t n_positions, void *q_out, int64_t q_out_stride, int32_t q_out_dtype, int32_t dtype,
                        const aiollm_kv_layer *kv, const int64_t *slots, int32_t n_threads) {
    if (n_rows < 0 || n_rows > INT32_MAX || hidden < 1 || !(eps >= 0.0f) || n_q_heads < 0 || n_kv_heads < 0 || head_dim < 2 ||
        head_dim % 2 || n_positions < 0 || (int64_t)(n_q_heads + n_kv_heads) * head_dim > n_qkv)
        return AIOLLM_ERR_ARG;
    if ((dtype != AIOLLM_DT_F32 && dtype != AIOLLM_DT_BF16) ||
        (q_out_dtype != AIOLLM_DT_F32 && q_out_dtype != AIOLLM_DT_BF16) || !aiollm_gemm_supported(dtype))
        return AIOLLM_ERR_UNSUPPORTED;
    if (n_rows == 0) return AIOLLM_OK;
    if (!h || !norm_weight || !w_qkv || !xn || !qkv || !positions || !cos || !sin || !q_out ||
        q_out_stride < (int64_t)n_q_heads * head_dim || (q_out == qkv && (q_out_dtype != dtype || q_out_stride != n_qkv)))
        return AIOLLM_ERR_ARG;
    for (int64_t r = 0; r < n_rows; r++)
        if (positions[r] < 0 || positions[r] >= n_positions) return AIOLLM_ERR_ARG;
    if (kv) {
        const int status = check_kv_target(kv, slots, n_rows, n_kv_heads, head_dim);
        if (status != AIOLLM_OK) return status;
    }
    if (n_threads < 1) n_threads = 1;
    norm_ctx norm = {h, norm_weight, xn, hidden, hidden, hidden, dtype, eps};
    run_rows(n_threads, n_rows, hidden, norm_rows, &norm);
    const int status = aiollm_gemm(xn, hidden, (int32_t)n_rows, w_qkv, n_qkv, hidden, dtype, NULL, 0, qkv, n_qkv,
                                   n_threads);
    if (status != AIOLLM_OK) return status;
    rope_ctx rope = {qkv, q_out, n_qkv, q_out_stride, positions, {cos, sin, head_dim, dtype},
                     n_q_heads, n_kv_heads, q_out_dtype, dtype, kv, slots};
    run_rows(n_threads, n_rows, n_qkv, rope_rows, &rope);
    return AIOLLM_OK;
}

int aiollm_layer_post(const void *h, const void *attn, void *h_out, int64_t n_rows, int32_t hidden, int32_t q_size,
                      int32_t ffn, const void *w_o, const void *norm_weight, float eps, const void *w_gate_up,
                      const void *w_down, void *xn, void *gate_up, void *act, int32_t dtype, int32_t n_threads) {
    if (n_rows < 0 || n_rows > INT32_MAX || hidden < 1 || q_size < 1 || ffn < 1 || !(eps >= 0.0f))
        return AIOLLM_ERR_ARG;
    if ((dtype != AIOLLM_DT_F32 && dtype != AIOLLM_DT_BF16) || !aiollm_gemm_supported(dtype))
        return AIOLLM_ERR_UNSUPPORTED;
    if (n_rows == 0) return AIOLLM_OK;
    if (!h || !attn || !h_out || !w_o || !norm_weight || !w_gate_up || !w_down || !xn || !gate_up || !act)
        return AIOLLM_ERR_ARG;
    if (n_threads < 1) n_threads = 1;
    const int32_t m = (int32_t)n_rows;
    int status = aiollm_gemm(attn, q_size, m, w_o, hidden, q_size, dtype, h, hidden, h_out, hidden, n_threads);
    if (status != AIOLLM_OK) return status;
    norm_ctx norm = {h_out, norm_weight, xn, hidden, hidden, hidden, dtype, eps};
    run_rows(n_threads, n_rows, hidden, norm_rows, &norm);
    status = aiollm_gemm(xn, hidden, m, w_gate_up, 2 * ffn, hidden, dtype, NULL, 0, gate_up, 2 * (int64_t)ffn,
                         n_threads);
    if (status != AIOLLM_OK) return status;
    silu_ctx silu = {gate_up, act, 2 * (int64_t)ffn, ffn, ffn, dtype};
    run_rows(n_threads, n_rows, 2 * (int64_t)ffn, silu_rows, &silu);
    /* residual and output the same rows: each element is read before it is written, by the same thread */
    return aiollm_gemm(act, ffn, m, w_down, hidden, ffn, dtype, h_out, hidden, h_out, hidden, n_threads);
}

/* ---- a decode step's layers in one call: pre-attention half, attention, post-attention half, per layer ----
 *
 * Through Python each layer would be three calls (layer_pre_kv, decode_attention, layer_post) with their argument
 * checks, views and a tensor allocation each: ~8-11 ms of Python and ATen per SmolLM2 fp32 step at batch 64
 * (~8 % of the step) during which the OpenMP team waits. The same three functions run here in the same order
 * on the same buffers, so the results are the same bits. seconds (optional) accumulates the wall time of the
 * layers' S-part halves [0] and attention calls [1], for the benchmarks' step breakdown. */
static double now_s(void) {
    struct timespec t;
    timespec_get(&t, TIME_UTC);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int aiollm_decode_layers(void *h, int64_t n_rows, int32_t n_layers, const aiollm_decode_layer *layers,
                         int32_t hidden, int32_t n_qkv, int32_t ffn, float eps, int32_t n_q_heads, int32_t n_kv_heads,
                         int32_t head_dim, const int64_t *positions, const void *cos, const void *sin,
                         int64_t n_positions, const int64_t *slots, const int32_t *block_tables, int32_t max_blocks,
                         const int32_t *seq_lens, float scale, void *xn, void *qkv, float *q, void *attn_out,
                         void *gate_up, void *act, int32_t dtype, int32_t n_threads, int32_t attn_threads,
                         double *seconds) {
    if (n_layers < 0 || !layers || n_rows > INT32_MAX) return AIOLLM_ERR_ARG;
    const int64_t q_size = (int64_t)n_q_heads * head_dim;
    double s = 0.0, a = 0.0;
    for (int32_t l = 0; l < n_layers; l++) {
        const aiollm_decode_layer *w = &layers[l];
        if (!w->kv) return AIOLLM_ERR_ARG;
        const double t0 = seconds ? now_s() : 0.0;
        int status = aiollm_layer_pre_kv(h, n_rows, hidden, w->attn_norm, eps, w->w_qkv, n_qkv, xn, qkv, n_q_heads,
                                         n_kv_heads, head_dim, positions, cos, sin, n_positions, q, q_size,
                                         AIOLLM_DT_F32, dtype, w->kv, slots, n_threads);
        if (status != AIOLLM_OK) return status;
        const double t1 = seconds ? now_s() : 0.0;
        status = aiollm_decode_attention(w->kv, q, q_size, (int32_t)n_rows, n_q_heads, block_tables, max_blocks,
                                         seq_lens, scale, attn_out, dtype, attn_threads);
        if (status != AIOLLM_OK) return status;
        const double t2 = seconds ? now_s() : 0.0;
        status = aiollm_layer_post(h, attn_out, h, n_rows, hidden, (int32_t)q_size, ffn, w->w_o, w->mlp_norm, eps,
                                   w->w_gate_up, w->w_down, xn, gate_up, act, dtype, n_threads);
        if (status != AIOLLM_OK) return status;
        if (seconds) {
            const double t3 = now_s();
            s += (t1 - t0) + (t3 - t2);
            a += t2 - t1;
        }
    }
    if (seconds) {
        seconds[0] += s;
        seconds[1] += a;
    }
    return AIOLLM_OK;
}
