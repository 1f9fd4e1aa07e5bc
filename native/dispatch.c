/* The one dispatch point: validates arguments, picks the ISA variant (probed once, overridable by the
 * AIOLLM_ATTN_ISA environment variable or aiollm_set_isa), orders work items longest first and runs them on
 * the pool. Nothing reaches a kernel before every length and block-table entry in use has been checked. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include "attn_internal.h"
#include "gemm_internal.h"

static _Atomic int current_isa = -1;
static _Atomic int isa_forced = 0; /* an ISA named by AIOLLM_ATTN_ISA or aiollm_set_isa: every call takes its kernel */
static int probed_isa = AIOLLM_ISA_REF, probed_isa_forced = 0;
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;

int aiollm_isa_supported(int32_t isa) {
    const uint32_t f = aiollm_cpu_features();
    const uint32_t avx2 = AIOLLM_CPU_AVX2 | AIOLLM_CPU_FMA | AIOLLM_CPU_F16C;
    switch (isa) {
    case AIOLLM_ISA_REF: return 1;
    case AIOLLM_ISA_AVX2: return (f & avx2) == avx2;
    case AIOLLM_ISA_AVX512:
        return (f & (avx2 | AIOLLM_CPU_AVX512F | AIOLLM_CPU_AVX512BW)) == (avx2 | AIOLLM_CPU_AVX512F | AIOLLM_CPU_AVX512BW);
    default: return 0;
    }
}

static void probe(void) {
    const char *env = getenv("AIOLLM_ATTN_ISA");
    int want = -1;
    if (env && strcmp(env, "ref") == 0) want = AIOLLM_ISA_REF;
    if (env && strcmp(env, "avx2") == 0) want = AIOLLM_ISA_AVX2;
    if (env && strcmp(env, "avx512") == 0) want = AIOLLM_ISA_AVX512;
    if (want >= 0 && aiollm_isa_supported(want)) {
        probed_isa = want;
        probed_isa_forced = 1;
    } else {
        probed_isa = aiollm_isa_supported(AIOLLM_ISA_AVX512) ? AIOLLM_ISA_AVX512
                     : aiollm_isa_supported(AIOLLM_ISA_AVX2) ? AIOLLM_ISA_AVX2
                                                            : AIOLLM_ISA_REF;
    }
    atomic_store(&current_isa, probed_isa);
    atomic_store(&isa_forced, probed_isa_forced);
}

/* ---- int8 path: fp32 math or int8 dot products ---- */

static _Atomic int current_int8 = -1;
static _Atomic int int8_forced = 0; /* a path named by AIOLLM_ATTN_INT8 or aiollm_set_int8_path: every call takes it */
static int probed_int8 = AIOLLM_INT8_FP32, probed_forced = 0, group1_madd = 0, near_i8_bytes = 4096;
static pthread_once_t int8_once = PTHREAD_ONCE_INIT;

int aiollm_int8_path_supported(int32_t path) {
    const uint32_t f = aiollm_cpu_features();
    switch (path) {
    case AIOLLM_INT8_FP32: return 1; /* every path can compute int8 in fp32 */
    case AIOLLM_INT8_VNNI: return aiollm_isa_supported(AIOLLM_ISA_AVX512) && (f & AIOLLM_CPU_AVX512VNNI);
    case AIOLLM_INT8_MADD: return aiollm_isa_supported(AIOLLM_ISA_AVX2);
    default: return 0;
    }
}

