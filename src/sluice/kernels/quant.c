/*
 * Sluice quantized-format kernels: fused dequantize-and-multiply (GEMV for a few tokens)
 * and bounded row dequantization to fp32 (for batched prefill, followed by sgemm).
 *
 * Formats (layouts in docs/quantization.md; K is padded to the format's block):
 *   int8   w int8 [N, K] + f32 scale per row               W = w * s[n]
 *   q4     blocks u8 [N, K/32, 16] + f16 scale [N, K/32]   W = (nibble - 8) * d
 *   mxfp4  blocks u8 [N, K/32, 16] + e8m0 u8 [N, K/32]     W = E2M1(nibble) * 2^(e - 127)
 *   rvq3   codes u8 [N, K/8, 3] + f16 codebooks [3, 256, 8]  W[8j:8j+8] = C0[c0] + C1[c1] + C2[c2]
 * Nibble formats store element 2i in the low nibble and 2i+1 in the high nibble of byte i
 * of a block (GPT-OSS order).
 *
 * Activations: ACT_F32 multiplies the fp32 activations exactly as given; ACT_Q8 first
 * rounds each block of 32 activations to int8 with one fp32 scale (amax / 127), then uses
 * integer dot products (vpmaddubsw) per block. For nibble formats the activations are
 * permuted once per call to the order the unpacked nibbles come in (see LAYOUT_BLOCK and
 * LAYOUT_PAIR), so weights need no shuffling in the inner loop.
 *
 * Every output row is computed by one thread with a fixed summation order: results do not
 * depend on the thread count. The portable C path keeps the same structure (but without
 * FMA, so it is not bit-identical to the AVX2 path).
 */
#include "quant.h"


/* ----------------------------------------------------------- activations ----------- */

static void prep_c(const float *x, int T, int K, int layout, int q8, float *xp, int8_t *xq, float *xd, float *xs) {
    const int G = K / 32;
    for (int t = 0; t < T; t++) {
        for (int g = 0; g < G; g++) {
            const float *src = x + (size_t)t * K + g * 32;
            float v[32];
            for (int i = 0; i < 32; i++) v[i] = src[layout != LAYOUT_NATURAL ? perm32(i) : i];
            if (!q8) {
                memcpy(xp + (size_t)t * K + g * 32, v, sizeof v);
                continue;
            }
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
            float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int i = 0; i < 32; i++) {
                int q = (int)rintf(v[i] * id);
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                xq[(size_t)t * K + pos_of(layout, G, g, i)] = (int8_t)q;
                sum += q;
            }
            xd[(size_t)t * G + g] = amax / 127.0f;
            xs[(size_t)t * G + g] = (float)sum * (amax / 127.0f);
        }
    }
}

AVX2 static inline __m256 evens(__m256 a, __m256 b) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
}

AVX2 static inline __m256 odds(__m256 a, __m256 b) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

AVX2 static void prep_avx2(const float *x, int T, int K, int layout, int q8, float *xp, int8_t *xq, float *xd,
                           float *xs) {
    const int G = K / 32;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int t = 0; t < T; t++) {
        for (int g = 0; g < G; g++) {
            const float *src = x + (size_t)t * K + g * 32;
            __m256 v0 = _mm256_loadu_ps(src), v1 = _mm256_loadu_ps(src + 8), v2 = _mm256_loadu_ps(src + 16),
                   v3 = _mm256_loadu_ps(src + 24);
            if (layout != LAYOUT_NATURAL) {
                __m256 p0 = evens(v0, v1), p1 = evens(v2, v3), p2 = odds(v0, v1), p3 = odds(v2, v3);
                v0 = p0, v1 = p1, v2 = p2, v3 = p3;
            }
            if (!q8) {
                float *dst = xp + (size_t)t * K + g * 32;
                _mm256_storeu_ps(dst, v0), _mm256_storeu_ps(dst + 8, v1);
                _mm256_storeu_ps(dst + 16, v2), _mm256_storeu_ps(dst + 24, v3);
                continue;
            }
            __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v0, absmask), _mm256_and_ps(v1, absmask)),
                                     _mm256_max_ps(_mm256_and_ps(v2, absmask), _mm256_and_ps(v3, absmask)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            float amax = _mm_cvtss_f32(m4);
            float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            __m256 vid = _mm256_set1_ps(id);
            /* cvtps rounds to nearest even (default MXCSR), like rintf and torch.round */
            __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid)), q1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid)),
                    q2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid)), q3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
            __m256i s = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            int8_t *dst = xq + (size_t)t * K;
            if (layout == LAYOUT_PAIR) { /* the two 16-byte halves go to their places in the pair */
                _mm_storeu_si128((__m128i *)(dst + pos_of(layout, G, g, 0)), _mm256_castsi256_si128(p));
                _mm_storeu_si128((__m128i *)(dst + pos_of(layout, G, g, 16)), _mm256_extracti128_si256(p, 1));
            } else {
                _mm256_storeu_si256((__m256i *)(dst + g * 32), p);
            }
            xd[(size_t)t * G + g] = amax / 127.0f;
            xs[(size_t)t * G + g] = (float)_mm_cvtsi128_si32(s4) * (amax / 127.0f);
        }
    }
}

