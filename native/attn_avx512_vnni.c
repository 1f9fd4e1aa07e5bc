/* AVX-512 int8 and int4 with VNNI (Cascade Lake and later): K scores and P x V as int8 dot products (vpdpbusd) on a
 * per-row int8 copy of q and per-chunk u8 weights, 4 bytes per lane instead of one convert + FMA per element; int4
 * unpacks each line of codes into two int8-layout lines with two masks and runs the same way.
 * AMX-INT8 tiles for the group's QK^T (one TDPBSSD per 64 dims) and P x V (one TDPBUSD per 16 dims) are slower
 * for this work: SmolLM2 64 x 1024 takes 2.36 ms with them on 1 thread against 1.52 ms with vpdpbusd (2 threads 1.24 vs
 * 0.88): with 3 q rows per tile and the scores needed back in zmm registers for the softmax every 16 tokens,
 * the tile store -> vector load round trips and serialised tile registers cost more than the dot products. */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define WITH_VNNI 1
#include "attn_avx512_impl.h"

ITEM_SPECIALISED(item_i8_vnni, AIOLLM_DT_I8, 1)
ITEM_SPECIALISED(item_i4_vnni, AIOLLM_DT_I4, 1)

T512 void attn_item_i8_vnni(const attn_args *a, int32_t seq, int32_t h0, int32_t h1) { item_i8_vnni(a, seq, h0, h1); }
T512 void attn_item_i4_vnni(const attn_args *a, int32_t seq, int32_t h0, int32_t h1) { item_i4_vnni(a, seq, h0, h1); }
