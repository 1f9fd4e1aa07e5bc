/* The decode step's small ops that are not matrix products: RMSNorm, RoPE, SiLU(gate) * up, greedy argmax.
 *
 * Why native: at decode batch sizes each of these touches a few hundred KB at most, so through PyTorch
 * their cost was dispatch, temporaries and an OpenMP fork/join per op (RMSNorm in fp32 is six ATen ops),
 * ~3x their arithmetic. Here each is one call on the calling thread (argmax, the one op that reads MBs,
 * runs on the library's pool), no allocation, the GIL released by cffi.
 *
 * Activations are AIOLLM_DT_F32 or AIOLLM_DT_BF16; math is fp32 throughout and a bf16 result is rounded
 * once (to nearest even). Two variants, picked by aiollm_isa(): AVX-512 (F + BW) and portable C; both
 * follow the same formulas, so they differ only by fp32 rounding (the sum of squares is accumulated in
 * another order). fp32 RoPE and the RMSNorm scaling use separate multiplies and adds (this file is built
 * with -std=c11, which keeps GCC from contracting them into FMAs), as transformers' formulas do. */
#include <immintrin.h>
#include "attn_internal.h"

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
    pool_run(n_threads, n_rows, argmax_task, &job);
    return AIOLLM_OK;
}
