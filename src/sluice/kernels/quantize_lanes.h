/* The lane kernels of quantize.c, included once per instruction set with LANES (8 or 16) and
 * SUFFIX defined; N(x) names this copy's x. Per group the operations and their order do not
 * depend on LANES, so every copy gives the same bytes. No include guard: included several times. */
#define N2(x, s) x##_##s
#define N1(x, s) N2(x, s)
#define N(x) N1(x, SUFFIX)

/* LANES groups at a time, one per lane ([element][lane] arrays), so that every step is the same
 * operation across lanes and the compiler vectorizes it; per group the operations and their order
 * are exactly those of quant/q4.py's torch form. */

static inline __attribute__((always_inline)) void N(tree_sum)(float t[GROUP][LANES], float *out) {
    for (int n = GROUP / 2; n >= 1; n /= 2)
        for (int i = 0; i < n; i++)
            for (int l = 0; l < LANES; l++) t[i][l] = t[2 * i][l] + t[2 * i + 1][l];
    for (int l = 0; l < LANES; l++) out[l] = t[0][l];
}

/* round(w / d) to nearest even, clamped to [-8, 7]; 0 where d is 0 or the quotient is NaN
 * (the sign of a zero level never matters) */
typedef float N(vf) __attribute__((vector_size(LANES * 4)));
typedef int32_t N(vi) __attribute__((vector_size(LANES * 4)));

static inline __attribute__((always_inline)) N(vf) N(vsel)(N(vi) m, N(vf) a, N(vf) b) { /* m ? a : b per lane */
    return (N(vf))(((N(vi))a & m) | ((N(vi))b & ~m));
}

static inline __attribute__((always_inline)) void N(levels)(float w[GROUP][LANES], const float *d, float q[GROUP][LANES]) {
    N(vf) dv, zero = {0}, one = zero + 1.0f, big = one * 12582912.0f;
    memcpy(&dv, d, sizeof dv);
    const N(vi) dzero = dv == zero;
    const N(vf) safe = N(vsel)(dzero, one, dv);
    for (int i = 0; i < GROUP; i++) {
        N(vf) x;
        memcpy(&x, w[i], sizeof x);
        x = x / safe;
        x = N(vsel)(x < -9.0f * one, -9.0f * one, x);  /* NaN passes, as in torch */
        x = N(vsel)(x > 9.0f * one, 9.0f * one, x);
        x = (x + big) - big;                           /* + 1.5 * 2^23 - 1.5 * 2^23: round to even */
        const N(vi) nan = x != x;
        x = N(vsel)(x < -8.0f * one, -8.0f * one, x);
        x = N(vsel)(x > 7.0f * one, 7.0f * one, x);
        x = N(vsel)(nan | dzero, zero, x);              /* a NaN level is 0; 0 where d is 0 */
        memcpy(q[i], &x, sizeof x);
    }
}

/* groups [g0, g0 + nl) of one row (nl <= LANES; unused lanes hold zeros and are not stored) */
static inline __attribute__((always_inline)) void N(q4_lanes)(const float *w, int nl, const float *cands, int ncand,
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
        N(levels)(W, d, Q);
        for (int i = 0; i < GROUP; i++)
            for (int l = 0; l < LANES; l++) T[i][l] = Q[i][l] * Q[i][l];
        N(tree_sum)(T, qq);
        for (int i = 0; i < GROUP; i++)
            for (int l = 0; l < LANES; l++) T[i][l] = Q[i][l] * W[i][l];
        N(tree_sum)(T, wq);
        for (int l = 0; l < LANES; l++) d[l] = to_half(qq[l] > 0 ? wq[l] / (qq[l] < 1e-30f ? 1e-30f : qq[l]) : 0.0f);
        N(levels)(W, d, Q);
        for (int i = 0; i < GROUP; i++)
            for (int l = 0; l < LANES; l++) {
                float x = Q[i][l] * d[l] - W[i][l];
                T[i][l] = x * x;
            }
        N(tree_sum)(T, e);
        for (int l = 0; l < LANES; l++)
            if (c == 0 || e[l] < best_e[l]) {
                best_e[l] = e[l];
                best_d[l] = d[l];
            }
    }
    N(levels)(W, best_d, Q);
    for (int l = 0; l < nl; l++) {
        uint8_t *out = blocks + l * (GROUP / 2);
        for (int i = 0; i < GROUP / 2; i++)
            out[i] = (uint8_t)((int)(Q[2 * i][l] + 8.0f) | ((int)(Q[2 * i + 1][l] + 8.0f) << 4));
        scales[l] = half_bits(best_d[l]);
    }
}

typedef uint32_t N(vu) __attribute__((vector_size(LANES * 4)));

