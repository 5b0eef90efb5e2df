/* Quantizers used by `sluice convert` (C with GCC/clang vector types, no intrinsics; ISO C, so no
 * FMA contraction and no reordering of floating-point sums; halves converted in integer code).
 *
 * sk_q4_quantize: the q4 format's scale search (see quant/q4.py) for rows [r0, r1) of a
 * row-major f32, bf16 or f16 matrix [rows, k], widened exactly and zero-padded to kp columns.
 * Every sum over a group of 32 is the fixed pairwise tree ((x0+x1)+(x2+x3))+..., which
 * quant/q4.py's torch fallback computes in the same order: the bytes are the same with or
 * without this library, on every host. sk_mxfp4_quantize and sk_int8_quantize likewise
 * (quant/mxfp4.py, quant/int8.py). Callers
 * run disjoint row ranges on several threads (ctypes releases the GIL). sk_rvq3_quantize
 * (below) learns one matrix's codebooks on one thread.
 *
 * The lane kernels (quantize_lanes.h) are compiled three times: 16 lanes for AVX-512F, 8 for
 * AVX2, 8 in portable C; the copy is chosen at run time (sk_quantize_isa forces a lower one,
 * for the tests). IEEE elementwise operations without contraction: the same bytes from each.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#pragma GCC diagnostic ignored "-Wpsabi"  /* vector helpers are always inlined: no ABI crosses */
#define SK_EXPORT __attribute__((visibility("default")))
#define GROUP 32

/* fp32 -> IEEE half bits, round to nearest even (subnormals included; NaN stays a NaN); in
 * integer arithmetic, so that no compiler support for a half type is needed */