/* --------------------------------------------------------------- int8 rows ------- */

AVX2 INLINE void int8_rows_body(const qjob *j, int n0, int n1, const int Q8) {
    const int K = j->K, G = j->G, T = j->T, N = j->N;
    const float *rs = (const float *)j->s, *xd = j->xd, *x = j->x, *bias = j->bias;
    const int8_t *xq = j->xq, *wbase = (const int8_t *)j->w;
    float *y = j->y;
    for (int n = n0; n < n1; n++) {
        const int8_t *w = wbase + (size_t)n * K;
        for (int t = 0; t < T; t++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            if (Q8) {
                const int8_t *q = xq + (size_t)t * K;
                const float *d = xd + (size_t)t * G;
                int g = 0;
                for (; g + 2 <= G; g += 2) {
                    __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + g * 32));
                    __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + g * 32 + 32));
                    __m256 p0 = dot32_u8i8(_mm256_abs_epi8(w0), _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q + g * 32)), w0));
                    __m256 p1 = dot32_u8i8(_mm256_abs_epi8(w1), _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q + g * 32 + 32)), w1));
                    a0 = _mm256_fmadd_ps(p0, _mm256_broadcast_ss(d + g), a0);
                    a1 = _mm256_fmadd_ps(p1, _mm256_broadcast_ss(d + g + 1), a1);
                }
                if (g < G) {
                    __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + g * 32));
                    __m256 p0 = dot32_u8i8(_mm256_abs_epi8(w0), _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q + g * 32)), w0));
                    a0 = _mm256_fmadd_ps(p0, _mm256_broadcast_ss(d + g), a0);
                }
            } else {
                const float *xt = x + (size_t)t * K;
                for (int k = 0; k < K; k += 16) {
                    __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k))));
                    __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k + 8))));
                    a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt + k), a0);
                    a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + k + 8), a1);
                }
            }
            float s = sk_hsum8(_mm256_add_ps(a0, a1)) * rs[n];
            y[(size_t)t * N + n] = s + (bias ? bias[n] : 0.0f);
        }
    }
}

AVX2 static void int8_rows_f32(const qjob *j, int n0, int n1) { int8_rows_body(j, n0, n1, 0); }
AVX2 static void int8_rows_q8(const qjob *j, int n0, int n1) { int8_rows_body(j, n0, n1, 1); }

static void int8_rows_c(const qjob *j, int n0, int n1) {
    const int K = j->K, G = j->G;
    const float *rs = (const float *)j->s;
    for (int n = n0; n < n1; n++) {
        const int8_t *w = (const int8_t *)j->w + (size_t)n * K;
        for (int t = 0; t < j->T; t++) {
            float a[8] = {0};
            if (j->act == ACT_Q8) {
                const int8_t *q = j->xq + (size_t)t * K;
                for (int g = 0; g < G; g++) {
                    int32_t p[8] = {0};
                    for (int i = 0; i < 32; i++) p[i >> 2] += (int32_t)w[g * 32 + i] * q[g * 32 + i];
                    for (int l = 0; l < 8; l++) a[l] += (float)p[l] * j->xd[(size_t)t * G + g];
                }
            } else {
                const float *x = j->x + (size_t)t * K;
                for (int k = 0; k < K; k += 8)
                    for (int l = 0; l < 8; l++) a[l] += (float)w[k + l] * x[k + l];
            }
            float s = sk_hsum8_c(a) * rs[n];
            j->y[(size_t)t * j->N + n] = s + (j->bias ? j->bias[n] : 0.0f);
        }
    }
}


