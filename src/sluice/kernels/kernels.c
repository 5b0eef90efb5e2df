/*
 * Sluice CPU kernels: fp32 activations x stored weights -> fp32 outputs.
 *
 * Loaded with ctypes (no Python or torch API is used, nothing links against torch).
 * Every entry point computes rows [n0, n1) of y[t, n] = sum_k x[t, k] * W(n, k) (+ b[n])
 * for t in [0, T), so callers can split rows across threads. A small persistent thread
 * pool (sk_run) does that split inside C, keeping Python out of the hot loop.
 *
 * Paths: AVX2+FMA+F16C (chosen at run time with __builtin_cpu_supports) and portable C.
 * Summation order is fixed for a given (T, K): results do not depend on thread count.
 * sk_dense takes W [N, K] (output-major rows); sk_dense_t takes W [K, N] (input-major).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <pthread.h>
#include <stdatomic.h>
#include <math.h>
#include <immintrin.h>

#define EXPORT __attribute__((visibility("default")))

/* ---------------------------------------------------------------- conversions ---- */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            man &= 0x3ff;
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | (man << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ------------------------------------------------------------------- kernels ----- */

enum { WT_F32 = 0, WT_BF16 = 1, WT_F16 = 2 };

typedef struct {
    const float *x;      /* [T, K] */
    const void *w;       /* [N, K] */
    const float *bias;   /* [N] or NULL */
    float *y;            /* [T, N] */
    int T, N, K, wtype;
} dense_args;

static void dense_rows_c(const dense_args *a, int n0, int n1) {
    const int K = a->K;
    for (int n = n0; n < n1; n++) {
        for (int t = 0; t < a->T; t++) {
            const float *x = a->x + (size_t)t * K;
            float acc[8] = {0};
            int k = 0;
            for (; k + 8 <= K; k += 8) {
                for (int j = 0; j < 8; j++) {
                    float wv;
                    if (a->wtype == WT_F32) wv = ((const float *)a->w)[(size_t)n * K + k + j];
                    else if (a->wtype == WT_BF16) wv = bf16_to_f32(((const uint16_t *)a->w)[(size_t)n * K + k + j]);
                    else wv = f16_to_f32(((const uint16_t *)a->w)[(size_t)n * K + k + j]);
                    acc[j] += x[k + j] * wv;
                }
            }
            float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            for (; k < K; k++) {
                float wv;
                if (a->wtype == WT_F32) wv = ((const float *)a->w)[(size_t)n * K + k];
                else if (a->wtype == WT_BF16) wv = bf16_to_f32(((const uint16_t *)a->w)[(size_t)n * K + k]);
                else wv = f16_to_f32(((const uint16_t *)a->w)[(size_t)n * K + k]);
                s += x[k] * wv;
            }
            a->y[(size_t)t * a->N + n] = s + (a->bias ? a->bias[n] : 0.0f);
        }
    }
}

__attribute__((target("avx2,fma,f16c")))
static inline __m256 load8(const void *w, size_t idx, int wtype) {
    if (wtype == WT_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + idx));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else if (wtype == WT_F16) {
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + idx)));
    }
    return _mm256_loadu_ps((const float *)w + idx);
}

__attribute__((target("avx2,fma,f16c")))
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

