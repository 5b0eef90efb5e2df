/*
 * Batch-invariant causal attention: one (query token, head) pair at a time.
 *
 * For query t (position q_start + t) and head h (key/value head h / R), over the keys it may
 * see (causal, optionally a sliding window):
 *   s_j = scale * dot(q, k_j)              one fixed summation order over D
 *   m = max(s_j, sink); p_j = exp(s_j - m)  ascending j (0 below 2^-126: softmax_weight)
 *   o = (sum_j p_j v_j) / (sum_j p_j + exp(sink - m))   ascending j, fma per Dv lane
 * Grouped queries (Hq > Hkv) run a key/value head's query heads together, each with the
 * arithmetic above (attend_group_task).
 * Nothing depends on how many queries share the call, how they are split across threads, or
 * where the key block starts, so a token's output is the same whether it is decoded alone,
 * prefilled in a chunk of 7 or of 512 (torch's batched matmul and softmax change their
 * blocking with the shape and do not promise that).
 *
 * Strides are in floats; the last dimension of q, k, v and out is contiguous.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#include "sk.h"

typedef struct {
    const float *q, *k, *v, *sinks;
    float *out;
    int T, Hq, R, D, Dv, q_start, window;
    long qs_t, qs_h, ks_h, ks_l, vs_h, vs_l, os_t, os_h;
    float scale;
} attend_args;

/*
 * A softmax weight exp(x), x = score - max <= 0, with weights below the smallest normal float
 * (2^-126, x < -87.34) taken as 0 on every path. Real attention is peaked: at 519 positions of the
 * synthetic Mixtral 12% of a decode step's weights were subnormal and 67% zero, and each
 * subnormal costs a microcode assist in expf's underflow path and in every fma of the weighted
 * sum that it enters (the call took 215 us against 46 us on random keys). A weight that small
 * is below 2^-126 of the largest (which is 1): dropping it moves no output a measurable amount.
 */
#define WEIGHT_MIN_X (-87.5f) /* below ln(2^-126) = -87.3365: expf is subnormal or 0 there */

static inline float softmax_weight(float x) {
    if (x < WEIGHT_MIN_X) return 0.0f;
    const float p = expf(x);
    return p < 0x1p-126f ? 0.0f : p;
}

static float dot_c(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

AVX2 static float dot_avx2(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = sk_hsum8(acc);
    for (; i < n; i++) s = fmaf(a[i], b[i], s);
    return s;
}

/* Four keys' dot products at once: each is dot_avx2's exact sequence (its own 8-lane fma chain
 * over D ascending, sk_hsum8, then the scalar tail), four independent chains in flight instead of
 * one (a single chain is bound by the fma latency). */
AVX2 static void dot4_avx2(const float *a, const float *b0, const float *b1, const float *b2, const float *b3,
                           int n, float *r) {
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps(), c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 av = _mm256_loadu_ps(a + i);
        c0 = _mm256_fmadd_ps(av, _mm256_loadu_ps(b0 + i), c0);
        c1 = _mm256_fmadd_ps(av, _mm256_loadu_ps(b1 + i), c1);
        c2 = _mm256_fmadd_ps(av, _mm256_loadu_ps(b2 + i), c2);
        c3 = _mm256_fmadd_ps(av, _mm256_loadu_ps(b3 + i), c3);
    }
    float s0 = sk_hsum8(c0), s1 = sk_hsum8(c1), s2 = sk_hsum8(c2), s3 = sk_hsum8(c3);
    for (; i < n; i++) {
        s0 = fmaf(a[i], b0[i], s0);
        s1 = fmaf(a[i], b1[i], s1);
        s2 = fmaf(a[i], b2[i], s2);
        s3 = fmaf(a[i], b3[i], s3);
    }
    r[0] = s0, r[1] = s1, r[2] = s2, r[3] = s3;
}

AVX2 static void axpy_avx2(float p, const float *v, float *o, int n) {
    const __m256 pv = _mm256_set1_ps(p);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
    for (; i < n; i++) o[i] = fmaf(p, v[i], o[i]);
}

/* o[e] = fma(p_j, v_j[e], o[e]) for j = j0..j1-1 ascending: exactly axpy_avx2 once per key (its
 * vector lanes and its scalar tail), with each 64-lane block of o held in registers across the
 * keys instead of loaded and stored per key. o starts as it is (zeros). */