/* nib_dot's ACT_Q8 path for NT tokens (<= NIB_TOKENS_AVX2) per pass over a row: each pair of
 * groups is unpacked once and multiplied into every token's a0 / a1 in nib_dot's order, so each
 * output has nib_dot's bits (the tiled integer GEMM of prefill chunks on AVX2 hosts). */
#define NIB_TOKENS_AVX2 3

AVX2 INLINE void nib_dot_q8_tokens(const uint8_t *b, const void *scales, int G, const int8_t *const *xq,
                                   const float *const *xd, const float *const *xs, float *out, const int NT,
                                   const int MX) {
    const uint8_t *se = (const uint8_t *)scales;
    const uint16_t *sh = (const uint16_t *)scales;
    __m256 acc[NIB_TOKENS_AVX2][2], corr[NIB_TOKENS_AVX2];
    for (int t = 0; t < NT; t++) acc[t][0] = acc[t][1] = corr[t] = _mm256_setzero_ps();
    int g0 = 0;
    for (; g0 + 8 <= G; g0 += 8) {
        _mm_prefetch((const char *)(b + (size_t)g0 * 16 + NIB_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(b + (size_t)g0 * 16 + NIB_PREFETCH + 64), _MM_HINT_T0);
        if ((g0 & 31) == 0) _mm_prefetch((const char *)scales + (size_t)g0 * (MX ? 1 : 2) + NIB_PREFETCH / 8, _MM_HINT_T0);
        const __m256 v = MX ? e8m0_half8(se + g0) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sh + g0)));
        __m256 vt[NIB_TOKENS_AVX2];
        for (int t = 0; t < NT; t++) {
            corr[t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xs[t] + g0), corr[t]);
            vt[t] = _mm256_mul_ps(v, _mm256_loadu_ps(xd[t] + g0));
        }
        for (int p = 0; p < 4; p++) {
            const __m256i idx = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
            __m256i lo, hi;
            nib_pair_unpack(b + (size_t)g0 * 16 + 32 * p, &lo, &hi, MX);
            for (int t = 0; t < NT; t++)
                acc[t][p & 1] = _mm256_fmadd_ps(nib_pair_dot(lo, hi, xq[t] + g0 * 32 + 64 * p),
                                                _mm256_permutevar8x32_ps(vt[t], idx), acc[t][p & 1]);
        }
    }
    for (int t = 0; t < NT; t++)
        out[t] = nib_finish(b, scales, G, g0, NULL, xq[t], xd[t], xs[t], acc[t][0], acc[t][1], corr[t], MX, 1);
}

AVX2 INLINE void nib_rows_q8_tokens(const qjob *j, int n0, int n1, const int MX) {
    const int K = j->K, G = j->G, T = j->T, N = j->N;
    const uint8_t *se = (const uint8_t *)j->s;
    const uint16_t *sh = (const uint16_t *)j->s;
    for (int n = n0; n < n1; n++) {
        const uint8_t *b = j->w + (size_t)n * G * 16;
        const void *sc = MX ? (const void *)(se + (size_t)n * G) : (const void *)(sh + (size_t)n * G);
        for (int t0 = 0; t0 < T; t0 += NIB_TOKENS_AVX2) {
            const int nt = T - t0 < NIB_TOKENS_AVX2 ? T - t0 : NIB_TOKENS_AVX2;
            const int8_t *q[NIB_TOKENS_AVX2];
            const float *d[NIB_TOKENS_AVX2], *s[NIB_TOKENS_AVX2];
            float out[NIB_TOKENS_AVX2];
            for (int t = 0; t < nt; t++) {
                q[t] = j->xq + (size_t)(t0 + t) * K;
                d[t] = j->xd + (size_t)(t0 + t) * G, s[t] = j->xs + (size_t)(t0 + t) * G;
            }
            switch (nt) {
            case 3: nib_dot_q8_tokens(b, sc, G, q, d, s, out, 3, MX); break;
            case 2: nib_dot_q8_tokens(b, sc, G, q, d, s, out, 2, MX); break;
            default: out[0] = nib_dot(b, sc, G, NULL, q[0], d[0], s[0], MX, 1); break;
            }
            for (int t = 0; t < nt; t++) j->y[(size_t)(t0 + t) * N + n] = out[t] + (j->bias ? j->bias[n] : 0.0f);
        }
    }
}

