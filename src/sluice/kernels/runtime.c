/*
 * Sluice C kernels' run-time support: the instruction-set level in use (sk_isa, the test cap),
 * per-thread scratch memory and the persistent thread pool (sk_parallel) every kernel file
 * shares. Nothing here computes a result: which level, thread or chunk runs a piece of work
 * never changes its bits.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <immintrin.h>
#include <time.h>

#include "sk.h"

/* ISA levels (sk.h): what the CPU has, capped by SLUICE_KERNELS_NO_AVX512=1 (AVX2 at most) and by
 * sk_set_isa_cap (tests and benchmarks). Every level computes the same bits as SK_ISA_AVX2. */
static int g_isa_host = -1;
static int g_isa_cap = SK_ISA_VNNI512;

static int isa_host(void) {
    if (g_isa_host < 0) {
        __builtin_cpu_init();
        int level = sk_avx2() ? SK_ISA_AVX2 : SK_ISA_PORTABLE;
        const char *off = getenv("SLUICE_KERNELS_NO_AVX512");
        if (level == SK_ISA_AVX2 && __builtin_cpu_supports("avx512f") && !(off && off[0] == '1')) {
            level = SK_ISA_AVX512;
            if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                __builtin_cpu_supports("avx512vnni"))
                level = SK_ISA_VNNI512;
        }
        g_isa_host = level;
    }
    return g_isa_host;
}

int sk_isa(void) {
    int h = isa_host();
    return h < g_isa_cap ? h : g_isa_cap;
}

/* Cap the level the kernels use (cap < 0: only ask); returns the host's level. */
EXPORT int sk_set_isa_cap(int cap) {
    if (cap >= 0) g_isa_cap = cap;
    return isa_host();
}


/* Tests and benchmarks (older interface): 0 caps the kernels at AVX2 (same bits), 1 allows every level
 * the CPU has (default), -1 asks; returns whether the CPU has AVX-512F (and SLUICE_KERNELS_NO_AVX512 is
 * not 1). */
EXPORT int sk_allow_avx512(int on) { /* on < 0: only ask */
    if (on >= 0) g_isa_cap = on ? SK_ISA_VNNI512 : SK_ISA_AVX2;
    return isa_host() >= SK_ISA_AVX512;
}

static int g_have_avx2 = -1;

int sk_avx2(void) {
    if (g_have_avx2 < 0) {
        __builtin_cpu_init();
        int ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("f16c");
        const char *force = getenv("SLUICE_KERNELS_PORTABLE");
        if (force && force[0] == '1') ok = 0;
        g_have_avx2 = ok;
    }
    return g_have_avx2;
}

/* ------------------------------------------------------------------ scratch ------- */

#define SCRATCH_SLOTS 7
static _Thread_local struct { void *p; size_t n; } scratch[SCRATCH_SLOTS];

void *sk_scratch(int which, size_t bytes) {
    if (scratch[which].n < bytes) {
        free(scratch[which].p);
        size_t n = (bytes + 4095) & ~(size_t)4095;
        scratch[which].p = aligned_alloc(64, n);
        scratch[which].n = scratch[which].p ? n : 0;
    }
    return scratch[which].p;
}

/* ---------------------------------------------------------------- thread pool ----- */

/*
 * Workers spin briefly after each job (decode issues GEMVs back to back), then sleep on a
 * condition variable. A job is a range of items cut into chunks that the caller and the
 * workers claim with an atomic counter: the caller starts at once and never waits for a
 * worker that has not woken up yet; it only waits for chunks a worker has already taken.
 * (The previous pool split rows into fixed halves and waited for every worker, so a
 * worker that was asleep or descheduled by another process stalled the whole call.)
 *
 * A worker joins job g only while it is open: it increments `active`, then re-checks
 * `open == g`; the caller closes the job (open = 0) and then waits for `active == 0`.
 * Both sides use sequentially consistent atomics, so one of them always sees the other.
 */

#define MAX_THREADS 64
/* How long a worker spins after a job before it sleeps. A decode token's kernels come with gaps
 * of Python between them (routing, the KV write, the wrappers); a worker asleep at the next call
 * costs a futex wake, ~35 us on the project's VMs, on every call with a gap longer than the spin.
 * 4000 pauses (52 us here; a pause takes 3-40 ns by CPU) slept through most gaps: 1 ms of spin
 * measured 1.06x warm decode on the 2 GB bf16 Mixtral shape at 2 threads (5 of 5 alternating
 * turns; docs/benchmarks.md), the same CPU time per token. Timed with the clock, not a count;
 * after the first 50 us the spin yields at every clock read, so on a busy machine another
 * process that wants this core gets it (sched_yield returns at once when nobody does). */
#define WORKER_SPIN_NS 1000000L
#define WORKER_YIELD_NS 50000L
#define SPIN_CHECK 64 /* pauses between clock reads */