AVX2 static void weighted_sum_avx2(const float *p, const float *v, long vs, int j0, int j1, float *o, int n) {
    int e = 0;
    for (; e + 64 <= n; e += 64) {
        __m256 c[8];
        for (int u = 0; u < 8; u++) c[u] = _mm256_loadu_ps(o + e + 8 * u);
        for (int j = j0; j < j1; j++) {
            const __m256 pv = _mm256_set1_ps(p[j]);
            const float *vj = v + (long)j * vs + e;
            for (int u = 0; u < 8; u++) c[u] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 8 * u), c[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(o + e + 8 * u, c[u]);
    }
    for (; e + 8 <= n; e += 8) {
        __m256 c = _mm256_loadu_ps(o + e);
        for (int j = j0; j < j1; j++) c = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + (long)j * vs + e), c);
        _mm256_storeu_ps(o + e, c);
    }
    for (; e < n; e++) {
        float c = o[e];
        for (int j = j0; j < j1; j++) c = fmaf(p[j], v[(long)j * vs + e], c);
        o[e] = c;
    }
}

static void axpy_c(float p, const float *v, float *o, int n) {
    for (int i = 0; i < n; i++) o[i] = fmaf(p, v[i], o[i]);
}

static void attend_task(void *ctx, int i0, int i1) {
    const attend_args *a = (const attend_args *)ctx;
    const int avx = sk_avx2();
    const int max_keys = a->q_start + a->T;
    float *s = (float *)sk_scratch(4, sizeof(float) * (size_t)(max_keys > 0 ? max_keys : 1));
    for (int i = i0; i < i1; i++) {
        const int t = i / a->Hq, h = i % a->Hq, g = h / a->R;
        const int pos = a->q_start + t;
        int lo = 0;
        if (a->window > 0 && pos - a->window + 1 > 0) lo = pos - a->window + 1;
        const float *q = a->q + t * a->qs_t + h * a->qs_h;
        const float *kh = a->k + g * a->ks_h, *vh = a->v + g * a->vs_h;
        float *o = a->out + t * a->os_t + h * a->os_h;
        float m = -INFINITY;
        int j0 = lo;
        if (avx) {  /* keys four at a time, each dot as dot_avx2 computes it */
            const long ks = a->ks_l;
            for (; j0 + 4 <= pos + 1; j0 += 4) {
                const float *kj = kh + (long)j0 * ks;
                float d[4];
                dot4_avx2(q, kj, kj + ks, kj + 2 * ks, kj + 3 * ks, a->D, d);
                for (int u = 0; u < 4; u++) {
                    s[j0 + u] = d[u] * a->scale;
                    if (s[j0 + u] > m) m = s[j0 + u];
                }
            }
        }
        for (int j = j0; j <= pos; j++) {
            const float *kj = kh + (long)j * a->ks_l;
            float d = avx ? dot_avx2(q, kj, a->D) : dot_c(q, kj, a->D);
            s[j] = d * a->scale;
            if (s[j] > m) m = s[j];
        }
        float sink = a->sinks ? a->sinks[h] : -INFINITY;
        if (a->sinks && sink > m) m = sink;
        memset(o, 0, sizeof(float) * (size_t)a->Dv);
        float sum = 0.0f;
        if (avx) {  /* the weights first, then o accumulated in registers (axpy_avx2's per-lane fmas) */
            for (int j = lo; j <= pos; j++) {
                s[j] = softmax_weight(s[j] - m);
                sum += s[j];
            }
            weighted_sum_avx2(s, vh, a->vs_l, lo, pos + 1, o, a->Dv);
        } else {
            for (int j = lo; j <= pos; j++) {
                const float p = softmax_weight(s[j] - m);
                sum += p;
                axpy_c(p, vh + (long)j * a->vs_l, o, a->Dv);
            }
        }
        if (a->sinks) sum += softmax_weight(sink - m);
        const float inv = 1.0f / sum;
        for (int e = 0; e < a->Dv; e++) o[e] *= inv;
    }
}

/*
 * The AVX2 path for grouped queries (R = Hq / Hkv > 1): one task per (query token, key/value
 * head) runs that group's R heads together, so each block of keys and values is read from
 * memory once and reused from L1 by every head of the group (one task per head read the
 * group's cache R times: 0.33-0.46 of a plain read at 2 threads). Each head's arithmetic is
 * attend_task's: every score is dot4_avx2's or dot_avx2's chain for that key, the max and the
 * ascending exp sum per head, and the weighted sum is weighted_sum_avx2 over consecutive key
 * blocks (o kept in memory between blocks: the same fma per lane, in the same order).
 */
