/* AVX-512 path (avx512f/bw/vl + fma + f16c): 16 tokens per chunk, one zmm per K column of a chunk.
 *
 * Per (sequence, kv heads) item the `group` q heads share every K/V row: a K column (16 tokens of one
 * dimension, contiguous thanks to the transposed K tile) is loaded and converted once and multiplied into
 * the score accumulators of up to 4 q heads; a V row is loaded once and accumulated into up to 4 heads'
 * outputs. Softmax is online, once per 16-token chunk: new max, rescale factor, exp of the chunk.
 * The kernel body lives in attn_avx512_impl.h; attn_avx512_vnni.c compiles it again for int8 with VNNI. */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define WITH_VNNI 0
#include "attn_avx512_impl.h"

void attn_item_i8_vnni(const attn_args *a, int32_t seq, int32_t h0, int32_t h1);

ITEM_SPECIALISED(item_f32, AIOLLM_DT_F32, 0)
ITEM_SPECIALISED(item_f16, AIOLLM_DT_F16, 0)
ITEM_SPECIALISED(item_i8, AIOLLM_DT_I8, 0)

void attn_item_avx512(const attn_args *a, int32_t seq, int32_t h0, int32_t h1) {
    switch (a->kv->dtype) {
    case AIOLLM_DT_F16: item_f16(a, seq, h0, h1); break;
    case AIOLLM_DT_I8:
        if (a->int8_dot) attn_item_i8_vnni(a, seq, h0, h1);
        else item_i8(a, seq, h0, h1);
        break;
    default: item_f32(a, seq, h0, h1); break;
    }
}

/* The read-bandwidth probe. It prefetches the way the fp16 kernel does (1 KiB ahead into L1, 8 KiB ahead into
 * L2), so the bench compares the kernel with the best plain read found, not with one the kernel can outrun:
 * without the prefetch the probe reads ~6 % less (26.3 against 28.0 GB/s on 2 threads, 13.9 against 14.4 on 1),
 * less than the kernel with its two-level prefetch reads. */
#define READ_NEAR_64 16  /* lines ahead into L1 */
#define READ_FAR_64 128  /* lines ahead into L2 */
T512 double read_sum_avx512(const void *buf, int64_t n64) {
    const float *p = (const float *)buf;
    __m512 s[8];
    int64_t i = 0;
    for (int j = 0; j < 8; j++) s[j] = _mm512_setzero_ps();
    for (; i + 8 <= n64; i += 8) {
        if (i + 8 + READ_FAR_64 <= n64)
            for (int j = 0; j < 8; j++) {
                _mm_prefetch((const char *)(p + (i + j + READ_NEAR_64) * 16), _MM_HINT_T0);
                _mm_prefetch((const char *)(p + (i + j + READ_FAR_64) * 16), _MM_HINT_T1);
            }
        for (int j = 0; j < 8; j++) s[j] = _mm512_add_ps(s[j], _mm512_loadu_ps(p + (i + j) * 16));
    }
    for (; i < n64; i++) s[0] = _mm512_add_ps(s[0], _mm512_loadu_ps(p + i * 16));
    for (int j = 1; j < 8; j++) s[0] = _mm512_add_ps(s[0], s[j]);
    return (double)_mm512_reduce_add_ps(s[0]);
}