static inline __attribute__((always_inline)) uint16_t half_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  /* NaN (quiet, payload kept, as torch) */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);                        /* rounds to inf */
    if (a < 0x38800000u) {                                                           /* half subnormal or 0 */
        if (a < 0x33000000u) return (uint16_t)sign;                                  /* below half the smallest */
        const uint32_t m = (a & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(a >> 23);                                      /* 14 .. 24 */
        uint32_t h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a >> 13) - (112u << 10));
    const uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static inline __attribute__((always_inline)) float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t u;
    if (e == 0) {
        float f = (float)m * 5.9604644775390625e-8f;  /* m * 2^-24, exact */
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);
    } else {
        u = sign | ((e + 112u) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __attribute__((always_inline)) float to_half(float x) {
    x = x < -65504.0f ? -65504.0f : (x > 65504.0f ? 65504.0f : x);
    return half_to_float(half_bits(x));
}

/* sk_mxfp4_quantize: the mxfp4 format's quantizer (see quant/mxfp4.py) for rows [r0, r1) of a
 * row-major matrix (as sk_q4_quantize's): per group of 32 the shared exponent s = floor(log2(amax)) - 2
 * + 127 (0 where amax is 0, NaN or below 2^-125; 124 where it is inf, as torch's frexp gives
 * exponent 0 there), clamped to [0, 254], or s + 1 where that has a strictly smaller squared error
 * (summed as the fixed pairwise tree); E2M1 codes nearest, ties to even, saturating at 6. LANES
 * groups per step, one per lane. Dividing by the scale 2^(s - 127) is a multiplication by the exact
 * power of two 2^(127 - s) (every such power is a float), so the quotients are those of torch. */
static inline __attribute__((always_inline)) float pow2f(int e) { /* 2^e for e in [-149, 127], exact */
    uint32_t u = e >= -126 ? (uint32_t)(e + 127) << 23 : 1u << (e + 149);
    float f;
    memcpy(&f, &u, 4);
    return f;
}


#define LANES 8
#define SUFFIX c
#include "quantize_lanes.h"
#undef SUFFIX
#undef LANES

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SK_X86 1
#pragma GCC push_options
#pragma GCC target("avx2")
#define LANES 8
#define SUFFIX avx2
#include "quantize_lanes.h"
#undef SUFFIX
#undef LANES
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f")
#define LANES 16
#define SUFFIX avx512
#include "quantize_lanes.h"
#undef SUFFIX
#undef LANES
#pragma GCC pop_options
#endif

/* 0 portable, 1 AVX2, 2 AVX-512F: the best the CPU has, unless lowered by sk_quantize_isa */
static int isa_level = -1;

static int best_isa(void) { /* SLUICE_KERNELS_NO_AVX512=1 keeps AVX2, as for the other kernels (same bytes) */
#ifdef SK_X86
    __builtin_cpu_init();
    const char *off = getenv("SLUICE_KERNELS_NO_AVX512");
    if (__builtin_cpu_supports("avx512f") && !(off && off[0] == '1')) return 2;
    if (__builtin_cpu_supports("avx2")) return 1;
#endif
    return 0;
}

/* The copy in use; ``want`` >= 0 chooses min(want, best) (not thread-safe: call before quantizing). */
SK_EXPORT int sk_quantize_isa(int want) {
    const int best = best_isa();
    if (want >= 0) isa_level = want < best ? want : best;
    else if (isa_level < 0) isa_level = best;
    return isa_level;
}

/* ``w``: rows of k elements of dtype 0 (f32), 1 (bf16) or 2 (f16), widened exactly to fp32 and
 * padded with zeros to kp columns (a multiple of 32) */
SK_EXPORT void sk_q4_quantize(const void *w, int dtype, int64_t r0, int64_t r1, int64_t k, int64_t kp,
                              const float *cands, int ncand, uint8_t *blocks, uint16_t *scales) {
    switch (sk_quantize_isa(-1)) {
#ifdef SK_X86
    case 2: q4_rows_avx512(w, dtype, r0, r1, k, kp, cands, ncand, blocks, scales); return;
    case 1: q4_rows_avx2(w, dtype, r0, r1, k, kp, cands, ncand, blocks, scales); return;
#endif
    default: q4_rows_c(w, dtype, r0, r1, k, kp, cands, ncand, blocks, scales);
    }
}

SK_EXPORT void sk_mxfp4_quantize(const void *w, int dtype, int64_t r0, int64_t r1, int64_t k, int64_t kp,
                                 uint8_t *blocks, uint8_t *scales) {
    switch (sk_quantize_isa(-1)) {
#ifdef SK_X86
    case 2: mx_rows_avx512(w, dtype, r0, r1, k, kp, blocks, scales); return;
    case 1: mx_rows_avx2(w, dtype, r0, r1, k, kp, blocks, scales); return;
#endif
    default: mx_rows_c(w, dtype, r0, r1, k, kp, blocks, scales);
    }
}

/* sk_int8_quantize: the int8 format's clipping search (see quant/int8.py and int8_rows in
 * quantize_lanes.h) for rows [r0, r1) of a row-major matrix (as sk_q4_quantize's): ``out`` int8
 * [rows, kp] (the padding columns 0), ``scales`` f32 [rows] (as bits). Returns 0, or -1 when
 * memory runs out. */
SK_EXPORT int sk_int8_quantize(const void *w, int dtype, int64_t r0, int64_t r1, int64_t k, int64_t kp,
                               const float *ratios, int nratio, int8_t *out, float *scales) {
    float *buf = malloc((size_t)(kp > 0 ? kp : 1) * sizeof(float));
    if (!buf) return -1;
    uint32_t *sc = (uint32_t *)scales;
    switch (sk_quantize_isa(-1)) {
#ifdef SK_X86
    case 2: int8_rows_avx512(w, dtype, r0, r1, k, kp, ratios, nratio, buf, out, sc); break;
    case 1: int8_rows_avx2(w, dtype, r0, r1, k, kp, ratios, nratio, buf, out, sc); break;
#endif
    default: int8_rows_c(w, dtype, r0, r1, k, kp, ratios, nratio, buf, out, sc);
    }
    free(buf);
    return 0;
}

/* ---------------------------------------------------------------------------------- rvq3 -----
 * sk_rvq3_quantize: quant/rvq3.py's codebooks and codes of n 8-dim subvectors (one matrix), in C.
 * Per stage: a sample of at most ``sample`` residual subvectors (selection sampling, in order),
 * k-means on it (k-means++ seeding, ``seed_batch`` seeds drawn per round without replacement;
 * Lloyd iterations until the assignment repeats or ``iters``; an empty cluster is re-seeded at the
 * worst-served point), centroids rounded to f16, then every subvector assigned to the nearest
 * f16 centroid and the residual updated. One thread, fixed orders and a splitmix64 stream from
 * ``seed``: the same bytes for the same input on every host and instruction set. Returns 0, or
 * -1 when memory runs out. */

typedef void (*nearest_fn)(const float *, int64_t, const float *, const float *, int32_t *, float *);

static nearest_fn pick_nearest(void) {
    switch (sk_quantize_isa(-1)) {
#ifdef SK_X86
    case 2: return rvq_nearest_avx512;
    case 1: return rvq_nearest_avx2;
#endif
    default: return rvq_nearest_c;
    }
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double uniform(uint64_t *s) { return (double)(splitmix(s) >> 11) * (1.0 / 9007199254740992.0); }

static void prepare(const float *c, float *ct, float *cn) { /* [256][8] -> [8][256] and squared norms */
    for (int j = 0; j < 256; j++) {
        float n = 0.0f;
        for (int d = 0; d < 8; d++) {
            ct[d * 256 + j] = c[j * 8 + d];
            n += c[j * 8 + d] * c[j * 8 + d];
        }
        cn[j] = n;
    }
}

/* 256 centroids of the m points p into c; scratch: idx, prev (int32 [m]), dist (float [m]) */
static int kmeans256(const float *p, int64_t m, int iters, int seed_batch, uint64_t *rng, float *c, int32_t *idx,
                      int32_t *prev, float *dist, nearest_fn nearest) {
    memset(c, 0, 256 * 8 * sizeof(float));
    if (m <= 256) {
        memcpy(c, p, (size_t)m * 8 * sizeof(float));
        return 0;
    }
    /* k-means++ seeding: dist holds each point's squared distance to the nearest chosen centroid;
     * the points transposed (pt [8][m]) so that the distance updates run across points */
    float *pt = malloc((size_t)m * 8 * sizeof(float));
    double *prefix = malloc((size_t)m * sizeof(double));
    if (!pt || !prefix) {
        free(pt);
        free(prefix);
        return -1;
    }
    for (int64_t i = 0; i < m; i++)
        for (int d = 0; d < 8; d++) pt[d * m + i] = p[i * 8 + d];
    const int64_t first = (int64_t)(splitmix(rng) % (uint64_t)m);
    memcpy(c, p + first * 8, 8 * sizeof(float));
    for (int64_t i = 0; i < m; i++) dist[i] = 3.4028235e38f;
    int k = 0, fresh = 1; /* centroids [k, k + fresh) are not yet in dist */
    while (1) {
        for (int g = k; g < k + fresh; g++) {
            const float *cg = c + g * 8;
            for (int64_t i = 0; i < m; i++) {
                float s = 0.0f;
                for (int d = 0; d < 8; d++) {
                    const float x = pt[d * m + i] - cg[d];
                    s += x * x;
                }
                dist[i] = s < dist[i] ? s : dist[i];
            }
        }
        k += fresh;
        if (k >= 256) break;
        double total = 0.0;
        for (int64_t i = 0; i < m; i++) prefix[i] = total += dist[i];
        if (!(total > 0.0)) { /* every point is a centroid already */
            for (int j = k; j < 256; j++) memcpy(c + j * 8, c, 8 * sizeof(float));
            break;
        }
        const int b = seed_batch < 256 - k ? seed_batch : 256 - k;
        int got = 0;
        for (int tries = 0; got < b && tries < 4 * b; tries++) { /* proportional to dist, no repeats */
            const double u = uniform(rng) * total;
            int64_t lo = 0, hi = m - 1; /* the first i with prefix[i] > u: dist[i] > 0 there */
            while (lo < hi) {
                const int64_t mid = lo + (hi - lo) / 2;
                if (prefix[mid] > u) hi = mid;
                else lo = mid + 1;
            }
            int dup = dist[lo] <= 0.0f;
            for (int g = 0; g < got && !dup; g++) dup = memcmp(c + (k + g) * 8, p + lo * 8, 8 * sizeof(float)) == 0;
            if (dup) continue;
            memcpy(c + (k + got) * 8, p + lo * 8, 8 * sizeof(float));
            got++;
        }
        if (got == 0) { /* only repeats drawn: fill with the first centroid */
            for (int j = k; j < 256; j++) memcpy(c + j * 8, c, 8 * sizeof(float));
            break;
        }
        fresh = got;
    }
    free(pt);
    free(prefix);
    float ct[8 * 256], cn[256];
    double sums[256 * 8];
    int64_t counts[256];
    for (int it = 0; it < iters; it++) {
        prepare(c, ct, cn);
        nearest(p, m, ct, cn, idx, dist);
        if (it > 0 && memcmp(idx, prev, (size_t)m * sizeof(int32_t)) == 0) break;
        memcpy(prev, idx, (size_t)m * sizeof(int32_t));
        memset(sums, 0, sizeof sums);
        memset(counts, 0, sizeof counts);
        for (int64_t i = 0; i < m; i++) {
            counts[idx[i]]++;
            for (int d = 0; d < 8; d++) sums[idx[i] * 8 + d] += p[i * 8 + d];
        }
        for (int j = 0; j < 256; j++) {
            if (counts[j] > 0) {
                for (int d = 0; d < 8; d++) c[j * 8 + d] = (float)(sums[j * 8 + d] / (double)counts[j]);
            } else { /* re-seed at the worst-served point not yet taken (its distance then cleared) */
                int64_t w = 0;
                for (int64_t i = 1; i < m; i++)
                    if (dist[i] > dist[w]) w = i;
                memcpy(c + j * 8, p + w * 8, 8 * sizeof(float));
                dist[w] = -1.0f;
            }
        }
    }
    return 0;
}

SK_EXPORT int sk_rvq3_quantize(const float *v, int64_t n, int64_t sample, int iters, int seed_batch, uint64_t seed,
                               uint8_t *codes, uint16_t *books) {
    const nearest_fn nearest = pick_nearest();
    const int64_t m_max = n < sample ? n : sample;
    float *r = malloc((size_t)n * 8 * sizeof(float)), *pts = malloc((size_t)m_max * 8 * sizeof(float));
    float *dist = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    int32_t *idx = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t)), *prev = malloc((size_t)(m_max > 0 ? m_max : 1) * sizeof(int32_t));
    int rc = -1;
    if (!r || !pts || !dist || !idx || !prev) goto done;
    memcpy(r, v, (size_t)n * 8 * sizeof(float));
    uint64_t rng = seed;
    for (int s = 0; s < 3; s++) {
        const float *p = r;
        int64_t m = n;
        if (n > sample) { /* selection sampling: each subset of ``sample`` equally likely, kept in order */
            m = 0;
            for (int64_t i = 0; i < n && m < sample; i++)
                if (uniform(&rng) * (double)(n - i) < (double)(sample - m)) memcpy(pts + 8 * m++, r + i * 8, 8 * sizeof(float));
            p = pts;
        }
        float c[256 * 8], ct[8 * 256], cn[256];
        if (kmeans256(p, m, iters, seed_batch, &rng, c, idx, prev, dist, nearest) != 0) goto done;
        for (int j = 0; j < 256 * 8; j++) {
            books[s * 256 * 8 + j] = half_bits(c[j] < -65504.0f ? -65504.0f : c[j] > 65504.0f ? 65504.0f : c[j]);
            c[j] = half_to_float(books[s * 256 * 8 + j]);
        }
        prepare(c, ct, cn);
        nearest(r, n, ct, cn, idx, NULL);
        for (int64_t i = 0; i < n; i++) {
            codes[i * 3 + s] = (uint8_t)idx[i];
            for (int d = 0; d < 8; d++) r[i * 8 + d] -= c[idx[i] * 8 + d];
        }
    }
    rc = 0;
done:
    free(r);
    free(pts);
    free(dist);
    free(idx);
    free(prev);
    return rc;
}