static inline __attribute__((always_inline)) void N(mx_lanes)(const float *w, int nl, uint8_t *blocks, uint8_t *scales) {
    float W[GROUP][LANES], T[GROUP][LANES];
    N(vi) C[2][GROUP];
    float e[2][LANES], scale[LANES], inv[LANES];
    int base[LANES];
    for (int l = 0; l < LANES; l++)
        for (int i = 0; i < GROUP; i++) W[i][l] = l < nl ? w[l * GROUP + i] : 0.0f;
    /* largest |w| as bits: a NaN's bits exceed inf's, so a NaN wins as in torch's amax */
    N(vu) amax = {0}, absmask = amax + 0x7fffffffu;
    for (int i = 0; i < GROUP; i++) {
        N(vu) u;
        memcpy(&u, W[i], sizeof u);
        u &= absmask;
        amax = (N(vu))N(vsel)((N(vi))(u > amax), (N(vf))u, (N(vf))amax);
    }
    for (int l = 0; l < LANES; l++) {
        const int ex = (int)(amax[l] >> 23);
        base[l] = amax[l] > 0x7f800000u ? 0 : ex == 255 ? 124 : ex - 2 < 0 ? 0 : ex - 2;
    }
    const N(vf) one = (N(vf)){0} + 1.0f;
    const N(vi) izero = {0}, ione = izero + 1;
    for (int extra = 0; extra < 2; extra++) {
        for (int l = 0; l < LANES; l++) {
            const int s = base[l] + extra > 254 ? 254 : base[l] + extra;
            scale[l] = pow2f(s - 127);
            inv[l] = pow2f(127 - s);
        }
        N(vf) sv, iv;
        memcpy(&sv, scale, sizeof sv);
        memcpy(&iv, inv, sizeof iv);
        for (int i = 0; i < GROUP; i++) {
            N(vf) x;
            memcpy(&x, W[i], sizeof x);
            const N(vf) a = x * iv, m = (N(vf))((N(vi))a & (N(vi))absmask);
            /* nearest E2M1 index, ties to even (each comparison is -1 where true); NaN gives 0 */
            const N(vi) idx = -((m > 0.25f * one) + (m >= 0.75f * one) + (m > 1.25f * one) + (m >= 1.75f * one) +
                              (m > 2.5f * one) + (m >= 3.5f * one) + (m > 5.0f * one));
            /* its magnitude: 0, .5, 1, 1.5, 2, 3, 4, 6 */
            N(vf) mag = __builtin_convertvector(idx, N(vf)) * (0.5f * one);
            mag = N(vsel)(idx == 5 * ione, 3.0f * one, mag);
            mag = N(vsel)(idx == 6 * ione, 4.0f * one, mag);
            mag = N(vsel)(idx == 7 * ione, 6.0f * one, mag);
            const N(vi) neg = (a < 0.0f * one) & (idx > izero);
            C[extra][i] = idx | (neg & (8 * ione));
            const N(vf) v = N(vsel)(neg, -mag, mag), d = v * sv - x;
            const N(vf) sq = d * d;
            memcpy(T[i], &sq, sizeof sq);
        }
        N(tree_sum)(T, e[extra]);
    }
    for (int l = 0; l < nl; l++) {
        const int better = e[1][l] < e[0][l]; /* strictly: a tie or a NaN keeps the first */
        const int s0 = base[l] > 254 ? 254 : base[l];
        const N(vi) *src = C[better];
        uint8_t *out = blocks + l * (GROUP / 2);
        for (int i = 0; i < GROUP / 2; i++) out[i] = (uint8_t)(src[2 * i][l] | (src[2 * i + 1][l] << 4));
        scales[l] = (uint8_t)(better ? (s0 + 1 > 254 ? 254 : s0 + 1) : s0);
    }
}


/* elements [start, start + n) of a row of ``w`` (dtype 0 f32, 1 bf16, 2 f16: widened exactly) as
 * fp32 in out[0, n), zeros from ``valid`` on (the padding to a multiple of 32) */
static inline __attribute__((always_inline)) void N(widen)(const void *w, int dtype, int64_t start, int64_t valid,
                                                           int64_t n, float *out) {
    const int64_t m = valid < n ? valid : n;
    if (dtype == 1) {
        const uint16_t *src = (const uint16_t *)w + start;
        for (int64_t i = 0; i < m; i++) {
            const uint32_t u = (uint32_t)src[i] << 16;
            memcpy(out + i, &u, 4);
        }
    } else if (dtype == 2) {
        const uint16_t *src = (const uint16_t *)w + start;
        for (int64_t i = 0; i < m; i++) out[i] = half_to_float(src[i]);
    } else {
        memcpy(out, (const float *)w + start, (size_t)(m > 0 ? m : 0) * sizeof(float));
    }
    for (int64_t i = m > 0 ? m : 0; i < n; i++) out[i] = 0.0f;
}