AVX2 INLINE void nib_rows_body(const qjob *j, int n0, int n1, const int MX, const int Q8) {
    const int K = j->K, G = j->G, T = j->T, N = j->N;
    const uint8_t *w = j->w;
    const uint8_t *se = (const uint8_t *)j->s;
    const uint16_t *sh = (const uint16_t *)j->s;
    const float *xp = j->xp, *xd = j->xd, *xs = j->xs, *bias = j->bias;
    const int8_t *xq = j->xq;
    float *y = j->y;
    for (int n = n0; n < n1; n++) {
        const uint8_t *b = w + (size_t)n * G * 16;
        const void *sc = MX ? (const void *)(se + (size_t)n * G) : (const void *)(sh + (size_t)n * G);
        for (int t = 0; t < T; t++) {
            float v = nib_dot(b, sc, G, Q8 ? NULL : xp + (size_t)t * K, Q8 ? xq + (size_t)t * K : NULL,
                              Q8 ? xd + (size_t)t * G : NULL, Q8 ? xs + (size_t)t * G : NULL, MX, Q8);
            y[(size_t)t * N + n] = v + (bias ? bias[n] : 0.0f);
        }
    }
}

AVX2 static void q4_rows_f32(const qjob *j, int n0, int n1) { nib_rows_body(j, n0, n1, 0, 0); }
AVX2 static void q4_rows_q8(const qjob *j, int n0, int n1) {
    if (j->T > 1) nib_rows_q8_tokens(j, n0, n1, 0);
    else nib_rows_body(j, n0, n1, 0, 1);
}
AVX2 static void mx_rows_f32(const qjob *j, int n0, int n1) { nib_rows_body(j, n0, n1, 1, 0); }
AVX2 static void mx_rows_q8(const qjob *j, int n0, int n1) {
    if (j->T > 1) nib_rows_q8_tokens(j, n0, n1, 1);
    else nib_rows_body(j, n0, n1, 1, 1);
}

AVX2 static void nib_rows_avx2(const qjob *j, int n0, int n1) {
    if (j->fmt == FMT_MXFP4) (j->act == ACT_Q8 ? mx_rows_q8 : mx_rows_f32)(j, n0, n1);
    else (j->act == ACT_Q8 ? q4_rows_q8 : q4_rows_f32)(j, n0, n1);
}

static void nib_rows_c(const qjob *j, int n0, int n1) {
    const int K = j->K, G = j->G, mx = j->fmt == FMT_MXFP4;
    for (int n = n0; n < n1; n++) {
        const uint8_t *b = j->w + (size_t)n * G * 16;
        for (int t = 0; t < j->T; t++) {
            float a[8] = {0}, corr = 0.0f;
            for (int g = 0; g < G; g++) {
                float sc = mx ? e8m0_half(((const uint8_t *)j->s)[(size_t)n * G + g]) : f16(j->s, (size_t)n * G + g);
                int8_t wv[32];
                for (int i = 0; i < 16; i++) {
                    int lo = b[(size_t)g * 16 + i] & 15, hi = b[(size_t)g * 16 + i] >> 4;
                    wv[i] = mx ? FP4X2[lo] : (int8_t)(lo - 8);
                    wv[16 + i] = mx ? FP4X2[hi] : (int8_t)(hi - 8);
                }
                float p[8] = {0};
                if (j->act == ACT_Q8) {
                    const int8_t *q = j->xq + (size_t)t * K;
                    int32_t ip[8] = {0};
                    for (int i = 0; i < 32; i++) ip[i >> 2] += (int32_t)(mx ? wv[i] : wv[i] + 8) * q[pos_of(LAYOUT_PAIR, G, g, i)];
                    for (int l = 0; l < 8; l++) p[l] = (float)ip[l];
                    if (!mx) corr += sc * j->xs[(size_t)t * G + g];
                    sc *= j->xd[(size_t)t * G + g];
                } else {
                    const float *x = j->xp + (size_t)t * K + g * 32;
                    for (int i = 0; i < 32; i++) p[i & 7] += (float)wv[i] * x[i];
                }
                for (int l = 0; l < 8; l++) a[l] += p[l] * sc;
            }
            float s = sk_hsum8_c(a);
            if (j->act == ACT_Q8 && !mx) s -= 8.0f * corr;
            j->y[(size_t)t * j->N + n] = s + (j->bias ? j->bias[n] : 0.0f);
        }
    }
}

