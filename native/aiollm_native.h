/* aiollm native kernel library: the one header, also used as the cffi cdef.
 * native/build.py keeps the `#define NAME value` lines and drops every other preprocessor line,
 * so everything here must be plain declarations cffi can parse. */
#ifndef AIOLLM_NATIVE_H
#define AIOLLM_NATIVE_H
#include <stdint.h>
#include <stddef.h>

/* CPU features probed once at load; bit flags below. */
#define AIOLLM_CPU_AVX2 1
#define AIOLLM_CPU_FMA 2
#define AIOLLM_CPU_F16C 4
#define AIOLLM_CPU_AVX512F 8
#define AIOLLM_CPU_AVX512BW 16
#define AIOLLM_CPU_AVX512VNNI 32  /* int8 K scores and P x V as int8 dot products (vpdpbusd) */
#define AIOLLM_CPU_AVX512VBMI 64
uint32_t aiollm_cpu_features(void);
/* The far (L2) software prefetch levels of the SIMD attention kernels, a mask of these (attn_avx512_impl.h). */
#define AIOLLM_FAR_FLOAT 1           /* fp32 / fp16 KV: each line of the tiles 8 KiB ahead as the same line is read */
#define AIOLLM_FAR_QUANTISED 2       /* int8 / int4 KV: whole K and V tiles, 16 tiles ahead, once per tile */
#define AIOLLM_FAR_QUANTISED_LINES 4 /* int8 / int4 items of many heads (Llama): each line 16 KiB ahead as the same
                                      * line is read in the score loop, instead of the whole tiles */
#define AIOLLM_FAR_ALL 7
/* The far levels (AIOLLM_FAR_* mask) that pay on this CPU; without them the hardware prefetchers do better
 * (native/cpu.c). */
int aiollm_cpu_far_prefetch_default(void);
/* 1 where an int8 GQA group of 1 runs the AVX2 kernel's MADD dot products, not AVX-512 VNNI (AMD family 0x1A and
 * later), unless an ISA or an int8 path is forced. */
int aiollm_cpu_int8_group1_madd(void);
/* Bytes of int8 tiles the AVX-512 kernel's int8 / int4 items prefetch into L1 ahead (8192 on AMD Zen 4, else 4096). */
int aiollm_cpu_int8_near_bytes(void);

/* ---- status codes: every entry point that can fail returns one ---- */
#define AIOLLM_OK 0
#define AIOLLM_ERR_ARG 1         /* a size or count argument out of range (or a NULL pointer) */
#define AIOLLM_ERR_BLOCK 2       /* a block-table entry in use lies outside the pool */
#define AIOLLM_ERR_LEN 3         /* a sequence length is negative or needs more blocks than its table row */
#define AIOLLM_ERR_SLOT 4        /* a slot-mapping entry lies outside the pool */
#define AIOLLM_ERR_UNSUPPORTED 5 /* an ISA the CPU lacks, or a dtype combination not implemented */
#define AIOLLM_ERR_NOMEM 6

/* ---- element types ---- */
#define AIOLLM_DT_F32 0
#define AIOLLM_DT_F16 1
#define AIOLLM_DT_BF16 2
#define AIOLLM_DT_I8 3
#define AIOLLM_DT_I4 4 /* KV storage only: two 4-bit codes per byte, see aiollm_kv_layer */

/* ---- kernel variants (ISA) ---- */
#define AIOLLM_ISA_REF 0
#define AIOLLM_ISA_AVX2 1
#define AIOLLM_ISA_AVX512 2

/* Limits every path honours (they size per-thread scratch on the stack). */
#define AIOLLM_MAX_HEAD_DIM 256
#define AIOLLM_MAX_GROUP 32
#define AIOLLM_MAX_THREADS 64

/* One layer of a paged KV pool.
 *   k:       [n_blocks, n_kv_heads, head_dim, block_size]  (K transposed inside a block: the 16 tokens of a
 *            chunk are contiguous per dimension, so 16 scores come out of FMAs with no horizontal sums)
 *   v:       [n_blocks, n_kv_heads, block_size, head_dim]
 *   k_scale, v_scale: int8 and int4 only, fp16 bits [n_blocks, n_kv_heads, block_size] (symmetric, per token per
 *            head; fp16 rather than fp32 saves 2 of the 68 bytes a SmolLM2 int8 head row cost);
 *            NULL for fp32/fp16 storage.
 * dtype is AIOLLM_DT_F32, AIOLLM_DT_F16, AIOLLM_DT_I8 or AIOLLM_DT_I4. int8 and int4 tiles interleave their codes
 * for the int8 dot products (native/attn_internal.h); an int4 tile is head_dim * block_size / 2 bytes and needs
 * head_dim % 32 == 0 and block_size % 4 == 0 (every byte then holds two codes of one token).
 * window > 0 limits decode attention to each sequence's last `window` tokens (Mistral's sliding window); the
 * block-table entries before the window's first block are checked but not read. */