/* rows [r0, r1) of a row-major matrix [rows, k] (k <= kp, kp a multiple of 32; columns k..kp are zeros) */
static void N(q4_rows)(const void *w, int dtype, int64_t r0, int64_t r1, int64_t k, int64_t kp, const float *cands,
                       int ncand, uint8_t *blocks, uint16_t *scales) {
    const int64_t groups = kp / GROUP;
    float buf[LANES * GROUP];
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < groups; g += LANES) {
            const int nl = groups - g < LANES ? (int)(groups - g) : LANES;
            const int64_t c0 = g * GROUP, n = (int64_t)nl * GROUP;
            const float *src = buf;
            if (dtype == 0 && c0 + n <= k) src = (const float *)w + r * k + c0;
            else N(widen)(w, dtype, r * k + c0, k - c0, n, buf);
            N(q4_lanes)(src, nl, cands, ncand, blocks + (r * groups + g) * (GROUP / 2), scales + r * groups + g);
        }
}

static void N(mx_rows)(const void *w, int dtype, int64_t r0, int64_t r1, int64_t k, int64_t kp, uint8_t *blocks,
                       uint8_t *scales) {
    const int64_t groups = kp / GROUP;
    float buf[LANES * GROUP];
    for (int64_t r = r0; r < r1; r++)
        for (int64_t g = 0; g < groups; g += LANES) {
            const int nl = groups - g < LANES ? (int)(groups - g) : LANES;
            const int64_t c0 = g * GROUP, n = (int64_t)nl * GROUP;
            const float *src = buf;
            if (dtype == 0 && c0 + n <= k) src = (const float *)w + r * k + c0;
            else N(widen)(w, dtype, r * k + c0, k - c0, n, buf);
            N(mx_lanes)(src, nl, blocks + (r * groups + g) * (GROUP / 2), scales + r * groups + g);
        }
}

/* int8 (quant/int8.py): rows [r0, r1), one at a time, widened into ``buf`` (kp floats). Per row
 * amax = max |w| (a NaN wins, as in torch); for each ratio the scale s = amax * ratio / 127 and the
 * squared error of round(w / (s > 0 ? s : 1)) clamped to [-127, 127], times s, minus w, summed
 * in a fixed order: per column j of the row's [kp / 32, 32] view the groups in order (acc_j +=
 * e[g][j], from 0), then the 32 column sums as the pairwise tree ((t0 + t1) + (t2 + t3)) + ...;
 * the first ratio with the strictly smallest error wins. Each group is GROUP / LANES vectors, so
 * the operations per element and their order do not depend on LANES. Levels are stored as int8,
 * a NaN level (a row holding inf or NaN) as 0; a NaN scale as the canonical 0x7fc00000. */
#define I8V (GROUP / LANES)

static inline __attribute__((always_inline)) N(vf) N(i8_level)(N(vf) x, N(vf) sd) {
    const N(vf) zero = {0}, lo = zero - 127.0f, hi = zero + 127.0f, big = zero + 12582912.0f;
    x = x / sd;
    x = N(vsel)(x < lo, lo, x);  /* NaN passes, as torch's clamp */
    x = N(vsel)(x > hi, hi, x);
    return (x + big) - big;       /* + 1.5 * 2^23 - 1.5 * 2^23: nearest, ties to even (|x| <= 127) */
}

static void N(int8_rows)(const void *w, int dtype, int64_t r0, int64_t r1, int64_t k, int64_t kp,
                         const float *ratios, int nratio, float *buf, int8_t *out, uint32_t *scales) {
    typedef int8_t N(vb) __attribute__((vector_size(LANES)));
    const int64_t groups = kp / GROUP;
    const N(vf) zero = {0};
    for (int64_t r = r0; r < r1; r++) {
        N(widen)(w, dtype, r * k, k, kp, buf);
        N(vu) am = {0};
        const N(vu) absmask = am + 0x7fffffffu;
        for (int64_t i = 0; i < kp; i += LANES) { /* |w| as bits: a NaN's exceed inf's */
            N(vu) u;
            memcpy(&u, buf + i, sizeof u);
            u &= absmask;
            am = (N(vu))N(vsel)((N(vi))(u > am), (N(vf))u, (N(vf))am);
        }
        uint32_t ab = 0;
        for (int l = 0; l < LANES; l++) ab = am[l] > ab ? am[l] : ab;
        float amax, best_s = 0.0f, best_e = 0.0f;
        memcpy(&amax, &ab, 4);
        for (int c = 0; c < nratio; c++) {
            const float s = amax * ratios[c] / 127.0f;
            const N(vf) sv = zero + s, sd = zero + (s > 0.0f ? s : 1.0f);
            N(vf) acc[I8V];
            for (int v = 0; v < I8V; v++) acc[v] = zero;
            for (int64_t g = 0; g < groups; g++)
                for (int v = 0; v < I8V; v++) {
                    N(vf) x;
                    memcpy(&x, buf + g * GROUP + v * LANES, sizeof x);
                    const N(vf) d = N(i8_level)(x, sd) * sv - x;
                    acc[v] = acc[v] + d * d;
                }
            float t[GROUP];
            memcpy(t, acc, sizeof t);
            for (int n = GROUP / 2; n >= 1; n /= 2)
                for (int i = 0; i < n; i++) t[i] = t[2 * i] + t[2 * i + 1];
            if (c == 0 || t[0] < best_e) { /* strictly: a tie or a NaN keeps the earlier ratio */
                best_e = t[0];
                best_s = s;
            }
        }
        const N(vf) sd = zero + (best_s > 0.0f ? best_s : 1.0f);
        int8_t *o = out + r * kp;
        for (int64_t i = 0; i < kp; i += LANES) {
            N(vf) x;
            memcpy(&x, buf + i, sizeof x);
            x = N(i8_level)(x, sd);
            x = N(vsel)(x != x, zero, x);
            const N(vb) b = __builtin_convertvector(__builtin_convertvector(x, N(vi)), N(vb));
            memcpy(o + i, &b, sizeof b);
        }
        uint32_t sb;
        memcpy(&sb, &best_s, 4);
        scales[r] = best_s != best_s ? 0x7fc00000u : sb;
    }
}
#undef I8V

