/* The native kernels' thread pool (included by moe.c): persistent pthread workers that claim a
 * call's tasks, the caller working with them; moe_set_threads sizes it. */

/* ---- the thread pool: workers sleep on a condition variable between calls, spin briefly
 * between the phases of one call. `next` holds (generation << 32 | next task index), so a
 * worker still looking at an older phase can never claim a task of the new one. */
typedef void (*task_fn)(void *ctx, int64_t task);

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int threads;                       /* including the caller */
    _Atomic uint64_t generation, next;
    _Atomic int64_t done;
    int64_t tasks;
    task_fn fn;
    void *ctx;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 1};

#ifndef SPIN
#define SPIN 2000                  /* ~50 us: covers the gap between phases, not between layers */
#endif
#if defined(__x86_64__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

static void run_tasks(uint64_t gen) {
    for (;;) {
        uint64_t v = atomic_load(&pool.next);
        if (v >> 32 != gen || (int64_t)(v & 0xffffffffu) >= pool.tasks) return;
        if (!atomic_compare_exchange_weak(&pool.next, &v, v + 1)) continue;
        pool.fn(pool.ctx, (int64_t)(v & 0xffffffffu));
        atomic_fetch_add(&pool.done, 1);
    }
}

static void *worker(void *arg) {
    (void)arg;
    uint64_t seen = atomic_load(&pool.generation);
    for (;;) {
        int spins = 0;
        while (atomic_load(&pool.generation) == seen && spins++ < SPIN) RELAX();
        if (atomic_load(&pool.generation) == seen) {
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&pool.generation);
        run_tasks(seen);
    }
    return NULL;
}

static void parallel(task_fn fn, void *ctx, int64_t tasks) {
    if (pool.threads <= 1 || tasks == 1) {
        for (int64_t t = 0; t < tasks; t++) fn(ctx, t);
        return;
    }
    const uint64_t gen = atomic_load(&pool.generation) + 1;
    atomic_store(&pool.next, gen << 32);            /* first: stale workers stop claiming */
    pool.fn = fn, pool.ctx = ctx, pool.tasks = tasks;
    atomic_store(&pool.done, 0);
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.generation, gen);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_tasks(gen);
    while (atomic_load(&pool.done) < tasks) RELAX();
}

/* Threads used by later calls (the caller counts as one). Grows the pool; never shrinks it
 * (extra workers just sleep). */
int moe_set_threads(int n) {
    static int started = 1;
    pthread_mutex_lock(&pool.lock);
    for (; started < n; started++) {
        pthread_t th;
        if (pthread_create(&th, NULL, worker, NULL) != 0) break;
        pthread_detach(th);
    }
    pool.threads = n < started ? n : started;
    pthread_mutex_unlock(&pool.lock);
    return pool.threads;
}

int moe_threads(void) { return pool.threads; }
