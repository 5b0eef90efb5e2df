/* Quantizers used by `sluice convert` (C with GCC/clang vector types, no intrinsics; ISO C, so no
 * FMA contraction and no reordering of floating-point sums; halves converted in integer code).
 *
 * sk_q4_quantize: the q4 format's scale search (see quant/q4.py) for rows [r0, r1) of a
 * row-major fp32 matrix [rows, kp] (kp a multiple of 32). Every sum over a group of 32 is
 * the fixed pairwise tree ((x0+x1)+(x2+x3))+..., which quant/q4.py's torch fallback computes
 * in the same order: the bytes are the same with or without this library, on every host.
 * Callers run disjoint row ranges on several threads (ctypes releases the GIL).
 */
#include <stdint.h>
#include <string.h>

#pragma GCC diagnostic ignored "-Wpsabi"  /* vector helpers are always inlined: no ABI crosses */
#define SK_EXPORT __attribute__((visibility("default")))
#define GROUP 32

/* an AVX2 copy chosen at load time where the toolchain can (GNU ifunc); portable C elsewhere */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define SK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SK_CLONES
#endif

/* Eight groups at a time, one per lane ([element][lane] arrays), so that every step is the same
 * operation across lanes and the compiler vectorizes it; per group the operations and their order
 * are exactly those of quant/q4.py's torch form. */
#define LANES 8

static inline __attribute__((always_inline)) void tree_sum(float t[GROUP][LANES], float *out) {
    for (int n = GROUP / 2; n >= 1; n /= 2)
        for (int i = 0; i < n; i++)
            for (int l = 0; l < LANES; l++) t[i][l] = t[2 * i][l] + t[2 * i + 1][l];
    for (int l = 0; l < LANES; l++) out[l] = t[0][l];
}

/* round(w / d) to nearest even, clamped to [-8, 7]; 0 where d is 0 or the quotient is NaN
 * (the sign of a zero level never matters) */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f select8(v8i m, v8f a, v8f b) { /* m ? a : b per lane */
    return (v8f)(((v8i)a & m) | ((v8i)b & ~m));
}

static inline __attribute__((always_inline)) void levels(float w[GROUP][LANES], const float *d, float q[GROUP][LANES]) {
    v8f dv, one = {1, 1, 1, 1, 1, 1, 1, 1}, zero = {0}, big = one * 12582912.0f;
    memcpy(&dv, d, sizeof dv);
    const v8i dzero = dv == zero;
    const v8f safe = select8(dzero, one, dv);
    for (int i = 0; i < GROUP; i++) {
        v8f x;
        memcpy(&x, w[i], sizeof x);
        x = x / safe;
        x = select8(x < -9.0f * one, -9.0f * one, x);  /* NaN passes, as in torch */
        x = select8(x > 9.0f * one, 9.0f * one, x);
        x = (x + big) - big;                           /* + 1.5 * 2^23 - 1.5 * 2^23: round to even */
        const v8i nan = x != x;
        x = select8(x < -8.0f * one, -8.0f * one, x);
        x = select8(x > 7.0f * one, 7.0f * one, x);
        x = select8(nan | dzero, zero, x);              /* a NaN level is 0; 0 where d is 0 */
        memcpy(q[i], &x, sizeof x);
    }
}

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