static long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int nthreads;           /* workers besides the caller */
    atomic_long generation; /* bumped once per job */
    atomic_long open;       /* generation of the open job, 0 when none */
    atomic_int active;      /* workers inside the open job */
    atomic_int sleepers;
    atomic_int next;        /* next chunk to claim */
    atomic_int done;        /* chunks finished (static schedule only) */
    sk_range_fn fn;
    void *ctx;
    int nitems, chunk, nchunks, maxworkers, dynamic;
    pthread_t tid[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static int g_schedule_dynamic = 1;

static void run_chunk(int c) {
    int i0 = c * pool.chunk, i1 = i0 + pool.chunk;
    if (i1 > pool.nitems) i1 = pool.nitems;
    if (i0 < i1) pool.fn(pool.ctx, i0, i1);
}

/* participant `who` (0 = caller) works on the open job */
static void participate(int who) {
    if (pool.dynamic) {
        int c;
        while ((c = atomic_fetch_add(&pool.next, 1)) < pool.nchunks) run_chunk(c);
    } else if (who < pool.nchunks) {
        run_chunk(who);
        atomic_fetch_add(&pool.done, 1);
    }
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    long seen = 0;
    for (;;) {
        long g;
        int spins = 0;
        long until = 0;
        while ((g = atomic_load(&pool.generation)) == seen) {
            __builtin_ia32_pause();
            if (++spins % SPIN_CHECK) continue;
            const long t = now_ns();
            if (!until) until = t + WORKER_SPIN_NS;
            if (t < until) {
                if (until - t < WORKER_SPIN_NS - WORKER_YIELD_NS) sched_yield();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            atomic_fetch_add(&pool.sleepers, 1);
            while ((g = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mu);
            break;
        }
        seen = g;
        atomic_fetch_add(&pool.active, 1);
        if (atomic_load(&pool.open) == g && id < pool.maxworkers) participate(id + 1);
        atomic_fetch_sub(&pool.active, 1);
    }
    return NULL;
}

static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;

void sk_parallel(sk_range_fn fn, void *ctx, int nitems, int chunk, int nthreads) {
    if (nitems <= 0) return;
    if (chunk < 1) chunk = 1;
    int nchunks = (nitems + chunk - 1) / chunk;
    if (nthreads > pool.nthreads + 1) nthreads = pool.nthreads + 1;
    if (nthreads <= 1 || nchunks <= 1) {
        fn(ctx, 0, nitems);
        return;
    }
    pthread_mutex_lock(&run_mu);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.nitems = nitems;
    pool.dynamic = g_schedule_dynamic;
    if (!pool.dynamic) { /* fixed contiguous parts, one per participant */
        if (nchunks > nthreads) nchunks = nthreads;
        chunk = (nitems + nchunks - 1) / nchunks;
        nchunks = (nitems + chunk - 1) / chunk;
    }
    pool.chunk = chunk;
    pool.nchunks = nchunks;
    pool.maxworkers = nthreads - 1;
    atomic_store(&pool.next, 0);
    atomic_store(&pool.done, 0);
    long g = atomic_load(&pool.generation) + 1;
    atomic_store(&pool.open, g);
    atomic_store(&pool.generation, g);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    participate(0);
    if (!pool.dynamic) { /* every part has an owner: wait for all of them */
        int spins = 0;
        while (atomic_load(&pool.done) < (nchunks < nthreads ? nchunks : nthreads)) {
            if (++spins > 2000) sched_yield(); else __builtin_ia32_pause();
        }
    }
    atomic_store(&pool.open, 0);
    int spins = 0;
    while (atomic_load(&pool.active) > 0) {
        if (++spins > 2000) sched_yield(); else __builtin_ia32_pause();
    }
    pthread_mutex_unlock(&run_mu);
}

/* Set the number of compute threads (including the caller). Only grows the pool. */
EXPORT int sk_set_threads(int n) {
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&run_mu);
    while (pool.nthreads < n - 1) {
        int id = pool.nthreads;
        if (pthread_create(&pool.tid[id], NULL, worker_main, (void *)(intptr_t)id) != 0) break;
        pthread_detach(pool.tid[id]);
        pool.nthreads++;
    }
    pthread_mutex_unlock(&run_mu);
    return pool.nthreads + 1;
}

/* Benchmarks only: 1 = dynamic chunks (default), 0 = one fixed part per thread (the old pool). */
EXPORT void sk_set_schedule(int dynamic) { g_schedule_dynamic = dynamic ? 1 : 0; }

/* Rows per chunk so that one chunk holds about 32 KiB of weights (at least 4 rows). */
int sk_chunk_rows(size_t row_bytes, int nrows) {
    size_t r = (32u << 10) / (row_bytes ? row_bytes : 1);
    if (r < 4) r = 4;
    if (r > (size_t)nrows) r = (size_t)nrows;
    return (int)r;
}