static void probe_int8(void) {
    const char *env = getenv("AIOLLM_ATTN_INT8");
    int want = -1;
    if (env && strcmp(env, "fp32") == 0) want = AIOLLM_INT8_FP32;
    if (env && strcmp(env, "vnni") == 0) want = AIOLLM_INT8_VNNI;
    if (env && strcmp(env, "madd") == 0) want = AIOLLM_INT8_MADD;
    if (want >= 0 && aiollm_int8_path_supported(want)) {
        probed_int8 = want;
        probed_forced = 1;
    } else {
        probed_int8 = aiollm_int8_path_supported(AIOLLM_INT8_VNNI)   ? AIOLLM_INT8_VNNI
                      : aiollm_int8_path_supported(AIOLLM_INT8_MADD) ? AIOLLM_INT8_MADD
                                                                     : AIOLLM_INT8_FP32;
    }
    group1_madd = aiollm_cpu_int8_group1_madd();
    near_i8_bytes = aiollm_cpu_int8_near_bytes();
    atomic_store(&current_int8, probed_int8);
    atomic_store(&int8_forced, probed_forced);
}

int aiollm_int8_path(void) {
    pthread_once(&int8_once, probe_int8);
    return atomic_load(&current_int8);
}

int aiollm_set_int8_path(int32_t path) {
    pthread_once(&int8_once, probe_int8);
    const int forced = path != -1 || probed_forced;
    if (path == -1) path = probed_int8;
    if (!aiollm_int8_path_supported(path)) return AIOLLM_ERR_UNSUPPORTED;
    atomic_store(&current_int8, path);
    atomic_store(&int8_forced, forced);
    return AIOLLM_OK;
}

/* Whether one int8 call runs the AVX2 kernel's MADD dot products instead of the probed AVX-512 VNNI ones: on Zen 5
 * (aiollm_cpu_int8_group1_madd) for a GQA group of 1, unless an ISA or an int8 path was forced. From DRAM the
 * AVX-512 kernel's VNNI path reads slower there at group 1, although in L2 it computes ~2.6x faster than fp32
 * math (110 against 42 GB/s a core); the cause is not known. Llama (32 / 32 heads, d 128), int8 tokens/s over
 * fp16's on Zen 5:
 * - 2 threads: AVX2 MADD 1.85-2.09x, AVX-512 fp32 math 1.77-1.91x, AVX-512 VNNI 1.57-1.74x; of the read kernel MADD
 *   reads 0.91-1.00, fp32 math 0.84-0.93, VNNI 0.72-0.86.
 * - 1 thread: MADD 1.84-1.88x, VNNI 1.81-1.85x, fp32 math 1.55-1.60x.
 * - Larger groups keep VNNI: SmolLM2 (group 3, d 64) on 2 threads runs 1.99-2.13x with VNNI, 1.55-1.62x with fp32
 *   math, 1.35-1.42x with MADD; a group of 2 at d 64 favours VNNI as well (2.07x against fp32 math's 1.54x). */
static int int8_group1_madd(int isa, int path, int32_t group) {
    return group1_madd && isa == AIOLLM_ISA_AVX512 && group == 1 && path == AIOLLM_INT8_VNNI &&
           !atomic_load(&int8_forced) && !atomic_load(&isa_forced);
}

/* ---- the AVX-512 kernel's far prefetch level ---- */

static _Atomic int current_far = -1;
static int probed_far = AIOLLM_FAR_ALL;
static pthread_once_t far_once = PTHREAD_ONCE_INIT;

static void probe_far(void) {
    const char *env = getenv("AIOLLM_ATTN_FAR_PREFETCH");
    if (env && env[0] >= '0' && env[0] <= '0' + AIOLLM_FAR_ALL && env[1] == 0) probed_far = env[0] - '0';
    else probed_far = aiollm_cpu_far_prefetch_default();
    atomic_store(&current_far, probed_far);
}

int aiollm_far_prefetch(void) {
    pthread_once(&far_once, probe_far);
    return atomic_load(&current_far);
}

int aiollm_set_far_prefetch(int32_t mask) {
    pthread_once(&far_once, probe_far);
    if (mask < -1 || mask > AIOLLM_FAR_ALL) return AIOLLM_ERR_ARG;
    atomic_store(&current_far, mask == -1 ? probed_far : mask);
    return AIOLLM_OK;
}

