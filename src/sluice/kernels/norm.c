/*
 * Per-layer pointwise work of a decoder layer in one call each: RMSNorm (optionally after the
 * residual add) and rotary embeddings.
 *
 * RMSNorm of a row h of d floats: out_i = w_i * (h_i * r), r = 1 / sqrt(s / d + eps), where s,
 * the sum of squares, has ONE summation order for every row count, thread count and
 * instruction-set level: element i goes to lane i mod 32 (fma, i ascending), the lanes are
 * combined as (l0 + l8) + (l16 + l24) per lane of 8, then ((v0 + v4) + (v1 + v5)) + ((v2 + v6)
 * + (v3 + v7)) (sk_hsum8). The AVX2 path and the portable path compute exactly that (the tail
 * of a row goes through masked loads, whose zeros add nothing), so a row's result is the same
 * decoded alone, in a prefill chunk, or on any host. torch's reduction (x.pow(2).mean(-1))
 * blocks differently on AVX2 and AVX-512 hosts; the products are the same two roundings.
 * With a residual: h = x + res (one rounding, as torch's add) is written out too.
 *
 * Rotary (rotate-half form, the first d dims of each head rotated, the rest copied):
 * out_j = x_j * cos_j + (-x_{j+d/2}) * sin_j and out_{j+d/2} = x_{j+d/2} * cos_{j+d/2} + x_j *
 * sin_{j+d/2}: each product rounded, then the sum, exactly torch's ``x * cos + rotate_half(x) *
 * sin``, so the bits equal the torch expression on every path (products and sums are separate
 * statements: no compiler contracts them into an fma).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "sk.h"

#define NORM_LANES 32

static float sumsq_c(const float *x, const float *res, float *hsum, int d) {
    float acc[NORM_LANES] = {0};
    for (int i = 0; i < d; i++) {
        float h = x[i];
        if (res) {
            h = x[i] + res[i];
            hsum[i] = h;
        }
        acc[i % NORM_LANES] = fmaf(h, h, acc[i % NORM_LANES]);
    }
    float v[8];
    for (int j = 0; j < 8; j++) v[j] = (acc[j] + acc[8 + j]) + (acc[16 + j] + acc[24 + j]);
    return sk_hsum8_c(v);
}

static const int32_t g_mask_src[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

AVX2 static float sumsq_avx2(const float *x, const float *res, float *hsum, int d) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int i = 0;
    for (; i + 8 <= d; i += 8) {
        __m256 h = _mm256_loadu_ps(x + i);
        if (res) {
            h = _mm256_add_ps(h, _mm256_loadu_ps(res + i));
            _mm256_storeu_ps(hsum + i, h);
        }
        int l = (i / 8) & 3;
        acc[l] = _mm256_fmadd_ps(h, h, acc[l]);
    }
    if (i < d) {  /* the tail: lanes past d load zeros, and fma(0, 0, a) == a */
        __m256i m = _mm256_loadu_si256((const __m256i *)(g_mask_src + 8 - (d - i)));
        __m256 h = _mm256_maskload_ps(x + i, m);
        if (res) {
            h = _mm256_add_ps(h, _mm256_maskload_ps(res + i, m));
            _mm256_maskstore_ps(hsum + i, m, h);
        }
        int l = (i / 8) & 3;
        acc[l] = _mm256_fmadd_ps(h, h, acc[l]);
    }
    return sk_hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
}

AVX2 static void scale_avx2(const float *h, const float *w, float r, float *out, int d) {
    const __m256 rv = _mm256_set1_ps(r);
    int i = 0;
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(h + i), rv)));
    for (; i < d; i++) out[i] = w[i] * (h[i] * r);
}

/*
 * rows x d, contiguous. res == NULL: out = rmsnorm(x). Else hsum = x + res and out = rmsnorm(hsum)
 * (hsum may be x or res). out may be x only without a residual.
 */
EXPORT void sk_rmsnorm(const float *x, const float *res, float *hsum, const float *w, float *out, int rows, int d,
                       float eps) {
    const int avx = sk_isa() >= SK_ISA_AVX2;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * d;
        const float *rr = res ? res + (size_t)r * d : NULL;
        float *hr = res ? hsum + (size_t)r * d : NULL;
        float s = avx ? sumsq_avx2(xr, rr, hr, d) : sumsq_c(xr, rr, hr, d);
        float inv = 1.0f / sqrtf(s / (float)d + eps);
        const float *h = res ? hr : xr;
        float *o = out + (size_t)r * d;
        if (avx) {
            scale_avx2(h, w, inv, o, d);
        } else {
            for (int i = 0; i < d; i++) o[i] = w[i] * (h[i] * inv);
        }
    }
}

AVX2 static void rope_half_avx2(const float *x, const float *c, const float *s, float *o, int half) {
    int j = 0;
    for (; j + 8 <= half; j += 8) {
        __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + half + j);
        __m256 nb = _mm256_xor_ps(b, _mm256_set1_ps(-0.0f)); /* -b, as torch's neg */
        __m256 lo = _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + j)), _mm256_mul_ps(nb, _mm256_loadu_ps(s + j)));
        __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + j)),
                                  _mm256_mul_ps(a, _mm256_loadu_ps(s + half + j)));
        _mm256_storeu_ps(o + j, lo);
        _mm256_storeu_ps(o + half + j, hi);
    }
    for (; j < half; j++) {
        float a = x[j], b = x[half + j];
        float p = a * c[j], q = (-b) * s[j];
        float p2 = b * c[half + j], q2 = a * s[half + j];
        o[j] = p + q;
        o[half + j] = p2 + q2;
    }
}

static void rope_half_c(const float *x, const float *c, const float *s, float *o, int half) {
    for (int j = 0; j < half; j++) {
        float a = x[j], b = x[half + j];
        float p = a * c[j], q = (-b) * s[j];
        float p2 = b * c[half + j], q2 = a * s[half + j];
        o[j] = p + q;
        o[half + j] = p2 + q2;
    }
}

/*
 * x, out [t, h, dh] contiguous (out may be x); cos, sin [t, d] contiguous, d <= dh even: the first
 * d dims of every head of token i rotated by row i of cos/sin, dims d..dh-1 copied.
 */
EXPORT void sk_rope(const float *x, const float *cos_t, const float *sin_t, float *out, int t, int h, int dh, int d) {
    const int avx = sk_isa() >= SK_ISA_AVX2;
    const int half = d / 2;
    for (int i = 0; i < t; i++) {
        const float *c = cos_t + (size_t)i * d, *s = sin_t + (size_t)i * d;
        for (int k = 0; k < h; k++) {
            const float *xr = x + ((size_t)i * h + k) * dh;
            float *o = out + ((size_t)i * h + k) * dh;
            if (avx)
                rope_half_avx2(xr, c, s, o, half);
            else
                rope_half_c(xr, c, s, o, half);
            if (dh > d && o != xr) memcpy(o + d, xr + d, (size_t)(dh - d) * sizeof(float));
        }
    }
}