#define GROUP_MAX 16
#define VBLOCK 64 /* keys per block of the weighted sum: 64 x Dv floats of values stay in L1 */
#define KAHEAD 16 /* keys prefetched ahead of the score loop */

AVX2 static void attend_group_task(void *ctx, int i0, int i1) {
    const attend_args *a = (const attend_args *)ctx;
    const int Hkv = a->Hq / a->R, R = a->R;
    const int max_keys = a->q_start + a->T;
    const size_t stride = (size_t)(max_keys > 0 ? max_keys : 1);
    float *s = (float *)sk_scratch(4, sizeof(float) * stride * (size_t)R);
    for (int i = i0; i < i1; i++) {
        const int t = i / Hkv, g = i % Hkv, h0 = g * R;
        const int pos = a->q_start + t;
        int lo = 0;
        if (a->window > 0 && pos - a->window + 1 > 0) lo = pos - a->window + 1;
        const float *kh = a->k + g * a->ks_h, *vh = a->v + g * a->vs_h;
        const long ks = a->ks_l;
        float m[GROUP_MAX];
        const float *q[GROUP_MAX];
        for (int r = 0; r < R; r++) {
            m[r] = -INFINITY;
            q[r] = a->q + t * a->qs_t + (h0 + r) * a->qs_h;
        }
        int j0 = lo;
        const int klines = (int)(((size_t)a->D * 4 + 63) / 64), vlines = (int)(((size_t)a->Dv * 4 + 63) / 64);
        for (; j0 + 4 <= pos + 1; j0 += 4) {
            const float *kj = kh + (long)j0 * ks;
            for (int u = 0; u < 4; u++)
                if (j0 + KAHEAD + u <= pos)
                    for (int l = 0; l < klines; l++)
                        _mm_prefetch((const char *)(kj + (long)(KAHEAD + u) * ks) + 64 * l, _MM_HINT_T0);
            for (int r = 0; r < R; r++) {
                float d[4], *sr = s + (size_t)r * stride;
                dot4_avx2(q[r], kj, kj + ks, kj + 2 * ks, kj + 3 * ks, a->D, d);
                for (int u = 0; u < 4; u++) {
                    sr[j0 + u] = d[u] * a->scale;
                    if (sr[j0 + u] > m[r]) m[r] = sr[j0 + u];
                }
            }
        }
        for (int j = j0; j <= pos; j++) {
            const float *kj = kh + (long)j * ks;
            for (int r = 0; r < R; r++) {
                float *sr = s + (size_t)r * stride;
                sr[j] = dot_avx2(q[r], kj, a->D) * a->scale;
                if (sr[j] > m[r]) m[r] = sr[j];
            }
        }
        float sum[GROUP_MAX];
        for (int r = 0; r < R; r++) {
            const int h = h0 + r;
            if (a->sinks && a->sinks[h] > m[r]) m[r] = a->sinks[h];
            sum[r] = 0.0f;
            memset(a->out + t * a->os_t + h * a->os_h, 0, sizeof(float) * (size_t)a->Dv);
        }
        /* block by block: the block's weights (exp, summed in ascending order per head), then its
         * values, so the exps run while the values stream in */
        for (int jb = lo; jb <= pos; jb += VBLOCK) {
            const int je = jb + VBLOCK <= pos + 1 ? jb + VBLOCK : pos + 1;
            for (int r = 0; r < R; r++) {
                float *sr = s + (size_t)r * stride, acc = sum[r];
                for (int j = jb; j < je; j++) {
                    sr[j] = softmax_weight(sr[j] - m[r]);
                    acc += sr[j];
                }
                sum[r] = acc;
            }
            for (int j = je; j < je + VBLOCK && j <= pos; j++) /* the next block's values, into L2 */
                for (int l = 0; l < vlines; l++) _mm_prefetch((const char *)(vh + (long)j * a->vs_l) + 64 * l, _MM_HINT_T1);
            for (int r = 0; r < R; r++)
                weighted_sum_avx2(s + (size_t)r * stride, vh, a->vs_l, jb, je, a->out + t * a->os_t + (h0 + r) * a->os_h,
                                  a->Dv);
        }
        for (int r = 0; r < R; r++) {
            if (a->sinks) sum[r] += softmax_weight(a->sinks[h0 + r] - m[r]);
            float *o = a->out + t * a->os_t + (h0 + r) * a->os_h;
            const float inv = 1.0f / sum[r];
            for (int e = 0; e < a->Dv; e++) o[e] *= inv;
        }
    }
}