/* rvq3's assignment: for each of the m 8-dim points p, the index of the nearest of the 256 centroids
 * (given as ct [8][256] and their squared norms cn [256]) by |c|^2 - 2 p.c (products summed as a
 * fixed tree), the lowest index on a tie, and the squared distance |p|^2 + that (at least 0). Four
 * points at a time (independent chains). The same operations in the same order for every LANES
 * (no contraction), so every copy gives the same codes. */
#define RVQ_PTS 4
static void N(rvq_nearest)(const float *pts, int64_t m, const float *ct, const float *cn, int32_t *idx,
                           float *dist) {
    N(vi) lane;
    for (int l = 0; l < LANES; l++) lane[l] = l;
    for (int64_t i0 = 0; i0 < m; i0 += RVQ_PTS) {
        float a[RVQ_PTS][8];
        for (int q = 0; q < RVQ_PTS; q++) {
            const float *p = pts + (i0 + q < m ? i0 + q : m - 1) * 8;
            for (int d = 0; d < 8; d++) a[q][d] = -2.0f * p[d];
        }
        N(vf) best[RVQ_PTS];
        N(vi) bj[RVQ_PTS];
        for (int q = 0; q < RVQ_PTS; q++) {
            best[q] = (N(vf)){0} + __builtin_inff();
            bj[q] = (N(vi)){0};
        }
        for (int j = 0; j < 256; j += LANES) {
            N(vf) c[8], cnv;
            memcpy(&cnv, cn + j, sizeof cnv);
            for (int d = 0; d < 8; d++) memcpy(&c[d], ct + d * 256 + j, sizeof cnv);
            const N(vi) lj = lane + j;
            for (int q = 0; q < RVQ_PTS; q++) {
                const N(vf) acc = cnv + (((a[q][0] * c[0] + a[q][1] * c[1]) + (a[q][2] * c[2] + a[q][3] * c[3])) +
                                         ((a[q][4] * c[4] + a[q][5] * c[5]) + (a[q][6] * c[6] + a[q][7] * c[7])));
                const N(vi) lt = acc < best[q];
                best[q] = N(vsel)(lt, acc, best[q]);
                bj[q] = (N(vi))N(vsel)(lt, (N(vf))lj, (N(vf))bj[q]);
            }
        }
        for (int q = 0; q < RVQ_PTS && i0 + q < m; q++) {
            float bv = best[q][0]; /* the smallest value, then the lowest index holding it (branch-free) */
            for (int l = 1; l < LANES; l++) bv = best[q][l] < bv ? best[q][l] : bv;
            int32_t bi = 256;
            for (int l = 0; l < LANES; l++) {
                const int32_t cand = best[q][l] == bv ? bj[q][l] : 256;
                bi = cand < bi ? cand : bi;
            }
            idx[i0 + q] = bi == 256 ? 0 : bi; /* 256: every distance NaN */
            if (dist) {
                const float *p = pts + (i0 + q) * 8;
                const float pp = ((p[0] * p[0] + p[1] * p[1]) + (p[2] * p[2] + p[3] * p[3])) +
                                 ((p[4] * p[4] + p[5] * p[5]) + (p[6] * p[6] + p[7] * p[7]));
                dist[i0 + q] = bv + pp > 0.0f ? bv + pp : 0.0f;
            }
        }
    }
}
#undef RVQ_PTS

#undef N
#undef N1
#undef N2
