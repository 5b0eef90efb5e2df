/*
 * Block-scaled FP8 (e4m3fn) weights x fp32 activations -> fp32 (DeepSeek-V3 / Kimi K2 layout).
 *
 *   y[t, n] = sum_k x[t, k] * e4m3(w[row0 + n, k]) * s[(row0 + n) / bn, k / bk]  (+ bias[n])
 *
 * s is fp32 [ceil(N_total / bn), sk = ceil(K / bk)]; edge blocks may be partial. Each k-block
 * is summed unscaled, then multiplied by its scale once. Rows [row0, row0 + N) of a larger
 * matrix can be used (MLA reads per-head row ranges of kv_b_proj).
 *
 * e4m3fn -> f32 without a table: for a byte b, the f16 bit pattern ((b & 0x7f) << 7) |
 * ((b & 0x80) << 8) is exactly e4m3(b) * 2^-8 (normals and subnormals alike, both
 * formats having 3 mantissa bits), and F16C widens it to f32 exactly; the 2^8 is folded
 * into the block scale. The portable path uses a 256-entry table of the same values.
 *
 * Every output is computed by one thread in a fixed order: results do not depend on the
 * thread count. Threads come from the pool in kernels.c (sk_parallel).
 */
#define _GNU_SOURCE
#include <math.h>

#include "sk.h"

#define sk_has_avx2 sk_avx2

typedef struct {
    const float *x;     /* [T, K] */
    const uint8_t *w;   /* [N_total, K] e4m3fn bytes */
    const float *s;     /* [ceil(N_total / bn), sk] */
    const float *bias;  /* [N] or NULL */
    float *y;           /* [T, N] */
    int T, N, K, row0, bn, bk, sk;
    int xs, ys;         /* elements between consecutive tokens of x and y (K and N when dense) */
} fp8_args;

/* e4m3fn value * 2^-8 for every byte (NaN encodings read as 480 * 2^-8; they never occur in weights) */
static float lut[256];
static int lut_ready;

static void init_lut(void) {
    if (__atomic_load_n(&lut_ready, __ATOMIC_ACQUIRE)) return;
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 0xf, m = b & 7;
        float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        lut[b] = ((b & 0x80) ? -v : v) * (1.0f / 256.0f);
    }
    __atomic_store_n(&lut_ready, 1, __ATOMIC_RELEASE);
}

static void fp8_rows_c(const fp8_args *a, int n0, int n1) {
    const int K = a->K;
    for (int n = n0; n < n1; n++) {
        const uint8_t *w = a->w + (size_t)(a->row0 + n) * K;
        const float *srow = a->s + (size_t)((a->row0 + n) / a->bn) * a->sk;
        for (int t = 0; t < a->T; t++) {
            const float *x = a->x + (size_t)t * a->xs;
            float acc = 0.0f;
            for (int j = 0; j < a->sk; j++) {
                int k0 = j * a->bk, k1 = k0 + a->bk < K ? k0 + a->bk : K;
                float p[8] = {0};
                int k = k0;
                for (; k + 8 <= k1; k += 8)
                    for (int i = 0; i < 8; i++) p[i] += x[k + i] * lut[w[k + i]];
                float part = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
                for (; k < k1; k++) part += x[k] * lut[w[k]];
                acc += part * (srow[j] * 256.0f);
            }
            a->y[(size_t)t * a->ys + n] = acc + (a->bias ? a->bias[n] : 0.0f);
        }
    }
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

/* 16 e4m3 bytes -> two vectors of 8 floats (values * 2^-8) */
__attribute__((target("avx2,fma,f16c")))
static inline void load16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i mag = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(0x3f80));
    __m256i sgn = _mm256_and_si256(_mm256_slli_epi16(h, 8), _mm256_set1_epi16((short)0x8000));
    __m256i f16 = _mm256_or_si256(mag, sgn);
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(f16));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(f16, 1));
}

#define BUF_K 512 /* blocks up to this wide are converted once per row group and token chunk */
#define T_CHUNK 8

