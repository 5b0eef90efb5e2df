/*
 * Sluice CPU kernels: fp32 activations x stored weights -> fp32 outputs.
 *
 * Loaded with ctypes (no Python or torch API is used, nothing links against torch).
 * Every entry point computes rows [n0, n1) of y[t, n] = sum_k x[t, k] * W(n, k) (+ b[n])
 * for t in [0, T), so callers can split rows across threads. A small persistent thread
 * pool (sk_parallel) does that split inside C, keeping Python out of the hot loop.
 *
 * Paths: AVX2+FMA+F16C (chosen at run time with __builtin_cpu_supports) and portable C.
 * Summation order is fixed for a given (T, K): results do not depend on thread count.
 * sk_dense takes W [N, K] (output-major rows); sk_dense_t takes W [K, N] (input-major).
 * Quantized formats live in quant.c, the thread pool, scratch and ISA level in runtime.c.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <math.h>
#include <immintrin.h>

#include "sk.h"

/* ---------------------------------------------------------------- conversions ---- */

#define bf16_to_f32 sk_bf16_to_f32
#define f16_to_f32 sk_f16_to_f32

float sk_f16_to_f32(uint16_t h) {
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

AVX2 static inline __m256 load8(const void *w, size_t idx, int wtype) {
    if (wtype == WT_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + idx));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else if (wtype == WT_F16) {
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + idx)));
    }
    return _mm256_loadu_ps((const float *)w + idx);
}


/*
 * Software prefetch for the memory-bound tiles (one to three tokens: decode, a draft's
 * verification). The tile reads its rows as NR streams side by side; bf16 rows of 2-7 KiB are
 * short streams for the hardware prefetcher, which restarts on every tile and every page
 * (measured: the bf16 GEMV at 0.69-0.79 of a plain read, the f32 one of the same shape at 1.0).
 * Each stream is fetched PF_NEAR bytes ahead into L1 and PF_FAR bytes ahead into L2, continuing
 * into the next tile's rows past a row's end and stopping at the end of the caller's rows (a
 * thread's chunk), so no other thread's rows are read twice. Only addresses: never the bits.
 * (docs/benchmarks.md, "Decode kernels against the memory roofline".)
 */
#define PF_NEAR 2048
#define PF_FAR 16384
#define PF_MAX_T 3

/* memory-bound 2-byte rows: prefetch (f32 rows, a page each at K = 1024, measured 0.90-0.95x with it) */
static inline int pf_wanted(const dense_args *a) { return a->T <= PF_MAX_T && a->wtype != WT_F32 && a->K >= 16; }

static inline size_t wt_size(int wt) { return wt == WT_F32 ? 4 : 2; }

/* The two prefetch streams of a tile (PF_NEAR ahead into L1, PF_FAR into L2), each at a
 * position ahead of the tile's column: q tiles further down, column c. */
typedef struct { int q, c; } pf_pos;
typedef struct { pf_pos near, far; int line; size_t esize; } pf_streams;

static inline pf_pos pf_at(int ahead_elems, int K) {
    pf_pos p = {ahead_elems / K, ahead_elems % K};
    return p;
}

static inline pf_streams pf_init(const dense_args *a) { /* K >= 16 (pf_wanted) */
    const size_t esize = wt_size(a->wtype);
    pf_streams p = {pf_at(PF_NEAR / (int)esize, a->K), pf_at(PF_FAR / (int)esize, a->K), 64 / (int)esize, esize};
    return p;
}

static inline void pf_step(pf_pos *p, int step, int K) {
    p->c += step;
    while (p->c >= K) { p->c -= K; p->q++; }
}

/* prefetch column p.c of the NR rows q tiles below row n (rows at or past nend skipped) */
__attribute__((always_inline)) static inline void pf_rows(const char *w, size_t esize, int n, int NR, int K, int nend,
                                                          pf_pos p, int hint_l1) {
    const int row = n + NR * p.q;
    for (int r = 0; r < NR && row + r < nend; r++) {
        const char *addr = w + ((size_t)(row + r) * K + p.c) * esize;
        if (hint_l1) _mm_prefetch(addr, _MM_HINT_T0);
        else _mm_prefetch(addr, _MM_HINT_T1);
    }
}

/* At column k of a tile of NR rows from row n: once per cache line of a row, both streams'
 * lines of all NR rows, then both move one line on. */
