/*
 * AVX-512 forms of the nibble-format kernels (q4, mxfp4), chosen at run time by sk_isa(): each
 * keeps the AVX2 kernel's per-output order (quant.c, nib_dot), so every level gives its bits
 * (tests/test_kernel_isa.py).
 */
#define _GNU_SOURCE
#include "quant.h"

/*
 * AVX-512 VNNI form of nib_dot's ACT_Q8 path, for up to 4 tokens per pass over a row (the
 * nibbles are unpacked once for all of them). One zmm accumulator per token holds nib_dot's a0
 * (lanes 0-7) and a1 (lanes 8-15): each step of 8 groups multiplies [pair g0 | pair g0+2], then
 * [pair g0+4 | pair g0+6], into it with the same scales in the same order as nib_dot's four
 * fmas. vpdpbusd gives exactly nib_pair_q8's int32 sums (integer arithmetic, no saturation at
 * these magnitudes), so every output has nib_dot's bits. The activations come in LAYOUT_QUAD:
 * LAYOUT_PAIR with the 32-byte chunks of every 4 blocks in whole steps reordered (0, 2, 1, 3),
 * so that one 64-byte load holds the low-nibble activations of two pairs and the next the high.
 */
#define NIB_TOKENS 4

AVX512VNNI INLINE void nib_dot512(const uint8_t *b, const void *scales, int G, const int8_t *const *xq4,
                                  const int8_t *const *xq, const float *const *xd, const float *const *xs,
                                  float *out, const int NT, const int MX) {
    const uint8_t *se = (const uint8_t *)scales;
    const uint16_t *sh = (const uint16_t *)scales;
    const __m512i lut_u = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i m = _mm512_set1_epi8(15);
    const __m512i i0123 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i i4567 = _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    __m512 acc[NIB_TOKENS];
    __m256 corr[NIB_TOKENS];
    for (int t = 0; t < NT; t++) acc[t] = _mm512_setzero_ps(), corr[t] = _mm256_setzero_ps();
    int g0 = 0;
    for (; g0 + 8 <= G; g0 += 8) {
        _mm_prefetch((const char *)(b + (size_t)g0 * 16 + NIB_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(b + (size_t)g0 * 16 + NIB_PREFETCH + 64), _MM_HINT_T0);
        if ((g0 & 31) == 0) _mm_prefetch((const char *)scales + (size_t)g0 * (MX ? 1 : 2) + NIB_PREFETCH / 8, _MM_HINT_T0);
        const __m256 v = MX ? e8m0_half8(se + g0) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sh + g0)));
        const uint8_t *bg = b + (size_t)g0 * 16;
        const __m512i r0 = _mm512_loadu_si512((const void *)bg), r1 = _mm512_loadu_si512((const void *)(bg + 64));
        __m512i lo0 = _mm512_and_si512(r0, m), hi0 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), m);
        __m512i lo1 = _mm512_and_si512(r1, m), hi1 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), m);
        if (MX) {
            lo0 = _mm512_shuffle_epi8(lut_u, lo0), hi0 = _mm512_shuffle_epi8(lut_u, hi0);
            lo1 = _mm512_shuffle_epi8(lut_u, lo1), hi1 = _mm512_shuffle_epi8(lut_u, hi1);
        }
        for (int t = 0; t < NT; t++) {
            corr[t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xs[t] + g0), corr[t]);
            const __m512 vt = _mm512_castps256_ps512(_mm256_mul_ps(v, _mm256_loadu_ps(xd[t] + g0)));
            const int8_t *qg = xq4[t] + g0 * 32;
            __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo0, _mm512_loadu_si512((const void *)qg));
            p0 = _mm512_dpbusd_epi32(p0, hi0, _mm512_loadu_si512((const void *)(qg + 64)));
            __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo1, _mm512_loadu_si512((const void *)(qg + 128)));
            p1 = _mm512_dpbusd_epi32(p1, hi1, _mm512_loadu_si512((const void *)(qg + 192)));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_permutexvar_ps(i0123, vt), acc[t]);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_permutexvar_ps(i4567, vt), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        const __m256 a0 = _mm512_castps512_ps256(acc[t]);
        const __m256 a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[t]), 1));
        out[t] = nib_finish(b, scales, G, g0, NULL, xq[t], xd[t], xs[t], a0, a1, corr[t], MX, 1);
    }
}

