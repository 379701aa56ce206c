/* The kernels' own threads: a parallel region (team_run) runs a function on the calling thread
 * and on persistent workers that spin between regions for SPIN_NS before they sleep.
 *
 * Why not OpenMP's: a decode step is a chain of short kernels with Python between them (tens of
 * µs), and the ranks run libgomp with a short spin (GOMP_SPINCOUNT, set by the launcher so that
 * idle OpenMP threads leave the cores to the front end). Its workers fall asleep between two
 * kernels of a step, and waking a sleeping thread costs 60-85 µs on a virtual machine's cores:
 * at 25 GEMMs and 8 expert calls a step, a bf16 decode step of a mid-size model took 12.1 ms
 * against 8.0 ms with libgomp's default spin. These workers spin by the clock instead: through a
 * step's gaps, and asleep within SPIN_NS of its end, so they hold no core between steps.
 *
 * One team at a time: a second thread that calls while the team is busy (dual-batch overlap
 * runs two micro-batches' kernels from two threads) runs its region on OpenMP's threads, as
 * every region did before. team_barrier works in either. The threads are torch's count at the
 * call (omp_get_max_threads, which torch.set_num_threads sets); a fork's child starts its own. */

#define _GNU_SOURCE
#include "cpu_kernels.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_WORKERS 255
#define SPIN_NS 300000 /* a worker's spin after its last region (see above) */

static struct {
    atomic_flag busy;         /* held by the thread running a pooled region */
    _Atomic uint32_t posted;  /* regions posted; a worker runs each one it is part of */
    _Atomic int sleepers;     /* workers waiting on `posted` in the kernel */
    _Atomic int done;         /* workers finished with the current region */
    _Atomic int arrived;      /* the barrier's count, and its generation below */
    _Atomic uint32_t phase;
    team_fn fn;
    void *arg;
    int nt, started;
    pthread_mutex_t start_lock;
} pool = {.busy = ATOMIC_FLAG_INIT, .start_lock = PTHREAD_MUTEX_INITIALIZER};

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* One step of a spin-wait, the i-th: a pause, and every 256th a yield of the core, so that a
 * thread spinning on a core that several ranks share lets the thread it waits for run. */
static inline void relax(int i) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
    if ((i & 255) == 255) sched_yield();
}

static void futex(_Atomic uint32_t *addr, int op, uint32_t value) {
    syscall(SYS_futex, (uint32_t *)addr, op | FUTEX_PRIVATE_FLAG, value, NULL, NULL, 0);
}

/* Worker `index` (1, 2, ...) starts from the count of regions posted when it was started, so a
 * region posted before it first runs is still its to run. */
static uint32_t start_seen[MAX_WORKERS + 1];

static void *worker(void *index) {
    int id = (int)(intptr_t)index;
    uint32_t seen = start_seen[id];
    for (;;) {
        int64_t spin_from = now_ns();
        uint32_t p;
        for (int i = 0; (p = atomic_load_explicit(&pool.posted, memory_order_acquire)) == seen;
             i++) {
            relax(i);
            if ((i & 255) == 255 && now_ns() - spin_from > SPIN_NS) {
                atomic_fetch_add(&pool.sleepers, 1);
                futex(&pool.posted, FUTEX_WAIT, seen); /* returns at once if posted moved */
                atomic_fetch_sub(&pool.sleepers, 1);
                spin_from = now_ns();
            }
        }
        seen = p;
        if (id < pool.nt) {
            struct team team = {id, pool.nt, 0};
            pool.fn(pool.arg, &team);
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        }
    }
    return NULL;
}

static void forget_workers(void) { pool.started = 0; } /* a fork's child has none */

/* Workers 1 .. nt-1 running; 0 when a thread cannot be started (the region then runs on
 * OpenMP's threads). */
static int start_workers(int nt) {
    if (nt - 1 <= pool.started) return 1;
    pthread_mutex_lock(&pool.start_lock);
    static int atfork;
    if (!atfork) atfork = !pthread_atfork(NULL, NULL, forget_workers);
    while (pool.started < nt - 1) {
        pthread_t thread;
        start_seen[pool.started + 1] = atomic_load(&pool.posted);
        if (pthread_create(&thread, NULL, worker, (void *)(intptr_t)(pool.started + 1))) break;
        pthread_detach(thread);
        pool.started++;
    }
    pthread_mutex_unlock(&pool.start_lock);
    return pool.started >= nt - 1;
}

/* The region on OpenMP's threads: where the team is busy or cannot start. */
static void run_on_openmp(team_fn fn, void *arg, int nt) {
#pragma omp parallel num_threads(nt)
    {
        struct team team = {omp_get_thread_num(), omp_get_num_threads(), 1};
        fn(arg, &team);
    }
}

void team_run(team_fn fn, void *arg, int64_t parallel) {
    int nt = parallel ? omp_get_max_threads() : 1;
    nt = nt > MAX_WORKERS + 1 ? MAX_WORKERS + 1 : nt;
    if (nt <= 1) {
        struct team team = {0, 1, 0};
        fn(arg, &team);
        return;
    }
    if (atomic_flag_test_and_set_explicit(&pool.busy, memory_order_acquire)) {
        run_on_openmp(fn, arg, nt);
        return;
    }
    if (!start_workers(nt)) {
        atomic_flag_clear_explicit(&pool.busy, memory_order_release);
        run_on_openmp(fn, arg, nt);
        return;
    }
    pool.fn = fn, pool.arg = arg, pool.nt = nt;
    atomic_store(&pool.done, 0);
    /* Sequentially consistent, as the workers' count before they sleep: a worker either is
     * counted here or finds `posted` moved when it goes to sleep. */
    atomic_fetch_add(&pool.posted, 1);
    if (atomic_load(&pool.sleepers)) futex(&pool.posted, FUTEX_WAKE, INT32_MAX);
    struct team team = {0, nt, 0};
    fn(arg, &team);
    for (int i = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < nt - 1; i++) relax(i);
    atomic_flag_clear_explicit(&pool.busy, memory_order_release);
}

void team_barrier(const struct team *team) {
    if (team->nt <= 1) return;
    if (team->omp) {
#pragma omp barrier
        return;
    }
    uint32_t phase = atomic_load_explicit(&pool.phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.arrived, 1, memory_order_acq_rel) == team->nt - 1) {
        atomic_store_explicit(&pool.arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool.phase, 1, memory_order_release);
        return;
    }
    for (int i = 0; atomic_load_explicit(&pool.phase, memory_order_acquire) == phase; i++) relax(i);
}