__attribute__((always_inline)) static inline void pf_tick(pf_streams *p, const dense_args *a, int k, int n, int NR,
                                                          int nend) {
    if (k & (p->line - 1)) return;
    pf_rows((const char *)a->w, p->esize, n, NR, a->K, nend, p->near, 1);
    pf_rows((const char *)a->w, p->esize, n, NR, a->K, nend, p->far, 0);
    pf_step(&p->near, p->line, a->K);
    pf_step(&p->far, p->line, a->K);
}

/* One row at a time, all T tokens per row (the row stays in L1 after the first token),
 * two accumulators per row over K in steps of 16. Streaming one row at a time measured
 * ~1.5-2x faster than interleaving four rows when the matrix comes from DRAM (see
 * docs/quantization.md); the per-row summation order is the same as before. */
__attribute__((always_inline)) AVX2 static inline void dense_rows_avx2_pf(const dense_args *a, int n0, int n1,
                                                                          const int pf) {
    const int K = a->K, T = a->T, wt = a->wtype;
    const int K16 = K & ~15;
    const size_t esize = wt_size(wt), end = (size_t)n1 * K * esize;
    const char *wb = (const char *)a->w;
    for (int n = n0; n < n1; n++) {
        const size_t r0 = (size_t)n * K;
        for (int t = 0; t < T; t++) {
            const float *x = a->x + (size_t)t * K;
            __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps();
            for (int k = 0; k < K16; k += 16) {
                if (pf && t == 0 && ((r0 + k) & 31) == 0) { /* one stream: the rows in order, a line per prefetch */
                    const size_t at = (r0 + k) * esize;
                    if (at + PF_NEAR < end) _mm_prefetch(wb + at + PF_NEAR, _MM_HINT_T0);
                    if (at + PF_FAR < end) _mm_prefetch(wb + at + PF_FAR, _MM_HINT_T1);
                }
                a0 = _mm256_fmadd_ps(load8(a->w, r0 + k, wt), _mm256_loadu_ps(x + k), a0);
                b0 = _mm256_fmadd_ps(load8(a->w, r0 + k + 8, wt), _mm256_loadu_ps(x + k + 8), b0);
            }
            float s = sk_hsum8(_mm256_add_ps(a0, b0));
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

AVX2 static void dense_rows_avx2(const dense_args *a, int n0, int n1) {
    if (pf_wanted(a)) dense_rows_avx2_pf(a, n0, n1, 1);
    else dense_rows_avx2_pf(a, n0, n1, 0);
}

/* The scalar tail of dense_rows_avx2 (k >= K16), shared by the tiled kernel so that both
 * compile it the same way (same contraction) and every output keeps one summation order. */
AVX2 static inline float dense_tail(const float *x, const void *w, size_t r0, int K16, int K, int wt, float s) {
    for (int k = K16; k < K; k++) {
        size_t idx = r0 + k;
        float wv = wt == WT_F32 ? ((const float *)w)[idx]
                 : wt == WT_BF16 ? bf16_to_f32(((const uint16_t *)w)[idx])
                 : f16_to_f32(((const uint16_t *)w)[idx]);
        s += x[k] * wv;
    }
    return s;
}

/*
 * Batch-invariant tiled form of dense_rows_avx2: a tile of 2 rows x NT tokens (NT <= 3) keeps
 * the two accumulators of each of its outputs in registers, so each weight load serves NT
 * tokens and each activation load 2 rows. Every output is summed exactly as dense_rows_avx2
 * sums it (a0 over k % 16 < 8, b0 over the rest, ascending k; hsum8(a0 + b0); the scalar
 * tail; the bias), so a row's result does not depend on how many rows come with it.
 */
__attribute__((always_inline)) AVX2 static inline void dense_tile(const dense_args *a, int n, int nr, int t0,
                                                                  const int NT, int nend, const int pf) {
    const int K = a->K, wt = a->wtype;
    const int K16 = K & ~15;
    pf_streams ahead = pf ? pf_init(a) : (pf_streams){{0, 0}, {0, 0}, 0, 0};
    __m256 acc[2][3][2];
    for (int r = 0; r < 2; r++)
        for (int t = 0; t < 3; t++) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    const size_t w0 = (size_t)n * K, w1 = (size_t)(n + (nr > 1 ? 1 : 0)) * K;
    const float *x0 = a->x + (size_t)t0 * K;
    for (int k = 0; k < K16; k += 16) {
        if (pf) pf_tick(&ahead, a, k, n, 2, nend);
        for (int h = 0; h < 2; h++) {
            const __m256 wa = load8(a->w, w0 + k + 8 * h, wt), wb = load8(a->w, w1 + k + 8 * h, wt);
            for (int t = 0; t < NT; t++) {
                const __m256 xv = _mm256_loadu_ps(x0 + (size_t)t * K + k + 8 * h);
                acc[0][t][h] = _mm256_fmadd_ps(wa, xv, acc[0][t][h]);
                acc[1][t][h] = _mm256_fmadd_ps(wb, xv, acc[1][t][h]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < NT; t++) {
            const float *x = x0 + (size_t)t * K;
            float s = sk_hsum8(_mm256_add_ps(acc[r][t][0], acc[r][t][1]));
            s = dense_tail(x, a->w, r ? w1 : w0, K16, K, wt, s);
            a->y[(size_t)(t0 + t) * a->N + n + r] = s + (a->bias ? a->bias[n + r] : 0.0f);
        }
}

static inline float wval(const void *w, size_t idx, int wt);

AVX2 static void dense_tiled_avx2_rows(const dense_args *a, int n0, int n1) {
    const int T = a->T, pf = pf_wanted(a);
    int t0 = 0;
#define SK_TILE2(NT_)                                                                                  \
    do {                                                                                               \
        if (pf) for (int n = n0; n < n1; n += 2) dense_tile(a, n, n1 - n < 2 ? 1 : 2, t0, NT_, n1, 1); \
        else for (int n = n0; n < n1; n += 2) dense_tile(a, n, n1 - n < 2 ? 1 : 2, t0, NT_, n1, 0);   \
    } while (0)
    for (; t0 + 3 <= T; t0 += 3) SK_TILE2(3);
    if (T - t0 == 2) SK_TILE2(2);
    else if (T - t0 == 1) SK_TILE2(1);
#undef SK_TILE2
}

/* bf16/f16 weights and 6+ tokens on AVX2: each block of 16 rows is widened to fp32 once (exact)
 * into per-thread scratch and the tiles multiply the fp32 copy, so the conversion is not
 * repeated for every 3 tokens (it took two of the tile's port-0/1 slots per 6 fmas). The same
 * tile on the same values: the same bits. */
#define WIDEN_ROWS 16
#define WIDEN_MIN_T 6

typedef void (*dense_rows_fn)(const dense_args *a, int n0, int n1);

AVX2 static void dense_widened(const dense_args *a, int n0, int n1, dense_rows_fn tiles, float *buf, int rows) {
    const int K = a->K, K8 = K & ~7;
    for (int nb = n0; nb < n1; nb += rows) {
        const int R = n1 - nb < rows ? n1 - nb : rows;
        for (int r = 0; r < R; r++) {
            const size_t src = (size_t)(nb + r) * K;
            float *dst = buf + (size_t)r * K;
            int k = 0;
            for (; k < K8; k += 8) _mm256_storeu_ps(dst + k, load8(a->w, src + k, a->wtype));
            for (; k < K; k++) dst[k] = wval(a->w, src + k, a->wtype);
        }
        dense_args b = {a->x, buf, a->bias ? a->bias + nb : NULL, a->y + nb, a->T, a->N, K, WT_F32};
        tiles(&b, 0, R);
    }
}

/* Scratch for a widened block of rows, or NULL when the weights are f32 or the tokens few. */
static float *widen_buffer(const dense_args *a, int rows) {
    if (a->wtype == WT_F32 || a->T < WIDEN_MIN_T) return NULL;
    return (float *)sk_scratch(6, sizeof(float) * (size_t)rows * a->K);
}

AVX2 static void dense_tiled_avx2(const dense_args *a, int n0, int n1) {
    float *buf = widen_buffer(a, WIDEN_ROWS);
    if (buf) dense_widened(a, n0, n1, dense_tiled_avx2_rows, buf, WIDEN_ROWS);
    else dense_tiled_avx2_rows(a, n0, n1);
}

/*
 * AVX-512 form of the same tile, chosen at run time where the CPU has AVX-512F: one zmm
 * accumulator per output holds dense_rows_avx2's two chains side by side (lanes 0-7 are a0,
 * lanes 8-15 are b0: the same fma chain per lane), and the final hsum8(low + high) is
 * dense_rows_avx2's hsum8(a0 + b0). 32 registers fit a tile of 4 rows x 6 tokens.
 */

AVX512 static inline __m512 load16z(const void *w, size_t idx, int wtype) {
    if (wtype == WT_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + idx));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else if (wtype == WT_F16) {
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + idx)));
    }
    return _mm512_loadu_ps((const float *)w + idx);
}

__attribute__((always_inline)) AVX512 static inline void dense_tile512(const dense_args *a, int n, int nr, int t0,
                                                                       const int NT, const int NR, int nend, const int pf) {
    const int K = a->K, wt = a->wtype;
    const int K16 = K & ~15;
    pf_streams ahead = pf ? pf_init(a) : (pf_streams){{0, 0}, {0, 0}, 0, 0};
    __m512 acc[4][6];
    for (int r = 0; r < NR; r++)
        for (int t = 0; t < NT; t++) acc[r][t] = _mm512_setzero_ps();
    size_t wr[4];
    for (int r = 0; r < NR; r++) wr[r] = (size_t)(n + (r < nr ? r : 0)) * K;
    const float *x0 = a->x + (size_t)t0 * K;
    for (int k = 0; k < K16; k += 16) {
        if (pf) pf_tick(&ahead, a, k, n, NR, nend);
        __m512 wv[4];
        for (int r = 0; r < NR; r++) wv[r] = load16z(a->w, wr[r] + k, wt);
        for (int t = 0; t < NT; t++) {
            const __m512 xv = _mm512_loadu_ps(x0 + (size_t)t * K + k);
            for (int r = 0; r < NR; r++) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int t = 0; t < NT; t++) {
            const float *x = x0 + (size_t)t * K;
            const __m256 lo = _mm512_castps512_ps256(acc[r][t]);
            const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][t]), 1));
            float s = sk_hsum8(_mm256_add_ps(lo, hi));
            s = dense_tail(x, a->w, wr[r], K16, K, wt, s);
            a->y[(size_t)(t0 + t) * a->N + n + r] = s + (a->bias ? a->bias[n + r] : 0.0f);
        }
}

