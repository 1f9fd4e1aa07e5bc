/* Which threads run a GEMM: PyTorch's OpenMP team when the process has one, else the library's pool.
 *
 * A decode step interleaves GEMMs with small torch ops. After each torch op, libgomp's idle workers spin
 * (unless OMP_WAIT_POLICY=PASSIVE), so on a machine with as many cores as threads a GEMM on the library's
 * own pool shares its cores with spinning OpenMP threads: SmolLM2's S-part step at batch 32 takes 68 ms
 * that way against 51 ms with PASSIVE. Running the GEMM on those very threads (torch's libgomp, found
 * among the loaded objects, entered through its GOMP_parallel) costs no wake-up and leaves nothing
 * spinning beside it. The same runtime torch uses, so no second OpenMP runtime enters the process.
 * AIOLLM_GEMM_POOL=1 (read once) keeps GEMMs on the library's pool. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include "attn_internal.h"
#include "gemm_internal.h"

typedef void (*gomp_parallel_fn)(void (*body)(void *), void *data, unsigned n_threads, unsigned flags);
typedef int (*omp_int_fn)(void);
static gomp_parallel_fn gomp_parallel;
static omp_int_fn omp_thread_num;
static pthread_once_t team_once = PTHREAD_ONCE_INIT;

static int find_gomp(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    if (info->dlpi_name && strstr(info->dlpi_name, "libgomp")) {
        *(const char **)data = info->dlpi_name;
        return 1;
    }
    return 0;
}

static void team_probe(void) {
    const char *name = NULL, *env = getenv("AIOLLM_GEMM_POOL");
    if (env && strcmp(env, "1") == 0) return;
    dl_iterate_phdr(find_gomp, &name);
    void *lib = name ? dlopen(name, RTLD_LAZY | RTLD_NOLOAD) : NULL; /* only if already loaded */
    if (!lib) return;
    gomp_parallel_fn parallel = (gomp_parallel_fn)dlsym(lib, "GOMP_parallel");
    omp_int_fn thread_num = (omp_int_fn)dlsym(lib, "omp_get_thread_num");
    if (parallel && thread_num) {
        omp_thread_num = thread_num;
        gomp_parallel = parallel;
    }
}

typedef struct {
    pool_task_fn fn;
    void *ctx;
    int64_t n_items;
    _Atomic int64_t next;
} team_job;

static void team_body(void *data) {
    team_job *j = (team_job *)data;
    const int thread = omp_thread_num();
    for (;;) {
        const int64_t i = atomic_fetch_add(&j->next, 1);
        if (i >= j->n_items) return;
        j->fn(j->ctx, i, thread);
    }
}

int gemm_uses_team(void) {
    pthread_once(&team_once, team_probe);
    return gomp_parallel != NULL;
}

void gemm_run(int n_threads, int64_t n_items, pool_task_fn fn, void *ctx) {
    if (n_threads > 1 && gemm_uses_team()) {
        team_job job = {.fn = fn, .ctx = ctx, .n_items = n_items};
        gomp_parallel(team_body, &job, (unsigned)n_threads, 0);
        return;
    }
    pool_run(n_threads, n_items, fn, ctx);
}
