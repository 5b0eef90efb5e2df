/*
 * Shared by the quantized-format kernel files (quant.c: AVX2 and portable paths, dispatch and
 * entry points; quant512.c: AVX-512 paths): the job description, format tables and the AVX2
 * building blocks the AVX-512 kernels reuse, so that both compile the shared steps alike.
 * Nothing here is exported.
 */
#ifndef SLUICE_QUANT_H
#define SLUICE_QUANT_H
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>

#include "sk.h"

#define INLINE static inline __attribute__((always_inline))

enum { FMT_INT8 = 3, FMT_Q4 = 4, FMT_MXFP4 = 5, FMT_RVQ3 = 6 };
enum { ACT_F32 = 0, ACT_Q8 = 1 };

typedef struct {
    int fmt, act, T, N, K, G; /* G = K / 32 */
    const float *x;           /* [T, K] natural order */
    const float *xp;          /* [T, K] permuted (nibble formats, ACT_F32) */
    const int8_t *xq;         /* [T, K] int8 (permuted for nibble formats) */
    const int8_t *xq4;        /* [T, K] xq in LAYOUT_QUAD (nibble formats, ACT_Q8, AVX-512 VNNI) */
    const float *xp2;         /* [T, K] xp with pairs of blocks interleaved by 8 (ACT_F32, AVX-512) */
    const float *xd;          /* [T, G] activation block scales */
    const float *xs;          /* [T, G] xd * sum of the block's int8 values */
    const uint8_t *w;         /* int8 weights / nibble blocks / rvq codes */
    const void *s;            /* f32 row scales / f16 block scales / e8m0 / f16 codebooks */
    const float *bias;
    float *y;                 /* [T, N] */
    float *out;               /* dequant: [n1 - n0, K] */
    int n0;                   /* dequant: first row */
    const float *cb;          /* rvq3: codebooks f32 [3, 256, 8] */
    const float *cbt;         /* rvq3: codebooks transposed f32 [3, 8, 256] */
    float *tab;               /* rvq3: lookup table of the current token [K/8 * 3, 256] */
    int t;                    /* rvq3: current token */
} qjob;

/* E2M1 code -> 2 * value (an integer in [-12, 12]) */
__attribute__((unused)) static const int8_t FP4X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
__attribute__((unused)) static const int8_t FP4X2_ABS[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, 1, 2, 3, 4, 6, 8, 12};
/* the same as floats, with -0.0 for code 8, so that dequantization is bit-exact */
__attribute__((unused)) static const float FP4X2_F[16] = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f,
                                  -0.0f, -1.0f, -2.0f, -3.0f, -4.0f, -6.0f, -8.0f, -12.0f};

/* E8M0 byte -> 2^(e - 128), half the block scale, since FP4X2 holds twice the value: every
 * product 2v * 2^(e - 128) is then exact (or overflows to inf) in fp32, including e = 0 (a
 * subnormal scale) and e = 255 (NaN in OCP MX, read as 2^128 like transformers' ldexp). */
static inline float e8m0_half(uint8_t e) {
    uint32_t u = e >= 2 ? (uint32_t)(e - 1) << 23 : 0x00200000u << e;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

AVX2 static inline __m256 e8m0_half8(const uint8_t *p) {
    const __m256i one = _mm256_set1_epi32(1);
    __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i norm = _mm256_slli_epi32(_mm256_sub_epi32(e, one), 23);
    __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    __m256i r = _mm256_blendv_epi8(sub, norm, _mm256_cmpgt_epi32(e, one));
    return _mm256_castsi256_ps(r);
}

static inline float f16(const void *p, size_t i) { return sk_f16_to_f32(((const uint16_t *)p)[i]); }

/* position i of a permuted block holds element perm32(i) */
static inline int perm32(int i) { return i < 16 ? 2 * i : 2 * (i - 16) + 1; }

/* Activation layouts: LAYOUT_NATURAL; LAYOUT_BLOCK: each block of 32 as [even | odd]
 * elements (the order 16 unpacked nibble bytes come in); LAYOUT_PAIR (ACT_Q8 nibble
 * kernels): blocks g, g+1 (g even) as [evens g | evens g+1 | odds g | odds g+1], so that
 * one 32-byte load of two blocks' nibbles unpacks into two vectors (low nibbles, high
 * nibbles) without a lane crossing; an odd last block keeps LAYOUT_BLOCK. */
enum { LAYOUT_NATURAL = 0, LAYOUT_BLOCK = 1, LAYOUT_PAIR = 2 };

/* offset inside a row of K where position i (LAYOUT_BLOCK order) of block g lands */
static inline int pos_of(int layout, int G, int g, int i) {
    if (layout != LAYOUT_PAIR || ((g & 1) == 0 && g == G - 1)) return g * 32 + i;
    int base = (g & ~1) * 32, half = (g & 1) * 16;
    return i < 16 ? base + half + i : base + 32 + half + (i - 16);
}

/* ------------------------------------------------------ AVX2 building blocks ------- */

/* 16 bytes of nibbles -> 32 bytes: [low nibbles (even elements) | high nibbles (odd)] */
AVX2 static inline __m256i nibbles(const uint8_t *b) {
    __m128i v = _mm_loadu_si128((const __m128i *)b);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}

/* sum over 32 int8 weights times 32 fp32 activations, as 8 lanes */
AVX2 static inline __m256 dot32_f32(__m256i q, const float *x) {
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo))), _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi))), _mm256_loadu_ps(x + 24), s);
}