typedef struct {
    void *k;
    void *v;
    uint16_t *k_scale;
    uint16_t *v_scale;
    int64_t n_blocks;
    int32_t block_size;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t dtype;
    int32_t window; /* sliding-window attention: a query at length n attends to its last `window` tokens only,
                     * [max(0, n - window), n); 0: every token */
} aiollm_kv_layer;

/* Write n_tokens new tokens into their slots (slot = block_id * block_size + offset).
 * k, v: [n_tokens, n_kv_heads, head_dim] of in_dtype (F32, F16 or BF16); heads and dims contiguous, tokens
 * token_stride elements apart. Converts to the pool dtype; int8 and int4 are quantised here (scale = max|x| / 127
 * or / 7).
 * Every slot is checked before anything is written. */
int aiollm_kv_write(const aiollm_kv_layer *kv, const int64_t *slots, int64_t n_tokens,
                    const void *k, int64_t k_token_stride, const void *v, int64_t v_token_stride,
                    int32_t in_dtype);

/* Decode attention, one query token per sequence, grouped-query.
 *   q:            fp32 [n_seqs, n_q_heads, head_dim], heads contiguous, sequences q_seq_stride floats apart
 *   block_tables: int32 [n_seqs, max_blocks]; only the first ceil(seq_len / block_size) entries of a row are read
 *   seq_lens:     int32 [n_seqs]; a length of 0 yields a zero output row
 *   out:          [n_seqs, n_q_heads, head_dim] contiguous, of out_dtype (F32, F16 or BF16)
 *   n_threads:    threads of the library's pool to use (<= 0: 1)
 * Every length and every block-table entry in use is checked before any work starts. The GIL is released
 * by cffi during the call. */
int aiollm_decode_attention(const aiollm_kv_layer *kv, const float *q, int64_t q_seq_stride,
                            int32_t n_seqs, int32_t n_q_heads, const int32_t *block_tables,
                            int32_t max_blocks, const int32_t *seq_lens, float scale,
                            void *out, int32_t out_dtype, int32_t n_threads);

/* The one dispatch point. aiollm_isa() is the variant in use: probed once from the CPU, unless the
 * environment variable AIOLLM_ATTN_ISA (ref, avx2, avx512) says otherwise. aiollm_set_isa forces one
 * (-1: back to the probe); AIOLLM_ERR_UNSUPPORTED if the CPU lacks it. A call whose shape a SIMD variant
 * does not cover (head_dim % 16, block_size % 16) runs the reference path. */
int aiollm_isa(void);
int aiollm_isa_supported(int32_t isa);
int aiollm_set_isa(int32_t isa);

/* How int8 KV attention is computed: fp32 math (every kernel), or int8 dot products with q and the softmax
 * weights quantised to 8 bits too: VNNI (vpdpbusd, the AVX-512 kernel on CPUs with AVX512-VNNI) or MADD
 * (vpmaddubsw + vpmaddwd, the AVX2 kernel, which also takes VNNI to mean its own dot products). Probed once (VNNI,
 * else MADD, else FP32), overridable by AIOLLM_ATTN_INT8 (fp32, vnni, madd) or aiollm_set_int8_path (-1: back to
 * the probe; AIOLLM_ERR_UNSUPPORTED if the CPU lacks it). On Zen 5 the probed VNNI path leaves a GQA group of 1 to
 * the AVX2 kernel's MADD (faster there from DRAM, dispatch.c); a forced ISA or path serves every call. */
#define AIOLLM_INT8_FP32 0
#define AIOLLM_INT8_VNNI 1
#define AIOLLM_INT8_MADD 2
int aiollm_int8_path(void);
int aiollm_int8_path_supported(int32_t path);
int aiollm_set_int8_path(int32_t path);

/* The far (L2) software prefetch levels (AIOLLM_FAR_* mask, 0-7) the SIMD kernels issue (the AVX2 kernel has one
 * for fp16/fp32 only). Probed once (aiollm_cpu_far_prefetch_default), overridable by AIOLLM_ATTN_FAR_PREFETCH (the
 * mask as one digit, 0-7) or aiollm_set_far_prefetch (-1: back to the probe). The results are the same either
 * way; only the speed differs. */