int aiollm_isa(void) {
    pthread_once(&probe_once, probe);
    return atomic_load(&current_isa);
}

int aiollm_set_isa(int32_t isa) {
    pthread_once(&probe_once, probe);
    const int forced = isa != -1 || probed_isa_forced;
    if (isa == -1) isa = probed_isa;
    if (!aiollm_isa_supported(isa)) return AIOLLM_ERR_UNSUPPORTED;
    atomic_store(&current_isa, isa);
    atomic_store(&isa_forced, forced);
    return AIOLLM_OK;
}

/* ---- which threads run attention: the library's pool, or the calling thread's OpenMP team ----
 *
 * In a step that also runs GEMMs and torch ops on this thread, torch's libgomp workers spin after each of
 * them, so attention on the pool shares its cores with spinning threads (SmolLM2 fp32 batch 64: ~20-24 ms
 * of attention per step, 12.6 with OMP_WAIT_POLICY=PASSIVE). On the GEMMs' team (gemm_run) the spinning
 * workers do the work: the 30 calls of a colocated step take 34 ms there instead of 58-62 on the pool at fp32
 * batch 64, 5 instead of 9 at batch 8, 15-17 instead of 26-32 at bf16 batch 64. Opt-in per thread
 * (aiollm_set_attn_team), since a thread that runs no torch ops (an R-worker) has no busy team and the sleeping
 * pool suits it; AIOLLM_ATTN_POOL=1 (read once) keeps every call on the pool. */
static _Thread_local int attn_team;
static int attn_pool_forced;
static pthread_once_t attn_pool_once = PTHREAD_ONCE_INIT;

static void probe_attn_pool(void) {
    const char *env = getenv("AIOLLM_ATTN_POOL");
    attn_pool_forced = env && strcmp(env, "1") == 0;
}

int aiollm_set_attn_team(int32_t on) {
    const int prev = attn_team;
    attn_team = on != 0;
    return prev;
}

static int attn_on_team(void) {
    pthread_once(&attn_pool_once, probe_attn_pool);
    return attn_team && !attn_pool_forced;
}

typedef struct {
    attn_args args;
    attn_item_fn fn;
    const int32_t *order; /* sequences, longest first */
    int32_t n_kv_heads, n_splits, heads_per_item;
} attn_job;

/* Item i: sequence order[i / n_splits], heads [split * heads_per_item, ...) of it. */
static void attn_task(void *ctx, int64_t item, int thread) {
    const attn_job *j = (const attn_job *)ctx;
    const int32_t split = (int32_t)(item % j->n_splits), h0 = split * j->heads_per_item;
    const int32_t h1 = h0 + j->heads_per_item < j->n_kv_heads ? h0 + j->heads_per_item : j->n_kv_heads;
    (void)thread;
    j->fn(&j->args, j->order[item / j->n_splits], h0, h1);
}

/* Heads per item: as many as the stack scratch holds, fewer when there are too few sequences to give every
 * thread several items (a long single sequence still spreads over the threads, one head group each). */
static void split_heads(attn_job *job, int32_t n_seqs, int32_t n_threads) {
    const int32_t H = job->n_kv_heads, per_head = job->args.group * job->args.kv->head_dim;
    int32_t per_item = AIOLLM_ITEM_FLOATS / per_head < H ? AIOLLM_ITEM_FLOATS / per_head : H;
    if (per_item < 1) per_item = 1;
    const int64_t want = n_threads > 1 ? 4 * (int64_t)n_threads : 0;
    while (per_item > 1 && (int64_t)n_seqs * ((H + per_item - 1) / per_item) < want) per_item--;
    const int32_t splits = (H + per_item - 1) / per_item;
    job->heads_per_item = per_item;
    job->n_splits = splits;
}

