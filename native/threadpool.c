/* A persistent pthread pool private to the library.
 *
 * Not OpenMP on purpose: PyTorch's CPU build brings its own OpenMP runtime, and a second runtime (or
 * nested parallel regions) in the same process oversubscribes or deadlocks. Workers sleep on a condition
 * variable between calls (they never spin), so they cost nothing while PyTorch runs. One call runs at a
 * time (callers from several Python threads queue on a mutex); the calling thread is worker 0. Items are
 * claimed from an atomic counter, so a caller that orders items longest first gets a longest-processing-
 * time-first schedule, balanced by length. After fork() the child starts with an empty pool. */
#include <pthread.h>
#include <stdatomic.h>
#include "attn_internal.h"

typedef struct {
    pool_task_fn fn;
    void *ctx;
    int64_t n_items;
    int n_threads;
    _Atomic int64_t next;
} pool_job;

static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;     /* guards the fields below */
static pthread_cond_t work_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static pool_job job;
static uint64_t generation;
static int pending;  /* workers still busy with the current job */
static int started;  /* worker threads started (ids 1..started) */
static uint64_t start_gen[AIOLLM_MAX_THREADS];
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void drain(int thread) {
    for (;;) {
        const int64_t i = atomic_fetch_add(&job.next, 1);
        if (i >= job.n_items) return;
        job.fn(job.ctx, i, thread);
    }
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    pthread_mutex_lock(&mu);
    uint64_t seen = start_gen[id];
    for (;;) {
        while (generation == seen) pthread_cond_wait(&work_cv, &mu);
        seen = generation;
        if (id >= job.n_threads) continue;
        pthread_mutex_unlock(&mu);
        drain(id);
        pthread_mutex_lock(&mu);
        if (--pending == 0) pthread_cond_signal(&done_cv);
    }
    return NULL;
}

static void reset_in_child(void) {
    pthread_mutex_init(&run_mu, NULL);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&work_cv, NULL);
    pthread_cond_init(&done_cv, NULL);
    started = 0;
    pending = 0;
}

static void install_atfork(void) { pthread_atfork(NULL, NULL, reset_in_child); }

/* Start workers up to n_threads - 1; returns how many threads the job can use. Called under mu. */
static int grow(int n_threads) {
    while (started < n_threads - 1) {
        pthread_t t;
        pthread_attr_t attr;
        const int id = started + 1;
        start_gen[id] = generation;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        started = id;
    }
    return started + 1 < n_threads ? started + 1 : n_threads;
}

int pool_run(int n_threads, int64_t n_items, pool_task_fn fn, void *ctx) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > AIOLLM_MAX_THREADS) n_threads = AIOLLM_MAX_THREADS;
    if ((int64_t)n_threads > n_items) n_threads = n_items > 0 ? (int)n_items : 1;
    pthread_once(&atfork_once, install_atfork);
    pthread_mutex_lock(&run_mu);
    pthread_mutex_lock(&mu);
    n_threads = grow(n_threads);
    job.fn = fn;
    job.ctx = ctx;
    job.n_items = n_items;
    job.n_threads = n_threads;
    atomic_store(&job.next, 0);
    pending = n_threads - 1;
    if (pending > 0) {
        generation++;
        pthread_cond_broadcast(&work_cv);
    }
    pthread_mutex_unlock(&mu);
    drain(0);
    pthread_mutex_lock(&mu);
    while (pending > 0) pthread_cond_wait(&done_cv, &mu);
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&run_mu);
    return n_threads;
}

int pool_size(void) {
    pthread_mutex_lock(&mu);
    const int n = started + 1;
    pthread_mutex_unlock(&mu);
    return n;
}

int aiollm_pool_size(void) { return pool_size(); }
