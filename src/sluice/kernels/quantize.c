/* Quantizers used by `sluice convert` (C with GCC/clang vector types, no intrinsics; ISO C, so no
 * FMA contraction and no reordering of floating-point sums; halves converted in integer code).
 *
 * sk_q4_quantize: the q4 format's scale search (see quant/q4.py) for rows [r0, r1) of a
 * row-major f32, bf16 or f16 matrix [rows, k], widened exactly and zero-padded to kp columns.
 * Every sum over a group of 32 is
 * the fixed pairwise tree ((x0+x1)+(x2+x3))+..., which quant/q4.py's torch fallback computes
 * in the same order: the bytes are the same with or without this library, on every host.
 * Callers run disjoint row ranges on several threads (ctypes releases the GIL).
 *
 * The lane kernels (quantize_lanes.h) are compiled three times: 16 lanes for AVX-512F, 8 for
 * AVX2, 8 in portable C; the copy is chosen at run time (sk_quantize_isa forces a lower one,
 * for the tests). IEEE elementwise operations without contraction: the same bytes from each.
 */
#include <stdint.h>
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

static int best_isa(void) {
#ifdef SK_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
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