/* ------------------------------------------------------------------ rvq3 ---------- */

/* table[(jj * 3 + s) * 256 + c] = C_s[c] . x[8 jj : 8 jj + 8] for the current token */
AVX2 static void rvq_table_avx2(const qjob *j, int j0, int j1) {
    const float *x = j->x + (size_t)j->t * j->K;
    for (int jj = j0; jj < j1; jj++) {
        __m256 xb[8];
        for (int d = 0; d < 8; d++) xb[d] = _mm256_broadcast_ss(x + 8 * jj + d);
        for (int s = 0; s < 3; s++) {
            const float *ct = j->cbt + (size_t)s * 8 * 256;
            float *dst = j->tab + ((size_t)jj * 3 + s) * 256;
            for (int c = 0; c < 256; c += 8) {
                __m256 v = _mm256_mul_ps(_mm256_loadu_ps(ct + c), xb[0]);
                for (int d = 1; d < 8; d++) v = _mm256_fmadd_ps(_mm256_loadu_ps(ct + d * 256 + c), xb[d], v);
                _mm256_storeu_ps(dst + c, v);
            }
        }
    }
}

static void rvq_table_c(const qjob *j, int j0, int j1) {
    const float *x = j->x + (size_t)j->t * j->K;
    for (int jj = j0; jj < j1; jj++)
        for (int s = 0; s < 3; s++)
            for (int c = 0; c < 256; c++) {
                const float *ct = j->cbt + (size_t)s * 8 * 256 + c;
                float v = ct[0] * x[8 * jj];
                for (int d = 1; d < 8; d++) v += ct[d * 256] * x[8 * jj + d];
                j->tab[((size_t)jj * 3 + s) * 256 + c] = v;
            }
}

/* y[n] = sum_p table[p * 256 + codes[n, p]] over p < 3K/8: eight lanes (lane = p mod 8) in
 * two interleaved accumulators, then the tail. Plain C for every machine: AVX2 gathers
 * measured no faster (the lookups are bound by L1 misses into the L2-resident table). */
static void rvq_rows_c(const qjob *j, int n0, int n1) {
    const int P = 3 * (j->K / 8), P16 = P & ~15;
    for (int n = n0; n < n1; n++) {
        const uint8_t *c = j->w + (size_t)n * P;
        float a0[8] = {0}, a1[8] = {0};
        for (int p = 0; p < P16; p += 16)
            for (int l = 0; l < 8; l++) {
                a0[l] += j->tab[(size_t)(p + l) * 256 + c[p + l]];
                a1[l] += j->tab[(size_t)(p + 8 + l) * 256 + c[p + 8 + l]];
            }
        float a[8];
        for (int l = 0; l < 8; l++) a[l] = a0[l] + a1[l];
        float s = sk_hsum8_c(a);
        for (int p = P16; p < P; p++) s += j->tab[(size_t)p * 256 + c[p]];
        j->y[(size_t)j->t * j->N + n] = s + (j->bias ? j->bias[n] : 0.0f);
    }
}

/* ------------------------------------------------------------- dequantize --------- */