/* int4 runs int8 dot products only: VNNI on the AVX-512 kernel where the int8 path is VNNI, else the AVX2 kernel's
 * MADD path (vpmaddubsw + vpmaddwd; every AVX-512 CPU has AVX2), or fp32 math on the portable reference where the
 * ISA is the reference, the shape is not a SIMD one, or the int8 path is forced to fp32 (a SIMD fp32-math int4
 * kernel would convert each code to fp32, the work the dot products avoid). A GQA group of 1 on Zen 5 takes MADD,
 * as int8 does there (int8_group1_madd). */
static void int4_kernel(attn_job *job, int isa, int simd_shape) {
    if (!simd_shape || isa == AIOLLM_ISA_REF || job->args.int8_dot == AIOLLM_INT8_FP32) {
        job->fn = attn_item_ref;
    } else if (isa == AIOLLM_ISA_AVX512 && job->args.int8_dot == AIOLLM_INT8_VNNI &&
               !int8_group1_madd(isa, job->args.int8_dot, job->args.group)) {
        job->fn = attn_item_i4_vnni;
    } else {
        job->fn = attn_item_avx2;
        job->args.int8_dot = AIOLLM_INT8_MADD;
    }
}

static int by_key(const void *x, const void *y) {
    const int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return (a > b) - (a < b);
}

static int check_tables(const aiollm_kv_layer *kv, int32_t n_seqs, const int32_t *block_tables,
                        int32_t max_blocks, const int32_t *seq_lens) {
    for (int32_t s = 0; s < n_seqs; s++) {
        const int32_t n = seq_lens[s];
        if (n < 0 || n > INT32_MAX - kv->block_size) return AIOLLM_ERR_LEN;
        const int64_t used = ((int64_t)n + kv->block_size - 1) / kv->block_size;
        if (used > max_blocks) return AIOLLM_ERR_LEN;
        const int32_t *row = block_tables + (int64_t)s * max_blocks;
        for (int64_t b = 0; b < used; b++)
            if (row[b] < 0 || row[b] >= kv->n_blocks) return AIOLLM_ERR_BLOCK;
    }
    return AIOLLM_OK;
}

