/*
 * Internal interface shared by Sluice's C kernel files (nothing here is exported).
 */
#ifndef SLUICE_SK_H
#define SLUICE_SK_H

#include <stdint.h>
#include <string.h>
#include <immintrin.h>

#define EXPORT __attribute__((visibility("default")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* fn(ctx, i0, i1) processes items [i0, i1). */
typedef void (*sk_range_fn)(void *ctx, int i0, int i1);

/*
 * Run fn over items [0, nitems) in chunks of `chunk` items on the calling thread plus up to
 * nthreads - 1 pool workers. Chunks are claimed dynamically, so a worker that is asleep or
 * descheduled never holds the caller up beyond the chunk it already took. Which thread runs
 * a chunk never changes what the chunk computes.
 */
void sk_parallel(sk_range_fn fn, void *ctx, int nitems, int chunk, int nthreads);

/* 1 when AVX2 + FMA + F16C are usable (and SLUICE_KERNELS_PORTABLE is not set to 1). */
int sk_avx2(void);

/* Instruction-set levels the kernels dispatch on at run time. Every level gives the same bits
 * as SK_ISA_AVX2: wider paths keep its per-output accumulation order (tested against it). */
enum { SK_ISA_PORTABLE = 0, SK_ISA_AVX2 = 1, SK_ISA_AVX512 = 2 /* AVX-512F */,
       SK_ISA_VNNI512 = 3 /* + AVX512-BW, -VL, -VNNI */ };

/* The level in use: the CPU's, capped by SLUICE_KERNELS_NO_AVX512 and sk_set_isa_cap. */
int sk_isa(void);

#define AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* Per-thread scratch memory of at least `bytes` (64-byte aligned, grows, never freed). */
void *sk_scratch(int which, size_t bytes);

/* Rows per chunk so that one chunk holds about 32 KiB of weights (at least 4 rows). */
int sk_chunk_rows(size_t row_bytes, int nrows);

static inline float sk_bf16_to_f32(uint16_t v) {
    uint32_t u = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float sk_f16_to_f32(uint16_t h);

/* ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)): the order every kernel's portable
 * path repeats, so that lane sums are reproducible. */
AVX2 static inline float sk_hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    lo = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, lo);
    return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

static inline float sk_hsum8_c(const float *a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

#endif