/* groups [g0, g0 + nl) of one row (nl <= LANES; unused lanes hold zeros and are not stored) */
static inline __attribute__((always_inline)) void q4_lanes(const float *w, int nl, const float *cands, int ncand,
                                                           uint8_t *blocks, uint16_t *scales) {
    float W[GROUP][LANES], Q[GROUP][LANES], T[GROUP][LANES];
    float m[LANES], d[LANES], qq[LANES], wq[LANES], e[LANES], best_e[LANES] = {0}, best_d[LANES] = {0};
    for (int l = 0; l < LANES; l++)
        for (int i = 0; i < GROUP; i++) W[i][l] = l < nl ? w[l * GROUP + i] : 0.0f;
    for (int l = 0; l < LANES; l++) { /* signed value of largest magnitude (first; a NaN wins, as argmax) */
        int am = 0;
        float best_abs = W[0][l] < 0 ? -W[0][l] : W[0][l];
        for (int i = 1; i < GROUP && best_abs == best_abs; i++) {
            float a = W[i][l] < 0 ? -W[i][l] : W[i][l];
            if (a > best_abs || a != a) {
                best_abs = a;
                am = i;
            }
        }
        m[l] = W[am][l];
    }
    for (int c = 0; c < ncand; c++) {
        for (int l = 0; l < LANES; l++) d[l] = m[l] / cands[c];
        levels(W, d, Q);
        for (int i = 0; i < GROUP; i++)
            for (int l = 0; l < LANES; l++) T[i][l] = Q[i][l] * Q[i][l];
        tree_sum(T, qq);
        for (int i = 0; i < GROUP; i++)
            for (int l = 0; l < LANES; l++) T[i][l] = Q[i][l] * W[i][l];
        tree_sum(T, wq);
        for (int l = 0; l < LANES; l++) d[l] = to_half(qq[l] > 0 ? wq[l] / (qq[l] < 1e-30f ? 1e-30f : qq[l]) : 0.0f);
        levels(W, d, Q);
        for (int i = 0; i < GROUP; i++)
            for (int l = 0; l < LANES; l++) {
                float x = Q[i][l] * d[l] - W[i][l];
                T[i][l] = x * x;
            }
        tree_sum(T, e);
        for (int l = 0; l < LANES; l++)
            if (c == 0 || e[l] < best_e[l]) {
                best_e[l] = e[l];
                best_d[l] = d[l];
            }
    }
    levels(W, best_d, Q);
    for (int l = 0; l < nl; l++) {
        uint8_t *out = blocks + l * (GROUP / 2);
        for (int i = 0; i < GROUP / 2; i++)
            out[i] = (uint8_t)((int)(Q[2 * i][l] + 8.0f) | ((int)(Q[2 * i + 1][l] + 8.0f) << 4));
        scales[l] = half_bits(best_d[l]);
    }
}

SK_EXPORT SK_CLONES void sk_q4_quantize(
    const float *w, int64_t r0, int64_t r1, int64_t kp, const float *cands, int ncand, uint8_t *blocks,
    uint16_t *scales) {
    const int64_t groups = kp / GROUP;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < groups; g += LANES) {
            int nl = groups - g < LANES ? (int)(groups - g) : LANES;
            q4_lanes(w + r * kp + g * GROUP, nl, cands, ncand, blocks + (r * groups + g) * (GROUP / 2),
                     scales + r * groups + g);
        }
}

/* sk_mxfp4_quantize: the mxfp4 format's quantizer (see quant/mxfp4.py) for rows [r0, r1) of a
 * row-major fp32 matrix [rows, kp]: per group of 32 the shared exponent s = floor(log2(amax)) - 2
 * + 127 (0 where amax is 0, NaN or below 2^-125; 124 where it is inf, as torch's frexp gives
 * exponent 0 there), clamped to [0, 254], or s + 1 where that has a strictly smaller squared error
 * (summed as the fixed pairwise tree); E2M1 codes nearest, ties to even, saturating at 6. Eight
 * groups per step, one per lane. Dividing by the scale 2^(s - 127) is a multiplication by the exact
 * power of two 2^(127 - s) (every such power is a float), so the quotients are those of torch. */
