/* The native kernels' thread pool (included by moe.c): persistent pthread workers that claim a
 * call's tasks, the caller working with them; moe_set_threads sizes it. A worker may also lead a
 * layer call the caller posted and went on from (posted.h). */

/* ---- the thread pool: workers spin for a while after a phase (SPIN_NS), then sleep on a
 * condition variable; a call wakes them only when one sleeps. `next` holds (generation << 32 |
 * next task index), so a worker still looking at an older phase can never claim a task of the
 * new one. */
typedef void (*task_fn)(void *ctx, int64_t task);

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    int threads;                       /* including the caller */
    _Atomic uint64_t generation, next;
    _Atomic int64_t done;
    _Atomic int sleeping;              /* workers in (or about to enter) the condition wait */
    int64_t tasks;
    task_fn fn;
    void *ctx;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 1};

/* How long a worker spins after a phase before it sleeps: long enough to cover the gap between
 * the layers of a decode step (torch's attention and norms between native calls), so that waking
 * it is rare: waking a sleeper is a futex call on the caller's path, and in a VM an interrupt to
 * the other vCPU (10 % of a decode step's samples with 0.12 ms here; with 1 ms decode 1.15-1.24x
 * faster, int4 or int8 dense matrices, no faster with 5 or 25 ms; prefill, and the dense path in
 * torch, unchanged: AVX2 EPYC VM, 2 threads, alternating runs). Timed, not counted: a pause takes
 * 60 ns on that EPYC, a few on older Intel parts. */
#define SPIN_NS 1000000
#if defined(__x86_64__)
#define RELAX() __builtin_ia32_pause()
#else
#define RELAX() ((void)0)
#endif

static void take_posted(void);                 /* posted.h: lead a posted layer call, if one waits */
static int join_posted(void);                  /* ... and see it done */
static _Thread_local int leading;              /* this thread runs a posted call's phases */

/* One calling thread at a time in the pool: a phase (parallel), a post or a join runs whole, while
 * another thread's native call (a second engine's in the process, say) waits its turn. Two
 * callers had overwritten each other's phase, and one's join had seen the other's posted call done
 * and reset it while the other still waited for it: for ever (tests/test_pool_callers.py). A posted
 * call stays in flight between its post and its join; another caller's phase first joins it, as the
 * posting thread's own would. A worker leading a posted call runs its phases under its caller's turn. */
static pthread_mutex_t callers = PTHREAD_MUTEX_INITIALIZER;
static _Thread_local int calling;              /* this thread's nested turns */

static void enter_caller(void) {
    if (!leading && calling++ == 0) pthread_mutex_lock(&callers);
}

static void leave_caller(void) {
    if (!leading && --calling == 0) pthread_mutex_unlock(&callers);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

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
        const int64_t until = now_ns() + SPIN_NS;
        for (int i = 1; atomic_load(&pool.generation) == seen; i++) {
            RELAX();
            if (!(i & 15) && now_ns() > until) break;
        }
        if (atomic_load(&pool.generation) == seen) {
            pthread_mutex_lock(&pool.lock);
            atomic_fetch_add(&pool.sleeping, 1);        /* before the check: parallel() sees one or the other */
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            atomic_fetch_sub(&pool.sleeping, 1);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load(&pool.generation);
        take_posted();
        run_tasks(seen);
    }
    return NULL;
}

/* A new generation: stale workers stop claiming, spinning ones see it, sleeping ones are woken. */
static void publish(uint64_t gen) {
    atomic_store(&pool.generation, gen);
    if (atomic_load(&pool.sleeping)) {              /* workers still spinning need no wake-up call */
        pthread_mutex_lock(&pool.lock);             /* a sleeper is now in its wait, not between check and wait */
        pthread_mutex_unlock(&pool.lock);
        pthread_cond_broadcast(&pool.wake);         /* after the unlock: the woken take a free lock */
    }
}

static void run_phase(task_fn fn, void *ctx, int64_t tasks) {
    if (pool.threads <= 1 || tasks == 1) {
        for (int64_t t = 0; t < tasks; t++) fn(ctx, t);
        return;
    }
    const uint64_t gen = atomic_load(&pool.generation) + 1;
    atomic_store(&pool.next, gen << 32);            /* first: stale workers stop claiming */
    pool.fn = fn, pool.ctx = ctx, pool.tasks = tasks;
    atomic_store(&pool.done, 0);
    publish(gen);
    run_tasks(gen);
    while (atomic_load(&pool.done) < tasks) RELAX();
}

static void parallel(task_fn fn, void *ctx, int64_t tasks) {
    enter_caller();
    if (!leading) join_posted();                    /* one call's phases at a time in the pool */
    run_phase(fn, ctx, tasks);
    leave_caller();
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
