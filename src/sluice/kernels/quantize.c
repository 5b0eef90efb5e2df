/* Quantizers used by `sluice convert` (plain C, no SIMD intrinsics; ISO C, so no FMA
 * contraction and no reordering of floating-point sums).
 *
 * sk_q4_quantize: the q4 format's scale search (see quant/q4.py) for rows [r0, r1) of a
 * row-major fp32 matrix [rows, kp] (kp a multiple of 32). Every sum over a group of 32 is
 * the fixed pairwise tree ((x0+x1)+(x2+x3))+..., which quant/q4.py's torch fallback computes
 * in the same order: the bytes are the same with or without this library, on every host.
 * Callers run disjoint row ranges on several threads (ctypes releases the GIL).
 */
#include <stdint.h>
#include <string.h>

#define SK_EXPORT __attribute__((visibility("default")))
#define GROUP 32

static inline __attribute__((always_inline)) float tree32(float *x) {
    for (int n = GROUP / 2; n >= 1; n /= 2)
        for (int i = 0; i < n; i++) x[i] = x[2 * i] + x[2 * i + 1];
    return x[0];
}

/* round(w / d) to nearest even, clamped to [-8, 7]; 0 where d is 0 or the quotient is NaN
 * (the sign of a zero level never matters) */
static inline __attribute__((always_inline)) void levels(const float *w, float d, float *q) {
    if (d == 0) {
        memset(q, 0, GROUP * sizeof(float));
        return;
    }
    for (int i = 0; i < GROUP; i++) {
        float x = w[i] / d;
        x = x < -9.0f ? -9.0f : (x > 9.0f ? 9.0f : x);   /* NaN passes, as in torch */
        x = (x + 12582912.0f) - 12582912.0f;            /* + 1.5 * 2^23 - 1.5 * 2^23: round to even */
        q[i] = x != x ? 0.0f : (x < -8.0f ? -8.0f : (x > 7.0f ? 7.0f : x));  /* a NaN level is 0 */
    }
}

static inline __attribute__((always_inline)) float to_half(float x) {
    x = x < -65504.0f ? -65504.0f : (x > 65504.0f ? 65504.0f : x);
    return (float)(_Float16)x;
}

static uint16_t half_bits(float x) {
    _Float16 h = (_Float16)x;
    uint16_t b;
    memcpy(&b, &h, 2);
    return b;
}

SK_EXPORT __attribute__((target_clones("avx2", "default"))) void sk_q4_quantize(const float *w, int64_t r0, int64_t r1, int64_t kp, const float *cands, int ncand,
                              uint8_t *blocks, uint16_t *scales) {
    const int64_t groups = kp / GROUP;
    float q[GROUP], t[GROUP];
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *wg = w + r * kp + g * GROUP;
            /* signed value of largest magnitude (first one; a NaN wins, as torch's argmax) */
            int am = 0;
            float best_abs = wg[0] < 0 ? -wg[0] : wg[0];
            for (int i = 1; i < GROUP && best_abs == best_abs; i++) {
                float a = wg[i] < 0 ? -wg[i] : wg[i];
                if (a > best_abs || a != a) {
                    best_abs = a;
                    am = i;
                }
            }
            const float m = wg[am];
            float best_e = 0, best_d = 0;
            for (int c = 0; c < ncand; c++) {
                levels(wg, m / cands[c], q);
                for (int i = 0; i < GROUP; i++) t[i] = q[i] * q[i];
                float qq = tree32(t);
                for (int i = 0; i < GROUP; i++) t[i] = q[i] * wg[i];
                float wq = tree32(t);
                float d = qq > 0 ? wq / (qq < 1e-30f ? 1e-30f : qq) : 0.0f;
                d = to_half(d);
                levels(wg, d, q);
                for (int i = 0; i < GROUP; i++) {
                    float x = q[i] * d - wg[i];
                    t[i] = x * x;
                }
                float e = tree32(t);
                if (c == 0 || e < best_e) {
                    best_e = e;
                    best_d = d;
                }
            }
            levels(wg, best_d, q);
            uint8_t *out = blocks + (r * groups + g) * (GROUP / 2);
            for (int i = 0; i < GROUP / 2; i++)
                out[i] = (uint8_t)((int)(q[2 * i] + 8.0f) | ((int)(q[2 * i + 1] + 8.0f) << 4));
            scales[r * groups + g] = half_bits(best_d);
        }
    }
}