EXPORT void sk_attend(const float *q, const float *k, const float *v, const float *sinks, float *out, int T, int Hq,
                      int Hkv, int D, int Dv, int q_start, int window, float scale, const long *strides,
                      int nthreads) {
    attend_args a = {q, k, v, sinks, out, T, Hq, Hq / Hkv, D, Dv, q_start, window,
                     strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6], strides[7],
                     scale};
    long work = (long)T * Hq * (q_start + T) * (D + Dv);
    if (work < 65536) nthreads = 1;
    if (sk_avx2() && a.R > 1 && a.R <= GROUP_MAX) sk_parallel(attend_group_task, &a, T * Hkv, 1, nthreads);
    else sk_parallel(attend_task, &a, T * Hq, 1, nthreads);
}

/* ------------------------------------------------ gated delta rule, recurrent ---- */

/*
 * For each head h (in parallel) and token t in order, with the state S [Dk, Dv] (row i = key
 * channel i) kept in cache across the tokens:
 *   S[i, :] *= a[t, h, i]                      (a: one decay per head, or one per key channel)
 *   u = beta[t, h] * (v[t, h] - sum_i k_i S[i, :])    ascending i
 *   S[i, :] += k_i u
 *   o[t, h] = sum_i q_i S[i, :]                ascending i
 * Every token goes through the same arithmetic whatever T is, so prefill chunks of any size
 * give the bits of token-by-token decoding. q, k [T, H, Dk], v [T, H, Dv], a [T, H, Dk] or
 * [T, H] (per_channel 0), beta [T, H], S [H, Dk, Dv] (updated in place), o [T, H, Dv];
 * all fp32 and contiguous. scratch: 2 * Dv floats per thread.
 */
typedef struct {
    const float *q, *k, *v, *a, *beta;
    float *S, *o;
    int T, H, Dk, Dv, per_channel;
} delta_args;

static void delta_task(void *ctx, int h0, int h1) {
    const delta_args *d = (const delta_args *)ctx;
    const int Dk = d->Dk, Dv = d->Dv, H = d->H;
    const int avx = sk_avx2();
    float *kv = (float *)sk_scratch(4, sizeof(float) * 2 * (size_t)Dv);
    float *u = kv + Dv;
    for (int h = h0; h < h1; h++) {
        float *S = d->S + (size_t)h * Dk * Dv;
        for (int t = 0; t < d->T; t++) {
            const size_t th = (size_t)t * H + h;
            const float *q = d->q + th * Dk, *k = d->k + th * Dk, *v = d->v + th * Dv;
            const float *a = d->per_channel ? d->a + th * Dk : d->a + th;
            memset(kv, 0, sizeof(float) * (size_t)Dv);
            for (int i = 0; i < Dk; i++) {
                float *row = S + (size_t)i * Dv;
                const float ai = d->per_channel ? a[i] : a[0];
                for (int j = 0; j < Dv; j++) row[j] *= ai;
                if (avx) axpy_avx2(k[i], row, kv, Dv);
                else axpy_c(k[i], row, kv, Dv);
            }
            const float b = d->beta[th];
            for (int j = 0; j < Dv; j++) u[j] = (v[j] - kv[j]) * b;
            float *o = d->o + th * Dv;
            memset(o, 0, sizeof(float) * (size_t)Dv);
            for (int i = 0; i < Dk; i++) {
                float *row = S + (size_t)i * Dv;
                if (avx) {
                    axpy_avx2(k[i], u, row, Dv);
                    axpy_avx2(q[i], row, o, Dv);
                } else {
                    axpy_c(k[i], u, row, Dv);
                    axpy_c(q[i], row, o, Dv);
                }
            }
        }
    }
}

EXPORT void sk_delta_rule(const float *q, const float *k, const float *v, const float *a, const float *beta, float *S,
                          float *o, int T, int H, int Dk, int Dv, int per_channel, int nthreads) {
    delta_args d = {q, k, v, a, beta, S, o, T, H, Dk, Dv, per_channel};
    if ((long)T * H * Dk * Dv < 65536) nthreads = 1;
    sk_parallel(delta_task, &d, H, 1, nthreads);
}