/* Four rows at a time, two accumulators per row over K in steps of 16. */
__attribute__((target("avx2,fma,f16c")))
static void dense_rows_avx2(const dense_args *a, int n0, int n1) {
    const int K = a->K, T = a->T, wt = a->wtype;
    const int K16 = K & ~15;
    int n = n0;
    for (; n + 4 <= n1; n += 4) {
        for (int t = 0; t < T; t++) {
            const float *x = a->x + (size_t)t * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(),
                   b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
            size_t r0 = (size_t)n * K, r1 = r0 + K, r2 = r1 + K, r3 = r2 + K;
            for (int k = 0; k < K16; k += 16) {
                __m256 xa = _mm256_loadu_ps(x + k), xb = _mm256_loadu_ps(x + k + 8);
                a0 = _mm256_fmadd_ps(load8(a->w, r0 + k, wt), xa, a0);
                a1 = _mm256_fmadd_ps(load8(a->w, r1 + k, wt), xa, a1);
                a2 = _mm256_fmadd_ps(load8(a->w, r2 + k, wt), xa, a2);
                a3 = _mm256_fmadd_ps(load8(a->w, r3 + k, wt), xa, a3);
                b0 = _mm256_fmadd_ps(load8(a->w, r0 + k + 8, wt), xb, b0);
                b1 = _mm256_fmadd_ps(load8(a->w, r1 + k + 8, wt), xb, b1);
                b2 = _mm256_fmadd_ps(load8(a->w, r2 + k + 8, wt), xb, b2);
                b3 = _mm256_fmadd_ps(load8(a->w, r3 + k + 8, wt), xb, b3);
            }
            float s[4] = {hsum8(_mm256_add_ps(a0, b0)), hsum8(_mm256_add_ps(a1, b1)),
                          hsum8(_mm256_add_ps(a2, b2)), hsum8(_mm256_add_ps(a3, b3))};
            for (int k = K16; k < K; k++) {
                float xv = x[k];
                for (int j = 0; j < 4; j++) {
                    size_t idx = (size_t)(n + j) * K + k;
                    float wv = wt == WT_F32 ? ((const float *)a->w)[idx]
                             : wt == WT_BF16 ? bf16_to_f32(((const uint16_t *)a->w)[idx])
                             : f16_to_f32(((const uint16_t *)a->w)[idx]);
                    s[j] += xv * wv;
                }
            }
            float *y = a->y + (size_t)t * a->N + n;
            for (int j = 0; j < 4; j++) y[j] = s[j] + (a->bias ? a->bias[n + j] : 0.0f);
        }
    }
    for (; n < n1; n++) {
        for (int t = 0; t < T; t++) {
            const float *x = a->x + (size_t)t * K;
            __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps();
            size_t r0 = (size_t)n * K;
            for (int k = 0; k < K16; k += 16) {
                a0 = _mm256_fmadd_ps(load8(a->w, r0 + k, wt), _mm256_loadu_ps(x + k), a0);
                b0 = _mm256_fmadd_ps(load8(a->w, r0 + k + 8, wt), _mm256_loadu_ps(x + k + 8), b0);
            }
            float s = hsum8(_mm256_add_ps(a0, b0));
            for (int k = K16; k < K; k++) {
                size_t idx = r0 + k;
                float wv = wt == WT_F32 ? ((const float *)a->w)[idx]
                         : wt == WT_BF16 ? bf16_to_f32(((const uint16_t *)a->w)[idx])
                         : f16_to_f32(((const uint16_t *)a->w)[idx]);
                s += x[k] * wv;
            }
            a->y[(size_t)t * a->N + n] = s + (a->bias ? a->bias[n] : 0.0f);
        }
    }
}

static int g_have_avx2 = -1;

static int have_avx2(void) {
    if (g_have_avx2 < 0) {
        __builtin_cpu_init();
        g_have_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
        const char *force = getenv("SLUICE_KERNELS_PORTABLE");
        if (force && force[0] == '1') g_have_avx2 = 0;
    }
    return g_have_avx2;
}

/* ---------------------------------------------------------------- thread pool ----- */

typedef void (*task_fn)(void *ctx, int part, int nparts);

#define MAX_THREADS 64

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    int nthreads;          /* workers besides the caller */
    int started;
    atomic_long generation;
    atomic_int remaining;
    task_fn fn;
    void *ctx;
    int nparts;
    pthread_t tid[MAX_THREADS];
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    long seen = 0;
    for (;;) {
        /* spin briefly for back-to-back calls, then sleep */
        long g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen && spins < 4000) {
            spins++;
            __builtin_ia32_pause();
        }
        if (g == seen) {
            pthread_mutex_lock(&pool.mu);
            while ((g = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen)
                pthread_cond_wait(&pool.cv_work, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = g;
        if (id + 1 < pool.nparts) pool.fn(pool.ctx, id + 1, pool.nparts);
        if (atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool.mu);
            pthread_cond_signal(&pool.cv_done);
            pthread_mutex_unlock(&pool.mu);
        }
    }
    return NULL;
}

static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;