/* Four rows at a time (sharing the activation loads), 16 weights per step within a block.
 * For several tokens, each block of the four rows is converted once into a small buffer and
 * reused for up to T_CHUNK tokens; the arithmetic per output is the same either way. */
__attribute__((target("avx2,fma,f16c")))
static void fp8_rows_avx2(const fp8_args *a, int n0, int n1) {
    const int K = a->K, T = a->T;
    const int buffered = T > 1 && a->bk <= BUF_K;
    float buf[4][BUF_K] __attribute__((aligned(32)));
    for (int n = n0; n < n1; n += 4) {
        const int nr = n1 - n < 4 ? n1 - n : 4;
        const uint8_t *w[4];
        const float *srow[4];
        for (int r = 0; r < 4; r++) {
            int rr = r < nr ? r : 0; /* a short group repeats row 0 and drops it */
            w[r] = a->w + (size_t)(a->row0 + n + rr) * K;
            srow[r] = a->s + (size_t)((a->row0 + n + rr) / a->bn) * a->sk;
        }
        for (int t0 = 0; t0 < T; t0 += T_CHUNK) {
            const int tn = T - t0 < T_CHUNK ? T - t0 : T_CHUNK;
            float acc[T_CHUNK][4] = {{0}};
            for (int j = 0; j < a->sk; j++) {
                const int k0 = j * a->bk, k1 = k0 + a->bk < K ? k0 + a->bk : K;
                const int kv = k0 + ((k1 - k0) & ~15); /* end of the 16-wide part */
                if (buffered) {
                    for (int r = 0; r < 4; r++)
                        for (int k = k0; k < kv; k += 16) {
                            __m256 lo, hi;
                            load16(w[r] + k, &lo, &hi);
                            _mm256_store_ps(&buf[r][k - k0], lo);
                            _mm256_store_ps(&buf[r][k - k0 + 8], hi);
                        }
                }
                for (int t = 0; t < tn; t++) {
                    const float *x = a->x + (size_t)(t0 + t) * a->xs;
                    __m256 p[4][2];
                    for (int r = 0; r < 4; r++) p[r][0] = p[r][1] = _mm256_setzero_ps();
                    for (int k = k0; k < kv; k += 16) {
                        __m256 xa = _mm256_loadu_ps(x + k), xb = _mm256_loadu_ps(x + k + 8);
                        for (int r = 0; r < 4; r++) {
                            __m256 lo, hi;
                            if (buffered) {
                                lo = _mm256_load_ps(&buf[r][k - k0]);
                                hi = _mm256_load_ps(&buf[r][k - k0 + 8]);
                            } else {
                                load16(w[r] + k, &lo, &hi);
                            }
                            p[r][0] = _mm256_fmadd_ps(lo, xa, p[r][0]);
                            p[r][1] = _mm256_fmadd_ps(hi, xb, p[r][1]);
                        }
                    }
                    for (int r = 0; r < 4; r++) {
                        float part = hsum8(_mm256_add_ps(p[r][0], p[r][1]));
                        for (int kk = kv; kk < k1; kk++) part += x[kk] * lut[w[r][kk]];
                        acc[t][r] += part * (srow[r][j] * 256.0f);
                    }
                }
            }
            for (int t = 0; t < tn; t++) {
                float *y = a->y + (size_t)(t0 + t) * a->ys + n;
                for (int r = 0; r < nr; r++) y[r] = acc[t][r] + (a->bias ? a->bias[n + r] : 0.0f);
            }
        }
    }
}

static void fp8_task(void *ctx, int n0, int n1) {
    const fp8_args *a = (const fp8_args *)ctx;
    if (sk_has_avx2()) fp8_rows_avx2(a, n0, n1);
    else fp8_rows_c(a, n0, n1);
}

/* y[T, N] = x[T, K] @ W[row0 : row0 + N]^T (+ bias) for a block-FP8 W (see the top of this file). */
EXPORT void sk_fp8_dense(const float *x, const uint8_t *w, const float *s, const float *bias, float *y, int T, int N,
                         int K, int row0, int bn, int bk, int nparts) {
    init_lut();
    fp8_args a = {x, w, s, bias, y, T, N, K, row0, bn, bk, (K + bk - 1) / bk, K, N};
    if ((long)N * K < 32768) nparts = 1;
    sk_parallel(fp8_task, &a, N, (sk_chunk_rows((size_t)K, N) + 3) & ~3, nparts);
}