AVX512 static void dense_tiled_avx512_rows(const dense_args *a, int n0, int n1) {
    const int T = a->T, pf = pf_wanted(a);
    int t0 = 0;
#define SK_TILE_ROWS(NT_)                                                                                       \
    do {                                                                                                        \
        if (pf) for (int n = n0; n < n1; n += 4) dense_tile512(a, n, n1 - n < 4 ? n1 - n : 4, t0, NT_, 4, n1, 1); \
        else for (int n = n0; n < n1; n += 4) dense_tile512(a, n, n1 - n < 4 ? n1 - n : 4, t0, NT_, 4, n1, 0);   \
    } while (0)
    for (; t0 + 6 <= T; t0 += 6) SK_TILE_ROWS(6);
    switch (T - t0) {
    case 5: SK_TILE_ROWS(5); break;
    case 4: SK_TILE_ROWS(4); break;
    case 3: SK_TILE_ROWS(3); break;
    case 2: SK_TILE_ROWS(2); break;
    case 1: SK_TILE_ROWS(1); break;
    default: break;
    }
#undef SK_TILE_ROWS
}

/* (Widening rows first as the AVX2 path does measured 0.92-1.04x here: the 4 x 6 tile already
 * spreads each conversion over 6 tokens.) */
AVX512 static void dense_tiled_avx512(const dense_args *a, int n0, int n1) { dense_tiled_avx512_rows(a, n0, n1); }