/* LAYOUT_PAIR activations [T, K] -> LAYOUT_QUAD (see nib_dot512) */
void quad_layout(const int8_t *xq, int8_t *xq4, int T, int K) {
    const int G8 = (K / 32) & ~7;
    for (int t = 0; t < T; t++) {
        const int8_t *src = xq + (size_t)t * K;
        int8_t *dst = xq4 + (size_t)t * K;
        for (int g = 0; g < G8; g += 4) {
            memcpy(dst + g * 32, src + g * 32, 32);
            memcpy(dst + g * 32 + 32, src + g * 32 + 64, 32);
            memcpy(dst + g * 32 + 64, src + g * 32 + 32, 32);
            memcpy(dst + g * 32 + 96, src + g * 32 + 96, 32);
        }
        memcpy(dst + G8 * 32, src + G8 * 32, (size_t)(K - G8 * 32));
    }
}

AVX512VNNI INLINE void nib_rows512_body(const qjob *j, int n0, int n1, const int MX) {
    const int K = j->K, G = j->G, T = j->T, N = j->N;
    const uint8_t *se = (const uint8_t *)j->s;
    const uint16_t *sh = (const uint16_t *)j->s;
    for (int n = n0; n < n1; n++) {
        const uint8_t *b = j->w + (size_t)n * G * 16;
        const void *sc = MX ? (const void *)(se + (size_t)n * G) : (const void *)(sh + (size_t)n * G);
        for (int t0 = 0; t0 < T; t0 += NIB_TOKENS) {
            const int nt = T - t0 < NIB_TOKENS ? T - t0 : NIB_TOKENS;
            const int8_t *q4[NIB_TOKENS], *q[NIB_TOKENS];
            const float *d[NIB_TOKENS], *s[NIB_TOKENS];
            float out[NIB_TOKENS];
            for (int t = 0; t < nt; t++) {
                q4[t] = j->xq4 + (size_t)(t0 + t) * K, q[t] = j->xq + (size_t)(t0 + t) * K;
                d[t] = j->xd + (size_t)(t0 + t) * G, s[t] = j->xs + (size_t)(t0 + t) * G;
            }
            switch (nt) {
            case 4: nib_dot512(b, sc, G, q4, q, d, s, out, 4, MX); break;
            case 3: nib_dot512(b, sc, G, q4, q, d, s, out, 3, MX); break;
            case 2: nib_dot512(b, sc, G, q4, q, d, s, out, 2, MX); break;
            default: nib_dot512(b, sc, G, q4, q, d, s, out, 1, MX); break;
            }
            for (int t = 0; t < nt; t++) j->y[(size_t)(t0 + t) * N + n] = out[t] + (j->bias ? j->bias[n] : 0.0f);
        }
    }
}

/*
 * AVX-512F form of nib_dot's ACT_F32 path (fp32 activations: GPT-OSS's native MXFP4 experts).
 * One zmm holds nib_dot's p0 (group g, lanes 0-7) and p1 (group g+1, lanes 8-15): the same
 * multiply and three fmas per lane on the same values, then one fma into an accumulator that
 * holds a0 and a1 side by side. The activations come re-laid per pair of blocks as
 * [g 0-7 | g+1 0-7 | g 8-15 | g+1 8-15 | ...] (LAYOUT_BLOCK order inside each block), so each
 * step loads 64 bytes; the group tail and the final sums are nib_finish, as in nib_dot.
 */