int aiollm_far_prefetch(void);
int aiollm_set_far_prefetch(int32_t mask);

/* STREAM-like read bandwidth probe: reads nbytes (a multiple of 64) with the variant in use on n_threads
 * threads of the pool and returns the fp32 sum of the data (so the reads cannot be optimised away). */
double aiollm_read_sum(const void *buf, int64_t nbytes, int32_t n_threads);

/* fp32 multiply-add peak probe (native/fma_peak.c): n_iters rounds of 12 independent FMAs of the ISA in use's widest
 * vector on each of n_threads threads of the pool, nothing else; returns the multiply-adds done (vector lanes), -1
 * for n_iters < 1 or n_threads outside 1..AIOLLM_MAX_THREADS. The caller times the call. */
int64_t aiollm_fma_peak(int64_t n_iters, int32_t n_threads);

/* Run this thread's later aiollm_decode_attention calls on its OpenMP team (the one its GEMMs and torch ops
 * use; 1) or on the library's pool (0, the default); returns the previous setting. Where the process has no
 * team the pool runs them anyway, and AIOLLM_ATTN_POOL=1 (read once) keeps every call on the pool. */
int aiollm_set_attn_team(int32_t on);

/* Threads the pool has started so far (it grows on demand up to AIOLLM_MAX_THREADS - 1 workers + caller). */
int aiollm_pool_size(void);

/* ---- the decode step's small ops (native/fused_ops.c): one call each on the calling thread, no allocation ----
 * dtype / out dtypes: AIOLLM_DT_F32 or AIOLLM_DT_BF16 (fp32 math, a bf16 result rounded once). Rows are
 * *_stride elements apart, each row's elements contiguous. The variant follows aiollm_isa() (AVX-512 or
 * portable C).
 * aiollm_rms_norm: out = weight * (x * 1/sqrt(mean(x^2) + eps)) per row of dim elements; out may alias x.
 * aiollm_rope_qk: one row of qkv per token holds n_q_heads q heads then n_kv_heads k heads (then anything,
 *   e.g. v); rotates q into q_out (q_out_dtype) and k in place with the half-split rotation
 *   x * cos + roll(x, head_dim / 2) * sin, cos and sign-folded sin [n_positions, head_dim] of dtype;
 *   AIOLLM_ERR_ARG if a position lies outside [0, n_positions). q_out may be qkv itself (same dtype). q is
 *   rounded to dtype even into an fp32 q_out (it equals the dtype q widened).
 * aiollm_silu_mul: out[:, i] = silu(gate_up[:, i]) * gate_up[:, dim + i], i < dim.
 * aiollm_argmax_rows: out[r] = index of the first maximum of fp32 row r (of the first NaN if any), rows
 *   spread over n_threads threads (the GEMMs' OpenMP team where the process has one, else the pool). */
int aiollm_rms_norm(const void *x, int64_t x_stride, const void *weight, void *out, int64_t out_stride,
                    int64_t n_rows, int32_t dim, float eps, int32_t dtype);
int aiollm_rope_qk(void *qkv, int64_t row_stride, int64_t n_rows, int32_t n_q_heads, int32_t n_kv_heads,
                   int32_t head_dim, const int64_t *positions, const void *cos, const void *sin,
                   int64_t n_positions, void *q_out, int64_t q_out_stride, int32_t q_out_dtype, int32_t dtype);
int aiollm_silu_mul(const void *gate_up, int64_t in_stride, void *out, int64_t out_stride, int64_t n_rows,
                    int32_t dim, int32_t dtype);
int aiollm_argmax_rows(const float *x, int64_t row_stride, int64_t n_rows, int32_t n_cols, int64_t *out,
                       int32_t n_threads);

/* ---- one layer's S-part in one call each (native/fused_ops.c), the split's pre- and post-attention halves ----
 * Weights packed by aiollm_gemm_pack in dtype; every row-major buffer contiguous (rows exactly as wide as
 * stated); row-wise ops and GEMMs run on n_threads threads; results equal the separate calls' bits.
 * aiollm_layer_pre: xn = RMSNorm(h) [n_rows, hidden]; qkv = xn . W_qkv^T [n_rows, n_qkv]; then
 *   aiollm_rope_qk on qkv (k in place, q into q_out, which may be qkv itself with q_out_stride == n_qkv).
 * aiollm_layer_post: h_out = h + attn . W_o^T (attn [n_rows, q_size]); xn = RMSNorm(h_out);
 *   gate_up = xn . W_gate_up^T [n_rows, 2 ffn]; act = silu(gate) * up [n_rows, ffn]; h_out += act . W_down^T.
 *   h_out may be h. xn, gate_up, act are scratch. */