static int sk_avx512(void) { return sk_isa() >= SK_ISA_AVX512; }

/* ------------------------------------------------------------------ entry points -- */

static void dense_task(void *ctx, int n0, int n1) {
    const dense_args *a = (const dense_args *)ctx;
    if (sk_avx2()) {
        if (sk_avx512()) dense_tiled_avx512(a, n0, n1);
        else if (a->T > 1) dense_tiled_avx2(a, n0, n1);
        else dense_rows_avx2(a, n0, n1);
    } else dense_rows_c(a, n0, n1);
}

/* Rows per chunk of sk_dense's job over N rows of row_bytes each. */
static int dense_chunk(int T, int N, size_t row_bytes, int nthreads) {
    /* Decode (T <= PF_MAX_T, memory-bound): ~512 KiB of rows per chunk, so each thread reads long
     * runs of memory and the prefetch, which stops at a chunk's end, restarts seldom (2 threads,
     * bf16: 32 KiB chunks 0.74-0.83 of a plain read, 256 KiB 0.90-0.94, 512 KiB 0.95-1.0; 1 MiB
     * leaves 7 chunks of an expert's matrix for 2 threads). Tiled prefill: ~256 KiB (L2), so the
     * activations are re-read less often. Never more than one thread's share, so every thread
     * gets work; never less than sk_chunk_rows. */
    const size_t target = (T <= PF_MAX_T ? 512u : 256u) << 10;
    size_t r = target / (row_bytes ? row_bytes : 1);
    size_t per_thread = ((size_t)N + nthreads - 1) / (nthreads > 0 ? nthreads : 1);
    if (r > per_thread) r = per_thread;
    int chunk = sk_chunk_rows(row_bytes, N);
    if (r < (size_t)chunk) r = chunk;
    return r > (size_t)N ? N : (int)r;
}