AVX512 INLINE float nib_dot512_f32(const uint8_t *b, const void *scales, int G, const float *xp, const float *xp2,
                                   const int MX) {
    const uint8_t *se = (const uint8_t *)scales;
    const uint16_t *sh = (const uint16_t *)scales;
    const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                         0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m256i m = _mm256_set1_epi8(15);
    __m512 acc = _mm512_setzero_ps();
    int g0 = 0;
    for (; g0 + 8 <= G; g0 += 8) {
        _mm_prefetch((const char *)(b + (size_t)g0 * 16 + NIB_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(b + (size_t)g0 * 16 + NIB_PREFETCH + 64), _MM_HINT_T0);
        if ((g0 & 31) == 0) _mm_prefetch((const char *)scales + (size_t)g0 * (MX ? 1 : 2) + NIB_PREFETCH / 8, _MM_HINT_T0);
        const __m256 v = MX ? e8m0_half8(se + g0) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sh + g0)));
        const __m512 vz = _mm512_castps256_ps512(v);
        for (int i = 0; i < 8; i += 2) {
            const int g = g0 + i;
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (size_t)g * 16)); /* groups g, g+1 */
            __m256i lo = _mm256_and_si256(raw, m), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m);
            if (MX) lo = _mm256_shuffle_epi8(lut, lo), hi = _mm256_shuffle_epi8(lut, hi);
            else lo = _mm256_sub_epi8(lo, _mm256_set1_epi8(8)), hi = _mm256_sub_epi8(hi, _mm256_set1_epi8(8));
            lo = _mm256_permute4x64_epi64(lo, 0xD8), hi = _mm256_permute4x64_epi64(hi, 0xD8); /* [g 0-7, g+1 0-7 | g 8-15, g+1 8-15] */
            const float *x = xp2 + (size_t)g * 32;
            const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(lo)));
            const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(lo, 1)));
            const __m512 w2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(hi)));
            const __m512 w3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(hi, 1)));
            __m512 p = _mm512_mul_ps(w0, _mm512_loadu_ps(x));
            p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + 16), p);
            p = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x + 32), p);
            p = _mm512_fmadd_ps(w3, _mm512_loadu_ps(x + 48), p);
            const __m512i idx = _mm512_setr_epi32(i, i, i, i, i, i, i, i, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1, i + 1);
            acc = _mm512_fmadd_ps(p, _mm512_permutexvar_ps(idx, vz), acc);
        }
    }
    const __m256 a0 = _mm512_castps512_ps256(acc);
    const __m256 a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    return nib_finish(b, scales, G, g0, xp, NULL, NULL, NULL, a0, a1, _mm256_setzero_ps(), MX, 0);
}

/* LAYOUT_BLOCK activations [T, K] -> pairs of blocks interleaved by 8 (see nib_dot512_f32) */
void pair8_layout(const float *xp, float *xp2, int T, int K) {
    const int G8 = (K / 32) & ~7;
    for (int t = 0; t < T; t++) {
        const float *src = xp + (size_t)t * K;
        float *dst = xp2 + (size_t)t * K;
        for (int g = 0; g < G8; g += 2)
            for (int c = 0; c < 4; c++) {
                memcpy(dst + g * 32 + 16 * c, src + g * 32 + 8 * c, 8 * sizeof(float));
                memcpy(dst + g * 32 + 16 * c + 8, src + (g + 1) * 32 + 8 * c, 8 * sizeof(float));
            }
        memcpy(dst + G8 * 32, src + G8 * 32, sizeof(float) * (size_t)(K - G8 * 32));
    }
}

AVX512 INLINE void nib_rows512_f32_body(const qjob *j, int n0, int n1, const int MX) {
    const int K = j->K, G = j->G, T = j->T, N = j->N;
    const uint8_t *se = (const uint8_t *)j->s;
    const uint16_t *sh = (const uint16_t *)j->s;
    for (int n = n0; n < n1; n++) {
        const uint8_t *b = j->w + (size_t)n * G * 16;
        const void *sc = MX ? (const void *)(se + (size_t)n * G) : (const void *)(sh + (size_t)n * G);
        for (int t = 0; t < T; t++) {
            float v = nib_dot512_f32(b, sc, G, j->xp + (size_t)t * K, j->xp2 + (size_t)t * K, MX);
            j->y[(size_t)t * N + n] = v + (j->bias ? j->bias[n] : 0.0f);
        }
    }
}

AVX512 void q4_rows512_f32(const qjob *j, int n0, int n1) { nib_rows512_f32_body(j, n0, n1, 0); }
AVX512 void mx_rows512_f32(const qjob *j, int n0, int n1) { nib_rows512_f32_body(j, n0, n1, 1); }

AVX512VNNI void q4_rows512(const qjob *j, int n0, int n1) { nib_rows512_body(j, n0, n1, 0); }
AVX512VNNI void mx_rows512(const qjob *j, int n0, int n1) { nib_rows512_body(j, n0, n1, 1); }