/* unsigned u8 weights . signed int8 activations over 32 bytes -> 8 int32 lanes as float */
AVX2 static inline __m256 dot32_u8i8(__m256i u, __m256i a) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
}


/* ------------------------------------------------------- q4 / mxfp4 rows --------- */

/* y = sum_g scale_g * sum_i W'_gi x_gi, with W' = nibble - 8 (q4) or 2 * E2M1 (mxfp4) and
 * scale_g = f16 d (q4) or 2^(e - 128) (mxfp4). In ACT_Q8 the integer dot products need
 * unsigned weights (vpmaddubsw), so they use u = nibble (q4) or 2 * E2M1 + 12 (mxfp4, one
 * table shuffle) and the offset comes off once per row through the activation block sums:
 * sum_i (u - c) a_i = sum_i u a_i - c sum_i a_i, c = 8 or 12.
 * Groups alternate between two accumulators (even / odd group index). MX and Q8 are
 * compile-time constants in each caller, so every variant is a straight loop. */
AVX2 INLINE __m256 nib_block(const uint8_t *b, const float *xp, const int8_t *xq, const int MX, const int Q8) {
    const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                         0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    /* 2 * E2M1 + 12, unsigned for vpmaddubsw; the 12 comes off through the block sums */
    const __m256i lut_u = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                           12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    __m256i nb = nibbles(b);
    if (Q8) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
        return dot32_u8i8(MX ? _mm256_shuffle_epi8(lut_u, nb) : nb, xv);
    }
    return dot32_f32(MX ? _mm256_shuffle_epi8(lut, nb) : _mm256_sub_epi8(nb, _mm256_set1_epi8(8)), xp);
}

/* ACT_Q8: two blocks per step. One 32-byte load holds blocks g and g+1; its low nibbles are
 * [evens g | evens g+1] and its high nibbles [odds g | odds g+1], matching LAYOUT_PAIR
 * activations, so both multiply straight away; the int16 sums of the two halves add
 * (at most 2 * 2 * 24 * 127, no overflow) and one vpmaddwd gives 4 int32 lanes per block,
 * scaled by [s_g x4 | s_g+1 x4]. */
AVX2 INLINE void nib_pair_unpack(const uint8_t *b, __m256i *lo, __m256i *hi, const int MX) {
    const __m256i lut_u = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
                                           12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
    const __m256i m = _mm256_set1_epi8(15);
    __m256i raw = _mm256_loadu_si256((const __m256i *)b);
    *lo = _mm256_and_si256(raw, m), *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m);
    if (MX) *lo = _mm256_shuffle_epi8(lut_u, *lo), *hi = _mm256_shuffle_epi8(lut_u, *hi);
}

AVX2 INLINE __m256 nib_pair_dot(__m256i lo, __m256i hi, const int8_t *xq) {
    __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xq)),
                                   _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xq + 32))));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
}

AVX2 INLINE __m256 nib_pair_q8(const uint8_t *b, const int8_t *xq, const int MX) {
    __m256i lo, hi;
    nib_pair_unpack(b, &lo, &hi, MX);
    return nib_pair_dot(lo, hi, xq);
}

/* Software prefetch distance of the nibble kernels. Their instruction density per byte is
 * high enough that the out-of-order window covers few cache lines, and a single core
 * reached only ~0.4-0.6 of the read bandwidth from DRAM; prefetching 4 KiB ahead measured
 * 0.5-0.8 (2 KiB and 8 KiB a little less, 16 KiB worse; no gain for int8 or dense). */
#define NIB_PREFETCH 4096

/* The groups after the last whole step of 8 (g0 .. G) and the final sums: shared by the AVX2 and
 * AVX-512 kernels, so that both compile it alike and every output keeps one summation order. */