/* y[T, N] = x[T, K] @ W[N, K]^T (+ bias), W in f32 / bf16 / f16. */
EXPORT void sk_dense(const float *x, const void *w, const float *bias, float *y, int T, int N, int K, int wtype,
                     int nthreads) {
    dense_args a = {x, w, bias, y, T, N, K, wtype};
    size_t row_bytes = (size_t)K * wt_size(wtype);
    /* small matrices: not worth waking the pool */
    if ((size_t)N * row_bytes < (64u << 10)) nthreads = 1;
    sk_parallel(dense_task, &a, N, dense_chunk(T, N, row_bytes, nthreads), nthreads);
}

/* Two products of one x in one job (gate and up of an expert): rows [0, N) of the first, then
 * [0, N) of the second, so the pool is woken and joined once. Each row is sk_dense's. */
typedef struct { dense_args a, b; } dense_pair_args;

static void dense_pair_task(void *ctx, int i0, int i1) {
    const dense_pair_args *p = (const dense_pair_args *)ctx;
    const int N = p->a.N;
    if (i0 < N) dense_task((void *)&p->a, i0, i1 < N ? i1 : N);
    if (i1 > N) dense_task((void *)&p->b, (i0 > N ? i0 : N) - N, i1 - N);
}

static void sk_dense_pair(const float *x, const void *w0, const void *w1, float *y0, float *y1, int T, int N, int K,
                          int wtype, int nthreads) {
    dense_pair_args p = {{x, w0, NULL, y0, T, N, K, wtype}, {x, w1, NULL, y1, T, N, K, wtype}};
    size_t row_bytes = (size_t)K * wt_size(wtype);
    if ((size_t)2 * N * row_bytes < (64u << 10)) nthreads = 1;
    sk_parallel(dense_pair_task, &p, 2 * N, dense_chunk(T, 2 * N, row_bytes, nthreads), nthreads);
}

/* ------------------------------------------------------- one SwiGLU expert ---- */

/*
 * One token through one expert: y = scale * down(silu(gate(x)) * up(x)), in a single call so
 * decoding pays one foreign call per expert instead of a handful of small tensor operations.
 * Each matrix product is sk_dense's (same rows, same summation order; gate and up in one pool job);
 * scratch holds 2 * I floats.
 */