/* Run fn(ctx, part, nparts) for part in [0, nparts) on the caller plus pool workers. */
static void sk_run(task_fn fn, void *ctx, int nparts) {
    if (nparts <= 1 || pool.nthreads == 0) {
        for (int p = 0; p < nparts; p++) fn(ctx, p, nparts);
        return;
    }
    pthread_mutex_lock(&run_mu);
    if (nparts > pool.nthreads + 1) nparts = pool.nthreads + 1;
    pool.fn = fn;
    pool.ctx = ctx;
    pool.nparts = nparts;
    atomic_store(&pool.remaining, pool.nthreads);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.cv_work);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, 0, nparts);
    int spins = 0;
    while (atomic_load_explicit(&pool.remaining, memory_order_acquire) > 0 && spins < 200000) {
        spins++;
        __builtin_ia32_pause();
    }
    if (atomic_load_explicit(&pool.remaining, memory_order_acquire) > 0) {
        pthread_mutex_lock(&pool.mu);
        while (atomic_load_explicit(&pool.remaining, memory_order_acquire) > 0)
            pthread_cond_wait(&pool.cv_done, &pool.mu);
        pthread_mutex_unlock(&pool.mu);
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

/* ------------------------------------------------------------------ entry points -- */

static void dense_task(void *ctx, int part, int nparts) {
    const dense_args *a = (const dense_args *)ctx;
    int rows = (a->N + nparts - 1) / nparts;
    rows = (rows + 3) & ~3;
    int n0 = part * rows, n1 = n0 + rows;
    if (n1 > a->N) n1 = a->N;
    if (n0 >= n1) return;
    if (have_avx2()) dense_rows_avx2(a, n0, n1);
    else dense_rows_c(a, n0, n1);
}

/* y[T, N] = x[T, K] @ W[N, K]^T (+ bias), W in f32 / bf16 / f16. */
EXPORT void sk_dense(const float *x, const void *w, const float *bias, float *y, int T, int N, int K, int wtype,
                     int nparts) {
    dense_args a = {x, w, bias, y, T, N, K, wtype};
    /* small matrices: not worth waking the pool */
    if ((long)N * K < 32768) nparts = 1;
    sk_run(dense_task, &a, nparts);
}

/* ------------------------------------------------- input-major weights (x @ W) ---- */

/*
 * y[t, n] = sum_k x[t, k] * W[k, n] (+ b[n]) for W stored [K, N] (input-major, as GPT-OSS
 * stores its experts). Each output is one fused multiply-add chain over k in ascending
 * order, so a result does not depend on the token count, the column tiling or the thread
 * count (the AVX2 lanes and the scalar tail compute the same chain).
 */
typedef struct {
    const float *x;      /* [T, K] */
    const void *w;       /* [K, N] */
    const float *bias;   /* [N] or NULL */
    float *y;            /* [T, N] */
    int T, N, K, wtype;
} dense_t_args;

static inline float wval(const void *w, size_t idx, int wt) {
    return wt == WT_F32 ? ((const float *)w)[idx]
         : wt == WT_BF16 ? bf16_to_f32(((const uint16_t *)w)[idx])
         : f16_to_f32(((const uint16_t *)w)[idx]);
}

static void dense_t_cols_c(const dense_t_args *a, int n0, int n1) {
    const int K = a->K, N = a->N;
    for (int t = 0; t < a->T; t++) {
        const float *x = a->x + (size_t)t * K;
        float *y = a->y + (size_t)t * N;
        for (int n = n0; n < n1; n++) y[n] = 0.0f;
        for (int k = 0; k < K; k++) {
            const float xv = x[k];
            const size_t row = (size_t)k * N;
            for (int n = n0; n < n1; n++) y[n] += xv * wval(a->w, row + n, a->wtype);
        }
        if (a->bias)
            for (int n = n0; n < n1; n++) y[n] += a->bias[n];
    }
}

/*
 * W is streamed sequentially, four rows at a time; y (the thread's columns of every token,
 * L1/L2 resident) holds the running sums between row blocks. Storing and reloading an fp32
 * partial sum does not change it, so every output is still one fma chain in ascending k.
 */
__attribute__((target("avx2,fma,f16c")))
static void dense_t_cols_avx2(const dense_t_args *a, int n0, int n1) {
    const int K = a->K, N = a->N, T = a->T, wt = a->wtype;
    const int v1 = n0 + ((n1 - n0) & ~7); /* end of whole 8-column vectors */
    for (int t = 0; t < T; t++) memset(a->y + (size_t)t * N + n0, 0, sizeof(float) * (size_t)(n1 - n0));
    int k = 0;
    for (; k + 4 <= K; k += 4) {
        const size_t r0 = (size_t)k * N, r1 = r0 + N, r2 = r1 + N, r3 = r2 + N;
        for (int t = 0; t < T; t++) {
            const float *x = a->x + (size_t)t * K + k;
            float *y = a->y + (size_t)t * N;
            const __m256 x0 = _mm256_broadcast_ss(x), x1 = _mm256_broadcast_ss(x + 1),
                         x2 = _mm256_broadcast_ss(x + 2), x3 = _mm256_broadcast_ss(x + 3);
            int c = n0;
            for (; c + 16 <= v1; c += 16) {
                __m256 p = _mm256_loadu_ps(y + c), q = _mm256_loadu_ps(y + c + 8);
                p = _mm256_fmadd_ps(x0, load8(a->w, r0 + c, wt), p);
                q = _mm256_fmadd_ps(x0, load8(a->w, r0 + c + 8, wt), q);
                p = _mm256_fmadd_ps(x1, load8(a->w, r1 + c, wt), p);
                q = _mm256_fmadd_ps(x1, load8(a->w, r1 + c + 8, wt), q);
                p = _mm256_fmadd_ps(x2, load8(a->w, r2 + c, wt), p);
                q = _mm256_fmadd_ps(x2, load8(a->w, r2 + c + 8, wt), q);
                p = _mm256_fmadd_ps(x3, load8(a->w, r3 + c, wt), p);
                q = _mm256_fmadd_ps(x3, load8(a->w, r3 + c + 8, wt), q);
                _mm256_storeu_ps(y + c, p);
                _mm256_storeu_ps(y + c + 8, q);
            }
            for (; c < v1; c += 8) {
                __m256 p = _mm256_loadu_ps(y + c);
                p = _mm256_fmadd_ps(x0, load8(a->w, r0 + c, wt), p);
                p = _mm256_fmadd_ps(x1, load8(a->w, r1 + c, wt), p);
                p = _mm256_fmadd_ps(x2, load8(a->w, r2 + c, wt), p);
                p = _mm256_fmadd_ps(x3, load8(a->w, r3 + c, wt), p);
                _mm256_storeu_ps(y + c, p);
            }
            for (; c < n1; c++) { /* scalar tail: the same fma chain per column */
                float s = y[c];
                s = fmaf(x[0], wval(a->w, r0 + c, wt), s);
                s = fmaf(x[1], wval(a->w, r1 + c, wt), s);
                s = fmaf(x[2], wval(a->w, r2 + c, wt), s);
                s = fmaf(x[3], wval(a->w, r3 + c, wt), s);
                y[c] = s;
            }
        }
    }
    for (; k < K; k++) {
        const size_t r0 = (size_t)k * N;
        for (int t = 0; t < T; t++) {
            const float xv = a->x[(size_t)t * K + k];
            float *y = a->y + (size_t)t * N;
            const __m256 x0 = _mm256_set1_ps(xv);
            int c = n0;
            for (; c < v1; c += 8)
                _mm256_storeu_ps(y + c, _mm256_fmadd_ps(x0, load8(a->w, r0 + c, wt), _mm256_loadu_ps(y + c)));
            for (; c < n1; c++) y[c] = fmaf(xv, wval(a->w, r0 + c, wt), y[c]);
        }
    }
    if (a->bias)
        for (int t = 0; t < T; t++) {
            float *y = a->y + (size_t)t * N;
            for (int c = n0; c < n1; c++) y[c] += a->bias[c];
        }
}

static void dense_t_task(void *ctx, int part, int nparts) {
    const dense_t_args *a = (const dense_t_args *)ctx;
    int cols = (a->N + nparts - 1) / nparts;
    cols = (cols + 63) & ~63; /* whole 64-column tiles per thread */
    int n0 = part * cols, n1 = n0 + cols;
    if (n1 > a->N) n1 = a->N;
    if (n0 >= n1) return;
    if (have_avx2()) dense_t_cols_avx2(a, n0, n1);
    else dense_t_cols_c(a, n0, n1);
}

/* y[T, N] = x[T, K] @ W[K, N] (+ bias), W input-major in f32 / bf16 / f16. */
EXPORT void sk_dense_t(const float *x, const void *w, const float *bias, float *y, int T, int N, int K, int wtype,
                       int nparts) {
    dense_t_args a = {x, w, bias, y, T, N, K, wtype};
    if ((long)N * K < 32768) nparts = 1;
    sk_run(dense_t_task, &a, nparts);
}

EXPORT int sk_has_avx2(void) { return have_avx2(); }

EXPORT int sk_version(void) { return 1; }