int aiollm_layer_pre(const void *h, int64_t n_rows, int32_t hidden, const void *norm_weight, float eps,
                     const void *w_qkv, int32_t n_qkv, void *xn, void *qkv, int32_t n_q_heads, int32_t n_kv_heads,
                     int32_t head_dim, const int64_t *positions, const void *cos, const void *sin,
                     int64_t n_positions, void *q_out, int64_t q_out_stride, int32_t q_out_dtype, int32_t dtype,
                     int32_t n_threads);
/* aiollm_layer_pre, then each row's rotated k and its v stored into cache layer kv at slots[row], as
 * aiollm_kv_write does, by the thread that rotated the row (kv NULL: nothing stored). Slots must be distinct
 * (a decode step's are); every slot and the cache's geometry are checked before anything runs. */
int aiollm_layer_pre_kv(const void *h, int64_t n_rows, int32_t hidden, const void *norm_weight, float eps,
                        const void *w_qkv, int32_t n_qkv, void *xn, void *qkv, int32_t n_q_heads, int32_t n_kv_heads,
                        int32_t head_dim, const int64_t *positions, const void *cos, const void *sin,
                        int64_t n_positions, void *q_out, int64_t q_out_stride, int32_t q_out_dtype, int32_t dtype,
                        const aiollm_kv_layer *kv, const int64_t *slots, int32_t n_threads);
int aiollm_layer_post(const void *h, const void *attn, void *h_out, int64_t n_rows, int32_t hidden, int32_t q_size,
                      int32_t ffn, const void *w_o, const void *norm_weight, float eps, const void *w_gate_up,
                      const void *w_down, void *xn, void *gate_up, void *act, int32_t dtype, int32_t n_threads);
/* A decode step's layers in one call: per layer aiollm_layer_pre_kv (q into q, fp32 [n_rows, n_q_heads *
 * head_dim]; k, v stored at slots in the layer's cache kv), aiollm_decode_attention (into attn_out, of dtype,
 * attn_threads threads) and aiollm_layer_post with h_out = h: h [n_rows, hidden] is updated in place. Same
 * bits as the three calls made one by one. xn, qkv, gate_up, act: scratch as for those calls. seconds: NULL or
 * double[2] to which the S-part halves' and the attention calls' wall seconds are added. */
typedef struct {
    const void *attn_norm;
    const void *w_qkv;
    const void *w_o;
    const void *mlp_norm;
    const void *w_gate_up;
    const void *w_down;
    const aiollm_kv_layer *kv;
} aiollm_decode_layer;
int aiollm_decode_layers(void *h, int64_t n_rows, int32_t n_layers, const aiollm_decode_layer *layers,
                         int32_t hidden, int32_t n_qkv, int32_t ffn, float eps, int32_t n_q_heads, int32_t n_kv_heads,
                         int32_t head_dim, const int64_t *positions, const void *cos, const void *sin,
                         int64_t n_positions, const int64_t *slots, const int32_t *block_tables, int32_t max_blocks,
                         const int32_t *seq_lens, float scale, void *xn, void *qkv, float *q, void *attn_out,
                         void *gate_up, void *act, int32_t dtype, int32_t n_threads, int32_t attn_threads,
                         double *seconds);

/* ---- skinny GEMM: y[m, n] = x[m, k] . W[n, k]^T (+ residual[m, n]), W packed once (native/gemm*.c) ----
 * dtype AIOLLM_DT_F32 (fp32 math, AVX-512F + FMA) or AIOLLM_DT_BF16 (bf16 x, W, residual and y; fp32
 * accumulation with AVX512_BF16; y rounded once to bf16). x, residual, y: row-major, rows ld* elements apart.
 * aiollm_gemm_supported(dtype): whether this CPU runs it (else the caller keeps another path).
 * aiollm_gemm_packed_bytes: size of the packed form (-1 for bad arguments); aiollm_gemm_pack fills it
 * (packed 64-byte aligned) from W [n, k] with rows ldw elements apart. */
int aiollm_gemm_supported(int32_t dtype);
int64_t aiollm_gemm_packed_bytes(int32_t n, int32_t k, int32_t dtype);
int aiollm_gemm_pack(const void *w, int64_t ldw, int32_t n, int32_t k, int32_t dtype, void *packed);
int aiollm_gemm(const void *x, int64_t ldx, int32_t m, const void *packed, int32_t n, int32_t k, int32_t dtype,
                const void *residual, int64_t ldr, void *y, int64_t ldy, int32_t n_threads);

#endif