int aiollm_decode_attention(const aiollm_kv_layer *kv, const float *q, int64_t q_seq_stride,
                            int32_t n_seqs, int32_t n_q_heads, const int32_t *block_tables,
                            int32_t max_blocks, const int32_t *seq_lens, float scale,
                            void *out, int32_t out_dtype, int32_t n_threads) {
    if (!kv || n_seqs < 0 || max_blocks < 0 || kv->n_blocks < 0 || kv->block_size < 1 || kv->n_kv_heads < 1 ||
        kv->head_dim < 1 || kv->head_dim > AIOLLM_MAX_HEAD_DIM || n_q_heads < 1 || n_q_heads % kv->n_kv_heads != 0 ||
        n_q_heads / kv->n_kv_heads > AIOLLM_MAX_GROUP)
        return AIOLLM_ERR_ARG;
    const int storage = kv_storage_check(kv);
    if (storage != AIOLLM_OK) return storage;
    if (out_dtype != AIOLLM_DT_F32 && out_dtype != AIOLLM_DT_F16 && out_dtype != AIOLLM_DT_BF16)
        return AIOLLM_ERR_UNSUPPORTED;
    if (n_seqs == 0) return AIOLLM_OK;
    if (!q || !block_tables || !seq_lens || !out || !kv->k || !kv->v || q_seq_stride < (int64_t)n_q_heads * kv->head_dim)
        return AIOLLM_ERR_ARG;
    const int rc = check_tables(kv, n_seqs, block_tables, max_blocks, seq_lens);
    if (rc != AIOLLM_OK) return rc;

    attn_job job = {
        .args = {kv, q, q_seq_stride, n_q_heads, n_q_heads / kv->n_kv_heads, block_tables, max_blocks, seq_lens,
                 scale, out, out_dtype},
        .fn = attn_item_ref,
        .n_kv_heads = kv->n_kv_heads,
    };
    const int isa = aiollm_isa(), simd_shape = kv->head_dim % 16 == 0 && kv->block_size % 16 == 0;
    if (simd_shape && isa == AIOLLM_ISA_AVX512) job.fn = attn_item_avx512;
    job.args.int8_dot = aiollm_int8_path();
    job.args.near_i8_bytes = near_i8_bytes; /* probed with the int8 path, just above */
    job.args.far_prefetch = aiollm_far_prefetch() & (kv_quantised(kv->dtype) ? AIOLLM_FAR_QUANTISED | AIOLLM_FAR_QUANTISED_LINES : AIOLLM_FAR_FLOAT);
    if (simd_shape && isa == AIOLLM_ISA_AVX2) job.fn = attn_item_avx2;
    if (simd_shape && kv->dtype == AIOLLM_DT_I8 && int8_group1_madd(isa, job.args.int8_dot, job.args.group)) {
        job.fn = attn_item_avx2;
        job.args.int8_dot = AIOLLM_INT8_MADD;
    }
    if (kv->dtype == AIOLLM_DT_I4) int4_kernel(&job, isa, simd_shape);

    /* Longest first: sort keys (INT32_MAX - len, seq) ascending, then keep the seq part. */
    int64_t *keys = malloc((size_t)n_seqs * sizeof(int64_t));
    int32_t *order = malloc((size_t)n_seqs * sizeof(int32_t));
    if (!keys || !order) {
        free(keys);
        free(order);
        return AIOLLM_ERR_NOMEM;
    }
    for (int32_t s = 0; s < n_seqs; s++) keys[s] = ((int64_t)(INT32_MAX - seq_lens[s]) << 32) | s;
    qsort(keys, (size_t)n_seqs, sizeof(int64_t), by_key);
    for (int32_t s = 0; s < n_seqs; s++) order[s] = (int32_t)(keys[s] & 0xffffffff);
    free(keys);
    job.order = order;
    split_heads(&job, n_seqs, n_threads);
    const int64_t n_items = (int64_t)n_seqs * job.n_splits;
    if (attn_on_team()) /* never more team threads than items: an idle one would only be woken to spin */
        gemm_run(n_threads < n_items ? n_threads : (int)n_items, n_items, attn_task, &job);
    else
        pool_run(n_threads, n_items, attn_task, &job);
    free(order);
    return AIOLLM_OK;
}

/* ---- read bandwidth probe ---- */

#define READ_CHUNK_64 4096 /* 256 KiB per work item */

typedef struct {
    const char *buf;
    int64_t n64;
    double (*fn)(const void *, int64_t);
    double partial[AIOLLM_MAX_THREADS];
} read_job;

static void read_task(void *ctx, int64_t item, int thread) {
    read_job *j = (read_job *)ctx;
    const int64_t first = item * READ_CHUNK_64;
    const int64_t n = j->n64 - first < READ_CHUNK_64 ? j->n64 - first : READ_CHUNK_64;
    j->partial[thread] += j->fn(j->buf + first * 64, n);
}

double aiollm_read_sum(const void *buf, int64_t nbytes, int32_t n_threads) {
    read_job job = {.buf = (const char *)buf, .n64 = nbytes / 64, .fn = read_sum_ref};
    if (!buf || job.n64 <= 0) return 0.0;
    const int isa = aiollm_isa();
    if (isa == AIOLLM_ISA_AVX512) job.fn = read_sum_avx512;
    if (isa == AIOLLM_ISA_AVX2) job.fn = read_sum_avx2;
    pool_run(n_threads, (job.n64 + READ_CHUNK_64 - 1) / READ_CHUNK_64, read_task, &job);
    double total = 0.0;
    for (int t = 0; t < AIOLLM_MAX_THREADS; t++) total += job.partial[t];
    return total;
}