AVX2 static void dequant_rows_avx2(const qjob *j, int r0, int r1) {
    const int K = j->K, G = j->G;
    const __m256i lut_abs = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4X2_ABS));
    for (int n = j->n0 + r0; n < j->n0 + r1; n++) {
        float *o = j->out + (size_t)(n - j->n0) * K;
        if (j->fmt == FMT_INT8) {
            const int8_t *w = (const int8_t *)j->w + (size_t)n * K;
            __m256 sv = _mm256_set1_ps(((const float *)j->s)[n]);
            for (int k = 0; k < K; k += 8)
                _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                          _mm_loadl_epi64((const __m128i *)(w + k)))), sv));
        } else if (j->fmt == FMT_Q4 || j->fmt == FMT_MXFP4) {
            const int mx = j->fmt == FMT_MXFP4;
            for (int g = 0; g < G; g++) {
                __m128i v = _mm_loadu_si128((const __m128i *)(j->w + ((size_t)n * G + g) * 16));
                __m128i lo = _mm_and_si128(v, _mm_set1_epi8(15)), hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
                __m256i nat = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)); /* natural order */
                __m256i q = mx ? _mm256_shuffle_epi8(lut_abs, nat) : _mm256_sub_epi8(nat, _mm256_set1_epi8(8));
                float sc = mx ? e8m0_half(((const uint8_t *)j->s)[(size_t)n * G + g]) : _cvtsh_ss(((const uint16_t *)j->s)[(size_t)n * G + g]);
                __m256 sv = _mm256_set1_ps(sc);
                float *og = o + g * 32;
                for (int c = 0; c < 4; c++) {
                    __m128i qc = c < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
                    if (c & 1) qc = _mm_unpackhi_epi64(qc, qc);
                    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(qc)), sv);
                    if (mx) { /* sign from the code's bit 3, so that code 8 gives -0.0 */
                        __m128i nc = c < 2 ? _mm256_castsi256_si128(nat) : _mm256_extracti128_si256(nat, 1);
                        if (c & 1) nc = _mm_unpackhi_epi64(nc, nc);
                        __m256i sb = _mm256_and_si256(_mm256_slli_epi32(_mm256_cvtepu8_epi32(nc), 28), _mm256_set1_epi32((int)0x80000000u));
                        f = _mm256_or_ps(f, _mm256_castsi256_ps(sb));
                    }
                    _mm256_storeu_ps(og + 8 * c, f);
                }
            }
        } else { /* rvq3 */
            const uint8_t *c = j->w + (size_t)n * 3 * (K / 8);
            for (int jj = 0; jj < K / 8; jj++) {
                __m256 v = _mm256_add_ps(_mm256_loadu_ps(j->cb + (size_t)c[3 * jj] * 8),
                                         _mm256_loadu_ps(j->cb + (256 + (size_t)c[3 * jj + 1]) * 8));
                _mm256_storeu_ps(o + 8 * jj, _mm256_add_ps(v, _mm256_loadu_ps(j->cb + (512 + (size_t)c[3 * jj + 2]) * 8)));
            }
        }
    }
}

static void dequant_rows_c(const qjob *j, int r0, int r1) {
    const int K = j->K, G = j->G;
    for (int n = j->n0 + r0; n < j->n0 + r1; n++) {
        float *o = j->out + (size_t)(n - j->n0) * K;
        if (j->fmt == FMT_INT8) {
            const int8_t *w = (const int8_t *)j->w + (size_t)n * K;
            float s = ((const float *)j->s)[n];
            for (int k = 0; k < K; k++) o[k] = (float)w[k] * s;
        } else if (j->fmt == FMT_Q4 || j->fmt == FMT_MXFP4) {
            const int mx = j->fmt == FMT_MXFP4;
            for (int g = 0; g < G; g++) {
                float sc = mx ? e8m0_half(((const uint8_t *)j->s)[(size_t)n * G + g]) : f16(j->s, (size_t)n * G + g);
                const uint8_t *b = j->w + ((size_t)n * G + g) * 16;
                for (int i = 0; i < 16; i++) {
                    int lo = b[i] & 15, hi = b[i] >> 4;
                    o[g * 32 + 2 * i] = (mx ? FP4X2_F[lo] : (float)(lo - 8)) * sc;
                    o[g * 32 + 2 * i + 1] = (mx ? FP4X2_F[hi] : (float)(hi - 8)) * sc;
                }
            }
        } else {
            const uint8_t *c = j->w + (size_t)n * 3 * (K / 8);
            for (int jj = 0; jj < K / 8; jj++)
                for (int d = 0; d < 8; d++)
                    o[8 * jj + d] = (j->cb[(size_t)c[3 * jj] * 8 + d] + j->cb[(256 + (size_t)c[3 * jj + 1]) * 8 + d]) +
                                    j->cb[(512 + (size_t)c[3 * jj + 2]) * 8 + d];
        }
    }
}