EXPORT void sk_swiglu(const float *x, const void *gate, const void *up, const void *down, float *scratch, float *y,
                      int H, int I, int wtype, float scale, int nthreads) {
    float *g = scratch, *u = scratch + I;
    sk_dense_pair(x, gate, up, g, u, 1, I, H, wtype, nthreads);
    for (int i = 0; i < I; i++) g[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    sk_dense(g, down, NULL, y, 1, H, I, wtype, nthreads);
    for (int i = 0; i < H; i++) y[i] *= scale;
}

/* sk_swiglu for T tokens (scratch: 2 * T * I floats): each token's output bit-identical to
 * sk_swiglu on that token alone (sk_dense is batch-invariant; the activation is per element). */
EXPORT void sk_swiglu_rows(const float *x, const void *gate, const void *up, const void *down, float *scratch,
                           float *y, int T, int H, int I, int wtype, float scale, int nthreads) {
    float *g = scratch, *u = scratch + (size_t)T * I;
    sk_dense_pair(x, gate, up, g, u, T, I, H, wtype, nthreads);
    for (size_t i = 0; i < (size_t)T * I; i++) g[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    sk_dense(g, down, NULL, y, T, H, I, wtype, nthreads);
    for (size_t i = 0; i < (size_t)T * H; i++) y[i] *= scale;
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
AVX2 static void dense_t_cols_avx2(const dense_t_args *a, int n0, int n1) {
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
                if (t == 0 && k + 8 <= K) { /* the next row block, one cache line ahead per row */
                    const char *wb = (const char *)a->w;
                    const size_t es = wt_size(wt);
                    _mm_prefetch(wb + (r3 + N + c) * es, _MM_HINT_T0);
                    _mm_prefetch(wb + (r3 + 2 * (size_t)N + c) * es, _MM_HINT_T0);
                    _mm_prefetch(wb + (r3 + 3 * (size_t)N + c) * es, _MM_HINT_T0);
                    _mm_prefetch(wb + (r3 + 4 * (size_t)N + c) * es, _MM_HINT_T0);
                }
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

static void dense_t_task(void *ctx, int n0, int n1) {
    const dense_t_args *a = (const dense_t_args *)ctx;
    if (sk_avx2()) dense_t_cols_avx2(a, n0, n1);
    else dense_t_cols_c(a, n0, n1);
}

/* Columns per chunk: one wide chunk per thread (whole 16-column vectors, at least 256
 * columns). Each chunk walks all K rows of its columns; wide chunks keep those row
 * segments long, which the row-block prefetch needs (narrow chunks measured ~1.5x slower). */
static int dense_t_chunk(int N, int nthreads) {
    int c = (N + nthreads - 1) / (nthreads > 0 ? nthreads : 1);
    if (c < 256) c = 256;
    c = (c + 15) & ~15;
    return c < N ? c : N;
}

/* y[T, N] = x[T, K] @ W[K, N] (+ bias), W input-major in f32 / bf16 / f16. */
EXPORT void sk_dense_t(const float *x, const void *w, const float *bias, float *y, int T, int N, int K, int wtype,
                       int nthreads) {
    dense_t_args a = {x, w, bias, y, T, N, K, wtype};
    size_t bytes = (size_t)N * K * wt_size(wtype);
    if (bytes < (64u << 10)) nthreads = 1; /* small matrices: not worth waking the pool */
    sk_parallel(dense_t_task, &a, N, dense_t_chunk(N, nthreads), nthreads);
}

/* ------------------------------- output-major weights in the input-major order ---- */

/*
 * y[t, n] = sum_k x[t, k] * W[n, k] (+ b[n]) for W stored [N, K] (output-major), each output
 * summed exactly as sk_dense_t sums it: one fused multiply-add chain over k in ascending
 * order from 0, the bias added last (the portable path: the same multiply-then-add chain as
 * dense_t_cols_c). So experts a family stores input-major (GPT-OSS) give the same bits from
 * their input-major slices (sk_dense_t) and from canonical container records (this kernel).
 * AVX2: eight rows at a time, 8x8 blocks transposed in registers so that each lane walks
 * one row's k in order; a scalar fmaf chain for the rows and columns left over.
 */
static void dense_chain_rows_c(const dense_args *a, int n0, int n1) {
    const int K = a->K;
    for (int t = 0; t < a->T; t++) {
        const float *x = a->x + (size_t)t * K;
        for (int n = n0; n < n1; n++) {
            float s = 0.0f;
            for (int k = 0; k < K; k++) s += x[k] * wval(a->w, (size_t)n * K + k, a->wtype);
            a->y[(size_t)t * a->N + n] = s + (a->bias ? a->bias[n] : 0.0f);
        }
    }
}

AVX2 static inline void transpose8(__m256 *r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

#define CHAIN_MAX_T 8 /* tokens per pass: their accumulators stay in L1 */

AVX2 static void dense_chain_rows_avx2(const dense_args *a, int n0, int n1) {
    const int K = a->K, N = a->N, wt = a->wtype;
    const int K8 = K & ~7;
    const int v1 = n0 + ((n1 - n0) & ~7);
    for (int t0 = 0; t0 < a->T; t0 += CHAIN_MAX_T) {
        const int T = a->T - t0 < CHAIN_MAX_T ? a->T - t0 : CHAIN_MAX_T;
        for (int n = n0; n < v1; n += 8) {
            __m256 acc[CHAIN_MAX_T];
            for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
            for (int k = 0; k < K8; k += 8) {
                __m256 c[8];
                for (int r = 0; r < 8; r++) c[r] = load8(a->w, (size_t)(n + r) * K + k, wt);
                transpose8(c); /* c[j] = W[n..n+8, k+j] */
                for (int t = 0; t < T; t++) {
                    const float *x = a->x + (size_t)(t0 + t) * K + k;
                    __m256 p = acc[t];
                    for (int j = 0; j < 8; j++) p = _mm256_fmadd_ps(_mm256_broadcast_ss(x + j), c[j], p);
                    acc[t] = p;
                }
            }
            for (int t = 0; t < T; t++) {
                float s[8];
                _mm256_storeu_ps(s, acc[t]);
                const float *x = a->x + (size_t)(t0 + t) * K;
                for (int r = 0; r < 8; r++) {
                    for (int k = K8; k < K; k++) s[r] = fmaf(x[k], wval(a->w, (size_t)(n + r) * K + k, wt), s[r]);
                    a->y[(size_t)(t0 + t) * N + n + r] = s[r] + (a->bias ? a->bias[n + r] : 0.0f);
                }
            }
        }
        for (int n = v1; n < n1; n++) /* rows left over: the same chain, one lane at a time */
            for (int t = 0; t < T; t++) {
                const float *x = a->x + (size_t)(t0 + t) * K;
                float s = 0.0f;
                for (int k = 0; k < K; k++) s = fmaf(x[k], wval(a->w, (size_t)n * K + k, wt), s);
                a->y[(size_t)(t0 + t) * N + n] = s + (a->bias ? a->bias[n] : 0.0f);
            }
    }
}

static void dense_chain_task(void *ctx, int n0, int n1) {
    const dense_args *a = (const dense_args *)ctx;
    if (sk_avx2()) dense_chain_rows_avx2(a, n0, n1);
    else dense_chain_rows_c(a, n0, n1);
}

/* y[T, N] = x[T, K] @ W[N, K]^T (+ bias), each output in sk_dense_t's summation order. */
EXPORT void sk_dense_chain(const float *x, const void *w, const float *bias, float *y, int T, int N, int K,
                           int wtype, int nthreads) {
    dense_args a = {x, w, bias, y, T, N, K, wtype};
    size_t row_bytes = (size_t)K * wt_size(wtype);
    if ((size_t)N * row_bytes < (64u << 10)) nthreads = 1;
    int chunk = (sk_chunk_rows(row_bytes, N) + 7) & ~7;
    sk_parallel(dense_chain_task, &a, N, chunk < N ? chunk : N, nthreads);
}

/* dst[N, K] fp32 = src[K, N]^T, src element (k, n) at src[k * ld + n * cs] in f32 / bf16 / f16:
 * (a strided view of) an input-major matrix as an output-major fp32 copy, in 64 x 64 tiles
 * (8 x 8 register transposes with AVX2 when cs == 1). Exact: a conversion and a move, so the
 * result does not depend on the path taken. */
static inline float sval(const void *src, size_t k, size_t n, size_t ld, size_t cs, int wt) {
    return wval(src, k * ld + n * cs, wt);
}

/* 8 elements src[idx + 2i] (i < 8) as fp32: f32 and bf16 (even elements of 16 loaded). */
AVX2 static inline __m256 load8_even(const void *w, size_t idx, int wtype) {
    if (wtype == WT_BF16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + idx));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    __m256 lo = _mm256_loadu_ps((const float *)w + idx), hi = _mm256_loadu_ps((const float *)w + idx + 8);
    __m256 e = _mm256_shuffle_ps(lo, hi, 0x88); /* lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6 */
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8));
}

AVX2 static void transpose_tile_avx2(const void *src, int wt, size_t ld, size_t cs, float *dst, int K, int N,
                                     int k0, int k1, int n0, int n1) {
    int k = k0;
    for (; k + 8 <= k1; k += 8) {
        int n = n0;
        for (; n + 8 <= n1 && (cs == 1 || n + 9 <= N); n += 8) { /* cs 2: 16 loaded, none past the last */
            __m256 r[8];
            for (int j = 0; j < 8; j++)
                r[j] = cs == 1 ? load8(src, (size_t)(k + j) * ld + n, wt) : load8_even(src, (size_t)(k + j) * ld + 2 * (size_t)n, wt);
            transpose8(r); /* r[j] = src[k..k+8, n+j] */
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + (size_t)(n + j) * K + k, r[j]);
        }
        for (; n < n1; n++)
            for (int j = 0; j < 8; j++) dst[(size_t)n * K + k + j] = sval(src, k + j, n, ld, cs, wt);
    }
    for (; k < k1; k++)
        for (int n = n0; n < n1; n++) dst[(size_t)n * K + k] = sval(src, k, n, ld, cs, wt);
}

typedef struct { const void *src; float *dst; size_t ld, cs; int K, N, wtype; } transpose_args;

static void transpose_task(void *ctx, int n0, int n1) { /* a range of output rows (input columns) */
    const transpose_args *a = (const transpose_args *)ctx;
    for (int k0 = 0; k0 < a->K; k0 += 64) {
        int k1 = k0 + 64 < a->K ? k0 + 64 : a->K;
        for (int c0 = n0; c0 < n1; c0 += 64) {
            int c1 = c0 + 64 < n1 ? c0 + 64 : n1;
            if ((a->cs == 1 || (a->cs == 2 && a->wtype != WT_F16)) && sk_avx2()) {
                transpose_tile_avx2(a->src, a->wtype, a->ld, a->cs, a->dst, a->K, a->N, k0, k1, c0, c1);
                continue;
            }
            for (int k = k0; k < k1; k++)
                for (int n = c0; n < c1; n++) a->dst[(size_t)n * a->K + k] = sval(a->src, k, n, a->ld, a->cs, a->wtype);
        }
    }
}

EXPORT void sk_transpose_f32(const void *src, float *dst, int K, int N, long long ld, long long cs, int wtype,
                             int nthreads) {
    transpose_args a = {src, dst, (size_t)ld, (size_t)cs, K, N, wtype};
    if ((size_t)N * K < (64u << 10)) nthreads = 1;
    int chunk = (N + (nthreads > 0 ? nthreads : 1) - 1) / (nthreads > 0 ? nthreads : 1);
    chunk = (chunk + 63) & ~63;
    sk_parallel(transpose_task, &a, N, chunk < N ? chunk : N, nthreads);
}

EXPORT int sk_has_avx2(void) { return sk_avx2(); }

EXPORT int sk_version(void) { return 4; }

/* ------------------------------------------------------------ benchmark helper ---- */

/* Sum of n floats with the same pool and chunking as the kernels: the read bandwidth a
 * streaming kernel can reach at this thread count (used by benchmarks/kernels.py). */
typedef struct {
    const float *a;
    size_t n;
    float *partial;
} sum_args;

#define SUM_CHUNK 16384

AVX2 static float sum_avx2(const float *a, size_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_add_ps(s0, _mm256_loadu_ps(a + i));
        s1 = _mm256_add_ps(s1, _mm256_loadu_ps(a + i + 8));
        s2 = _mm256_add_ps(s2, _mm256_loadu_ps(a + i + 16));
        s3 = _mm256_add_ps(s3, _mm256_loadu_ps(a + i + 24));
    }
    float s = sk_hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; i++) s += a[i];
    return s;
}

static void sum_task(void *ctx, int c0, int c1) {
    sum_args *s = (sum_args *)ctx;
    for (int c = c0; c < c1; c++) {
        size_t i0 = (size_t)c * SUM_CHUNK, len = s->n - i0 < SUM_CHUNK ? s->n - i0 : SUM_CHUNK;
        float acc = 0.0f;
        if (sk_avx2()) acc = sum_avx2(s->a + i0, len);
        else
            for (size_t i = 0; i < len; i++) acc += s->a[i0 + i];
        s->partial[c] = acc;
    }
}

EXPORT float sk_bench_sum(const float *a, size_t n, int nthreads) {
    int chunks = (int)((n + SUM_CHUNK - 1) / SUM_CHUNK);
    sum_args s = {a, n, (float *)malloc(sizeof(float) * (size_t)chunks)};
    if (!s.partial) return 0.0f;
    sk_parallel(sum_task, &s, chunks, 4, nthreads);
    float total = 0.0f;
    for (int c = 0; c < chunks; c++) total += s.partial[c];
    free(s.partial);
    return total;
}