AVX2 INLINE float nib_finish(const uint8_t *b, const void *scales, int G, int g0, const float *xp, const int8_t *xq,
                             const float *xd, const float *xs, __m256 a0, __m256 a1, __m256 corr, const int MX,
                             const int Q8) {
    const uint8_t *se = (const uint8_t *)scales;
    const uint16_t *sh = (const uint16_t *)scales;
    float corr_tail = 0.0f;
    for (int g = g0; g < G; g++) {
        float v = MX ? e8m0_half(se[g]) : _cvtsh_ss(sh[g]);
        if (Q8) {
            corr_tail += v * xs[g];
            v *= xd[g];
            if (g + 1 < G) { /* a pair */
                float v1 = MX ? e8m0_half(se[g + 1]) : _cvtsh_ss(sh[g + 1]);
                corr_tail += v1 * xs[g + 1];
                v1 *= xd[g + 1];
                __m256 sv = _mm256_set_m128(_mm_set1_ps(v1), _mm_set1_ps(v));
                a0 = _mm256_fmadd_ps(nib_pair_q8(b + (size_t)g * 16, xq + g * 32, MX), sv, a0);
                g++;
                continue;
            }
        }
        __m256 p = nib_block(b + (size_t)g * 16, xp + g * 32, xq + g * 32, MX, Q8);
        if ((g - g0) & 1) a1 = _mm256_fmadd_ps(p, _mm256_set1_ps(v), a1);
        else a0 = _mm256_fmadd_ps(p, _mm256_set1_ps(v), a0);
    }
    float s = sk_hsum8(_mm256_add_ps(a0, a1));
    if (Q8) s -= (MX ? 12.0f : 8.0f) * (sk_hsum8(corr) + corr_tail);
    return s;
}

AVX2 INLINE float nib_dot(const uint8_t *b, const void *scales, int G, const float *xp, const int8_t *xq,
                          const float *xd, const float *xs, const int MX, const int Q8) {
    const uint8_t *se = (const uint8_t *)scales;
    const uint16_t *sh = (const uint16_t *)scales;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), corr = _mm256_setzero_ps();
    int g0 = 0;
    for (; g0 + 8 <= G; g0 += 8) {
        _mm_prefetch((const char *)(b + (size_t)g0 * 16 + NIB_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(b + (size_t)g0 * 16 + NIB_PREFETCH + 64), _MM_HINT_T0);
        if ((g0 & 31) == 0) _mm_prefetch((const char *)scales + (size_t)g0 * (MX ? 1 : 2) + NIB_PREFETCH / 8, _MM_HINT_T0);
        __m256 v = MX ? e8m0_half8(se + g0) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sh + g0)));
        if (Q8) {
            corr = _mm256_fmadd_ps(v, _mm256_loadu_ps(xs + g0), corr);
            v = _mm256_mul_ps(v, _mm256_loadu_ps(xd + g0));
            const __m256i i01 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), i23 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3),
                          i45 = _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5), i67 = _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7);
            const uint8_t *bg = b + (size_t)g0 * 16;
            const int8_t *qg = xq + g0 * 32;
            a0 = _mm256_fmadd_ps(nib_pair_q8(bg, qg, MX), _mm256_permutevar8x32_ps(v, i01), a0);
            a1 = _mm256_fmadd_ps(nib_pair_q8(bg + 32, qg + 64, MX), _mm256_permutevar8x32_ps(v, i23), a1);
            a0 = _mm256_fmadd_ps(nib_pair_q8(bg + 64, qg + 128, MX), _mm256_permutevar8x32_ps(v, i45), a0);
            a1 = _mm256_fmadd_ps(nib_pair_q8(bg + 96, qg + 192, MX), _mm256_permutevar8x32_ps(v, i67), a1);
            continue;
        }
        float sc[8];
        _mm256_storeu_ps(sc, v);
        for (int i = 0; i < 8; i += 2) {
            const int g = g0 + i;
            __m256 p0 = nib_block(b + (size_t)g * 16, xp + g * 32, xq + g * 32, MX, Q8);
            __m256 p1 = nib_block(b + (size_t)g * 16 + 16, xp + g * 32 + 32, xq + g * 32 + 32, MX, Q8);
            a0 = _mm256_fmadd_ps(p0, _mm256_broadcast_ss(sc + i), a0);
            a1 = _mm256_fmadd_ps(p1, _mm256_broadcast_ss(sc + i + 1), a1);
        }
    }
    return nib_finish(b, scales, G, g0, xp, xq, xd, xs, a0, a1, corr, MX, Q8);
}


/* quant512.c */
void quad_layout(const int8_t *xq, int8_t *xq4, int T, int K);
void pair8_layout(const float *xp, float *xp2, int T, int K);
void q4_rows512(const qjob *j, int n0, int n1);
void mx_rows512(const qjob *j, int n0, int n1);
void q4_rows512_f32(const qjob *j, int n0, int n1);
void mx_rows512_f32(const qjob *j, int n0, int n1);

#endif