static inline __attribute__((always_inline)) float pow2f(int e) { /* 2^e for e in [-149, 127], exact */
    uint32_t u = e >= -126 ? (uint32_t)(e + 127) << 23 : 1u << (e + 149);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

typedef uint32_t v8u __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) void mx_lanes(const float *w, int nl, uint8_t *blocks, uint8_t *scales) {
    float W[GROUP][LANES], T[GROUP][LANES];
    v8i C[2][GROUP];
    float e[2][LANES], scale[LANES], inv[LANES];
    int base[LANES];
    for (int l = 0; l < LANES; l++)
        for (int i = 0; i < GROUP; i++) W[i][l] = l < nl ? w[l * GROUP + i] : 0.0f;
    /* largest |w| as bits: a NaN's bits exceed inf's, so a NaN wins as in torch's amax */
    v8u amax = {0}, absmask = amax + 0x7fffffffu;
    for (int i = 0; i < GROUP; i++) {
        v8u u;
        memcpy(&u, W[i], sizeof u);
        u &= absmask;
        amax = (v8u)select8((v8i)(u > amax), (v8f)u, (v8f)amax);
    }
    for (int l = 0; l < LANES; l++) {
        const int ex = (int)(amax[l] >> 23);
        base[l] = amax[l] > 0x7f800000u ? 0 : ex == 255 ? 124 : ex - 2 < 0 ? 0 : ex - 2;
    }
    const v8f one = {1, 1, 1, 1, 1, 1, 1, 1};
    const v8i ione = {1, 1, 1, 1, 1, 1, 1, 1}, izero = {0};
    for (int extra = 0; extra < 2; extra++) {
        for (int l = 0; l < LANES; l++) {
            const int s = base[l] + extra > 254 ? 254 : base[l] + extra;
            scale[l] = pow2f(s - 127);
            inv[l] = pow2f(127 - s);
        }
        v8f sv, iv;
        memcpy(&sv, scale, sizeof sv);
        memcpy(&iv, inv, sizeof iv);
        for (int i = 0; i < GROUP; i++) {
            v8f x;
            memcpy(&x, W[i], sizeof x);
            const v8f a = x * iv, m = (v8f)((v8i)a & (v8i)absmask);
            /* nearest E2M1 index, ties to even (each comparison is -1 where true); NaN gives 0 */
            const v8i idx = -((m > 0.25f * one) + (m >= 0.75f * one) + (m > 1.25f * one) + (m >= 1.75f * one) +
                              (m > 2.5f * one) + (m >= 3.5f * one) + (m > 5.0f * one));
            /* its magnitude: 0, .5, 1, 1.5, 2, 3, 4, 6 */
            v8f mag = __builtin_convertvector(idx, v8f) * (0.5f * one);
            mag = select8(idx == 5 * ione, 3.0f * one, mag);
            mag = select8(idx == 6 * ione, 4.0f * one, mag);
            mag = select8(idx == 7 * ione, 6.0f * one, mag);
            const v8i neg = (a < 0.0f * one) & (idx > izero);
            C[extra][i] = idx | (neg & (8 * ione));
            const v8f v = select8(neg, -mag, mag), d = v * sv - x;
            const v8f sq = d * d;
            memcpy(T[i], &sq, sizeof sq);
        }
        tree_sum(T, e[extra]);
    }
    for (int l = 0; l < nl; l++) {
        const int better = e[1][l] < e[0][l]; /* strictly: a tie or a NaN keeps the first */
        const int s0 = base[l] > 254 ? 254 : base[l];
        const v8i *src = C[better];
        uint8_t *out = blocks + l * (GROUP / 2);
        for (int i = 0; i < GROUP / 2; i++) out[i] = (uint8_t)(src[2 * i][l] | (src[2 * i + 1][l] << 4));
        scales[l] = (uint8_t)(better ? (s0 + 1 > 254 ? 254 : s0 + 1) : s0);
    }
}

SK_EXPORT SK_CLONES void sk_mxfp4_quantize(const float *w, int64_t r0, int64_t r1, int64_t kp, uint8_t *blocks,
                                           uint8_t *scales) {
    const int64_t groups = kp / GROUP;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < groups; g += LANES) {
            int nl = groups - g < LANES ? (int)(groups - g) : LANES;
            mx_lanes(w + r * kp + g * GROUP, nl, blocks + (r * groups + g) * (GROUP / 2), scales + r * groups + g);
        }
}