/* ------------------------------------------------------------------ dequantize ---- */

typedef struct {
    const uint8_t *w;
    const float *s;
    float *out; /* [N, K] */
    int N, K, row0, bn, bk, sk;
} fp8_deq_args;

/* out = e4m3(w) * s exactly: (e4m3 * 2^-8) * (s * 2^8) is the same real product, rounded once. */
__attribute__((target("avx2,fma,f16c")))
static void fp8_deq_rows_avx2(const fp8_deq_args *a, int n0, int n1) {
    const int K = a->K;
    for (int n = n0; n < n1; n++) {
        const uint8_t *w = a->w + (size_t)(a->row0 + n) * K;
        const float *srow = a->s + (size_t)((a->row0 + n) / a->bn) * a->sk;
        float *o = a->out + (size_t)n * K;
        for (int j = 0; j < a->sk; j++) {
            const int k0 = j * a->bk, k1 = k0 + a->bk < K ? k0 + a->bk : K;
            const float sc = srow[j] * 256.0f;
            const __m256 vs = _mm256_set1_ps(sc);
            int k = k0;
            for (; k + 16 <= k1; k += 16) {
                __m256 lo, hi;
                load16(w + k, &lo, &hi);
                _mm256_storeu_ps(o + k, _mm256_mul_ps(lo, vs));
                _mm256_storeu_ps(o + k + 8, _mm256_mul_ps(hi, vs));
            }
            for (; k < k1; k++) o[k] = lut[w[k]] * sc;
        }
    }
}

static void fp8_deq_rows_c(const fp8_deq_args *a, int n0, int n1) {
    const int K = a->K;
    for (int n = n0; n < n1; n++) {
        const uint8_t *w = a->w + (size_t)(a->row0 + n) * K;
        const float *srow = a->s + (size_t)((a->row0 + n) / a->bn) * a->sk;
        float *o = a->out + (size_t)n * K;
        for (int k = 0; k < K; k++) o[k] = lut[w[k]] * (srow[k / a->bk] * 256.0f);
    }
}

static void fp8_deq_task(void *ctx, int n0, int n1) {
    const fp8_deq_args *a = (const fp8_deq_args *)ctx;
    if (sk_has_avx2()) fp8_deq_rows_avx2(a, n0, n1);
    else fp8_deq_rows_c(a, n0, n1);
}

/* out[N, K] fp32 = rows [row0, row0 + N) of a block-FP8 W, dequantized. */
EXPORT void sk_fp8_dequant(const uint8_t *w, const float *s, float *out, int N, int K, int row0, int bn, int bk,
                           int nparts) {
    init_lut();
    fp8_deq_args a = {w, s, out, N, K, row0, bn, bk, (K + bk - 1) / bk};
    if ((long)N * K < 65536) nparts = 1;
    sk_parallel(fp8_deq_task, &a, N, sk_chunk_rows((size_t)K * 4, N), nparts);
}

/* ------------------------------------------------------- per-head products (MLA) ---- */

/*
 * Multi-head Latent Attention folds kv_b_proj into the query and the output, one head at a
 * time, over row ranges of the same FP8 matrix W (head h owns rows row0 + h * stride ...):
 *
 *   sk_fp8_heads:   y[t, h, :N] = x[t, h, :K] @ W[row0 + h * stride : + N]^T   (output side)
 *   sk_fp8_heads_t: y[t, h, :K] = x[t, h, :D] @ W[row0 + h * stride : + D]     (query side)
 *
 * Heads are split across threads; each output is computed by one thread in a fixed order.
 */

typedef struct {
    const float *x;
    const uint8_t *w;
    const float *s;
    float *y;
    int T, H, N, D, K, row0, stride, bn, bk, sk;
} heads_args;