/* ---------------------------------------------------------------- tasks ---------- */

static void rows_task(void *ctx, int n0, int n1) {
    const qjob *j = (const qjob *)ctx;
    int avx = sk_avx2();
    switch (j->fmt) {
    case FMT_INT8: avx ? (j->act == ACT_Q8 ? int8_rows_q8 : int8_rows_f32)(j, n0, n1) : int8_rows_c(j, n0, n1); break;
    case FMT_Q4:
    case FMT_MXFP4:
        if (j->xq4) (j->fmt == FMT_MXFP4 ? mx_rows512 : q4_rows512)(j, n0, n1);
        else if (j->xp2) (j->fmt == FMT_MXFP4 ? mx_rows512_f32 : q4_rows512_f32)(j, n0, n1);
        else avx ? nib_rows_avx2(j, n0, n1) : nib_rows_c(j, n0, n1);
        break;
    case FMT_RVQ3: rvq_rows_c(j, n0, n1); break;
    }
}

static void table_task(void *ctx, int j0, int j1) {
    const qjob *j = (const qjob *)ctx;
    sk_avx2() ? rvq_table_avx2(j, j0, j1) : rvq_table_c(j, j0, j1);
}

static void dequant_task(void *ctx, int r0, int r1) {
    const qjob *j = (const qjob *)ctx;
    sk_avx2() ? dequant_rows_avx2(j, r0, r1) : dequant_rows_c(j, r0, r1);
}

static size_t row_bytes(int fmt, int K) {
    switch (fmt) {
    case FMT_INT8: return (size_t)K;
    case FMT_Q4: return (size_t)K / 2 + (size_t)K / 16;
    case FMT_MXFP4: return (size_t)K / 2 + (size_t)K / 32;
    default: return 3 * (size_t)K / 8;
    }
}

/* f16 codebooks [3, 256, 8] -> f32 in scratch: [3, 256, 8] and transposed [3, 8, 256] */
static int rvq_codebooks(qjob *j, int transposed) {
    float *cb = (float *)sk_scratch(2, (size_t)2 * 3 * 256 * 8 * sizeof(float));
    if (!cb) return -2;
    float *cbt = cb + 3 * 256 * 8;
    for (int i = 0; i < 3 * 256 * 8; i++) cb[i] = f16(j->s, (size_t)i);
    if (transposed)
        for (int s = 0; s < 3; s++)
            for (int c = 0; c < 256; c++)
                for (int d = 0; d < 8; d++) cbt[((size_t)s * 8 + d) * 256 + c] = cb[((size_t)s * 256 + c) * 8 + d];
    j->cb = cb;
    j->cbt = cbt;
    return 0;
}

static int valid(int fmt, int K) {
    if (fmt == FMT_RVQ3) return K % 8 == 0;
    if (fmt == FMT_INT8 || fmt == FMT_Q4 || fmt == FMT_MXFP4) return K % 32 == 0;
    return 0;
}

/* Quantize activations the way ACT_Q8 does (exposed for tests and for the reference). */
EXPORT void sk_q8_activations(const float *x, int T, int K, int layout, int8_t *xq, float *xd, float *xs) {
    if (sk_avx2()) prep_avx2(x, T, K, layout, 1, NULL, xq, xd, xs);
    else prep_c(x, T, K, layout, 1, NULL, xq, xd, xs);
}

