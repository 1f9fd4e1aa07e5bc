/* AVX-512 int8 with VNNI + VBMI (Ice Lake and later): K scores as int8 x int8 dot products (vpdpbusd) on a
 * per-row int8 copy of q, 4 dims per instruction instead of one convert + FMA per dim. V stays fp32 math. */
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")))
#define WITH_VNNI 1
#include "attn_avx512_impl.h"

ITEM_SPECIALISED(item_i8_vnni, AIOLLM_DT_I8, 1)

T512 void attn_item_i8_vnni(const attn_args *a, int32_t seq, int32_t h0, int32_t h1) { item_i8_vnni(a, seq, h0, h1); }