static void heads_task(void *ctx, int h0, int h1) {
    const heads_args *a = (const heads_args *)ctx;
    for (int h = h0; h < h1; h++) {
        fp8_args f = {a->x + (size_t)h * a->K, a->w, a->s, NULL, a->y + (size_t)h * a->N, a->T, a->N, a->K,
                      a->row0 + h * a->stride, a->bn, a->bk, a->sk, a->H * a->K, a->H * a->N};
        if (sk_has_avx2()) fp8_rows_avx2(&f, 0, a->N);
        else fp8_rows_c(&f, 0, a->N);
    }
}

EXPORT void sk_fp8_heads(const float *x, const uint8_t *w, const float *s, float *y, int T, int H, int N, int K,
                         int row0, int stride, int bn, int bk, int nparts) {
    init_lut();
    heads_args a = {x, w, s, y, T, H, N, 0, K, row0, stride, bn, bk, (K + bk - 1) / bk};
    if ((long)H * N * K < 32768) nparts = 1;
    sk_parallel(heads_task, &a, H, 1, nparts);
}

/* y[K] += sum over rows d of x[d] * W[r_d, :], ascending d, for one (token, head). */
__attribute__((target("avx2,fma,f16c")))
static void heads_t_one_avx2(const heads_args *a, const float *x, float *y, int r0) {
    const int K = a->K;
    memset(y, 0, sizeof(float) * (size_t)K);
    for (int d = 0; d < a->D; d++) {
        const int r = r0 + d;
        const uint8_t *wr = a->w + (size_t)r * K;
        const float *srow = a->s + (size_t)(r / a->bn) * a->sk;
        for (int j = 0; j < a->sk; j++) {
            const int c0 = j * a->bk, c1 = c0 + a->bk < K ? c0 + a->bk : K;
            const float f = x[d] * (srow[j] * 256.0f);
            const __m256 vf = _mm256_set1_ps(f);
            int c = c0;
            for (; c + 16 <= c1; c += 16) {
                __m256 lo, hi;
                load16(wr + c, &lo, &hi);
                _mm256_storeu_ps(y + c, _mm256_fmadd_ps(lo, vf, _mm256_loadu_ps(y + c)));
                _mm256_storeu_ps(y + c + 8, _mm256_fmadd_ps(hi, vf, _mm256_loadu_ps(y + c + 8)));
            }
            for (; c < c1; c++) y[c] = fmaf(lut[wr[c]], f, y[c]);
        }
    }
}

static void heads_t_one_c(const heads_args *a, const float *x, float *y, int r0) {
    const int K = a->K;
    memset(y, 0, sizeof(float) * (size_t)K);
    for (int d = 0; d < a->D; d++) {
        const int r = r0 + d;
        const uint8_t *wr = a->w + (size_t)r * K;
        const float *srow = a->s + (size_t)(r / a->bn) * a->sk;
        for (int c = 0; c < K; c++) y[c] = fmaf(lut[wr[c]], x[d] * (srow[c / a->bk] * 256.0f), y[c]);
    }
}

static void heads_t_task(void *ctx, int h0, int h1) {
    const heads_args *a = (const heads_args *)ctx;
    for (int h = h0; h < h1; h++)
        for (int t = 0; t < a->T; t++) {
            const float *x = a->x + ((size_t)t * a->H + h) * a->D;
            float *y = a->y + ((size_t)t * a->H + h) * a->K;
            if (sk_has_avx2()) heads_t_one_avx2(a, x, y, a->row0 + h * a->stride);
            else heads_t_one_c(a, x, y, a->row0 + h * a->stride);
        }
}

EXPORT void sk_fp8_heads_t(const float *x, const uint8_t *w, const float *s, float *y, int T, int H, int D, int K,
                           int row0, int stride, int bn, int bk, int nparts) {
    init_lut();
    heads_args a = {x, w, s, y, T, H, 0, D, K, row0, stride, bn, bk, (K + bk - 1) / bk};
    if ((long)H * D * K < 32768) nparts = 1;
    sk_parallel(heads_t_task, &a, H, 1, nparts);
}