/* y[T, N] = x[T, K] @ W^T (+ bias) for W in a quantized format; 0 on success, -1 when the
 * format / K / activation mode combination is not supported, -2 when out of memory. */
EXPORT int sk_qmatmul(int fmt, int act, const float *x, const void *w, const void *s, const float *bias, float *y,
                      int T, int N, int K, int nthreads) {
    if (!valid(fmt, K) || (act != ACT_F32 && act != ACT_Q8)) return -1;
    qjob j;
    memset(&j, 0, sizeof j);
    j.fmt = fmt, j.act = fmt == FMT_RVQ3 ? ACT_F32 : act, j.T = T, j.N = N, j.K = K, j.G = K / 32;
    j.x = x, j.w = (const uint8_t *)w, j.s = s, j.bias = bias, j.y = y;
    size_t rb = row_bytes(fmt, K);
    if ((size_t)N * rb < (64u << 10)) nthreads = 1;
    int chunk = sk_chunk_rows(rb, N);
    if (fmt == FMT_RVQ3) {
        j.tab = (float *)sk_scratch(3, (size_t)3 * (K / 8) * 256 * sizeof(float));
        if (rvq_codebooks(&j, 1) || !j.tab) return -2;
        for (int t = 0; t < T; t++) {
            j.t = t;
            sk_parallel(table_task, &j, K / 8, 32, nthreads);
            sk_parallel(rows_task, &j, N, chunk, nthreads);
        }
        return 0;
    }
    int perm = fmt != FMT_INT8;
    if (j.act == ACT_Q8) {
        int layout = perm ? LAYOUT_PAIR : LAYOUT_NATURAL;
        int8_t *xq = (int8_t *)sk_scratch(0, (size_t)T * K);
        float *xd = (float *)sk_scratch(1, (size_t)2 * T * j.G * sizeof(float) + 64);
        if (!xq || !xd) return -2;
        j.xq = xq, j.xd = xd, j.xs = xd + (size_t)T * j.G;
        if (sk_avx2()) prep_avx2(x, T, K, layout, 1, NULL, xq, xd, (float *)j.xs);
        else prep_c(x, T, K, layout, 1, NULL, xq, xd, (float *)j.xs);
        if (perm && sk_isa() >= SK_ISA_VNNI512) {
            int8_t *xq4 = (int8_t *)sk_scratch(5, (size_t)T * K);
            if (!xq4) return -2;
            quad_layout(xq, xq4, T, K);
            j.xq4 = xq4;
        }
    } else if (perm) {
        float *xp = (float *)sk_scratch(0, (size_t)T * K * sizeof(float));
        if (!xp) return -2;
        j.xp = xp;
        if (sk_avx2()) prep_avx2(x, T, K, LAYOUT_BLOCK, 0, xp, NULL, NULL, NULL);
        else prep_c(x, T, K, LAYOUT_BLOCK, 0, xp, NULL, NULL, NULL);
        if (sk_isa() >= SK_ISA_AVX512) {
            float *xp2 = (float *)sk_scratch(5, (size_t)T * K * sizeof(float));
            if (!xp2) return -2;
            pair8_layout(xp, xp2, T, K);
            j.xp2 = xp2;
        }
    }
    sk_parallel(rows_task, &j, N, chunk, nthreads);
    return 0;
}

/* out[n1 - n0, K] = W[n0:n1] in fp32 (exactly the reference dequantization); -1 / -2 as above. */
EXPORT int sk_qdequant(int fmt, const void *w, const void *s, float *out, int n0, int n1, int K, int nthreads) {
    if (!valid(fmt, K)) return -1;
    qjob j;
    memset(&j, 0, sizeof j);
    j.fmt = fmt, j.K = K, j.G = K / 32, j.w = (const uint8_t *)w, j.s = s, j.out = out, j.n0 = n0;
    if (fmt == FMT_RVQ3 && rvq_codebooks(&j, 0)) return -2;
    int rows = n1 - n0;
    if ((size_t)rows * K < (16u << 10)) nthreads = 1;
    sk_parallel(dequant_task, &j, rows, sk_chunk_rows((size_t)K * 4, rows), nthreads);
    return 0;
}
