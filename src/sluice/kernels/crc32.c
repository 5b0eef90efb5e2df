/*
 * CRC-32 (the zlib / IEEE 802.3 polynomial, bit-reflected) with carry-less multiplication.
 *
 * The same function as zlib's crc32(), so the values stored in containers do not change:
 * this only computes them faster. Folds four 128-bit lanes per 64-byte block with PCLMULQDQ,
 * then reduces to 32 bits with Barrett reduction (Gopal et al., "Fast CRC Computation for
 * Generic Polynomials Using PCLMULQDQ Instruction", Intel, 2009; the constants are the
 * paper's bit-reflected ones for this polynomial, as used by Chromium's zlib and Linux).
 *
 * sk_crc32_fold(crc, buf, len): len >= 64 and a multiple of 16; crc is zlib's running value
 * (the caller hands the tail, len % 16 bytes, to zlib). Callers check sk_has_clmul() first.
 */
#define _XOPEN_SOURCE 700 /* pread under -std=c11 */
#include "sk.h"

#include <errno.h>
#include <sys/types.h>
#include <unistd.h>

#define CLMUL __attribute__((target("pclmul,sse4.1")))

EXPORT int sk_has_clmul(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}

CLMUL static uint32_t fold(const unsigned char *buf, size_t len, uint32_t crc) {
    static const uint64_t __attribute__((aligned(16))) k1k2[] = {0x0154442bd4, 0x01c6e41596};
    static const uint64_t __attribute__((aligned(16))) k3k4[] = {0x01751997d0, 0x00ccaa009e};
    static const uint64_t __attribute__((aligned(16))) k5k0[] = {0x0163cd6124, 0x0000000000};
    static const uint64_t __attribute__((aligned(16))) poly[] = {0x01db710641, 0x01f7011641};
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;

    x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    x0 = _mm_load_si128((const __m128i *)k1k2);
    buf += 64;
    len -= 64;

    while (len >= 64) { /* four lanes folded 512 bits ahead */
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
        buf += 64;
        len -= 64;
    }

    /* four lanes into one */
    x0 = _mm_load_si128((const __m128i *)k3k4);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);

    while (len >= 16) { /* remaining 16-byte blocks */
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }

    /* 128 -> 64 bits */
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_srli_si128(x1, 8);
    x1 = _mm_xor_si128(x1, x2);
    x0 = _mm_loadl_epi64((const __m128i *)k5k0);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);

    /* Barrett reduction to 32 bits */
    x0 = _mm_load_si128((const __m128i *)poly);
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

/*
 * The same folding, 16 lanes at a time: four 512-bit registers folded 2048 bits ahead with
 * VPCLMULQDQ (AVX-512), then into one register (512 bits ahead), then the 64 bytes of state
 * and the last < 256 bytes of data finish through fold() above (folding keeps the residue, so
 * the state stands in for all the data before it). Constants: x^(D+32) and x^(D-32) mod P,
 * bit-reflected, for D = 2048 (computed; D = 512 reuses k1k2).
 */
#define VCLMUL __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))

static int has_vclmul(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
           __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
}

VCLMUL static inline __m512i fold512(__m512i x, __m512i k, __m512i next) {
    __m512i lo = _mm512_clmulepi64_epi128(x, k, 0x00);
    __m512i hi = _mm512_clmulepi64_epi128(x, k, 0x11);
    return _mm512_ternarylogic_epi64(lo, hi, next, 0x96); /* lo ^ hi ^ next */
}

VCLMUL static uint32_t fold_wide(const unsigned char *buf, size_t len, uint32_t crc) {
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x01322d1430, 0x011542778a));
    const __m512i k512 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x01c6e41596, 0x0154442bd4));
    __m512i z0 = _mm512_loadu_si512((const void *)(buf + 0x00));
    __m512i z1 = _mm512_loadu_si512((const void *)(buf + 0x40));
    __m512i z2 = _mm512_loadu_si512((const void *)(buf + 0x80));
    __m512i z3 = _mm512_loadu_si512((const void *)(buf + 0xc0));
    z0 = _mm512_xor_si512(z0, _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)crc), 0));
    buf += 256;
    len -= 256;
    while (len >= 256) {
        z0 = fold512(z0, k2048, _mm512_loadu_si512((const void *)(buf + 0x00)));
        z1 = fold512(z1, k2048, _mm512_loadu_si512((const void *)(buf + 0x40)));
        z2 = fold512(z2, k2048, _mm512_loadu_si512((const void *)(buf + 0x80)));
        z3 = fold512(z3, k2048, _mm512_loadu_si512((const void *)(buf + 0xc0)));
        buf += 256;
        len -= 256;
    }
    z0 = fold512(z0, k512, z1);
    z0 = fold512(z0, k512, z2);
    z0 = fold512(z0, k512, z3);
    unsigned char tail[64 + 256];
    _mm512_storeu_si512((void *)tail, z0);
    memcpy(tail + 64, buf, len); /* len < 256, a multiple of 16 */
    return fold(tail, 64 + len, 0);
}

EXPORT uint32_t sk_crc32_fold(uint32_t crc, const unsigned char *buf, size_t len) {
    static int wide = -1;
    if (wide < 0)
        wide = has_vclmul();
    if (wide && len >= 1024)
        return ~fold_wide(buf, len, ~crc);
    return ~fold(buf, len, ~crc);
}

/* zlib's CRC-32 of a few bytes (the tail past the last 16-byte block), bit by bit. */
static uint32_t crc_bytes(uint32_t crc, const unsigned char *buf, size_t len) {
    crc = ~crc;
    for (size_t i = 0; i < len; i++) {
        crc ^= buf[i];
        for (int b = 0; b < 8; b++)
            crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

/*
 * sk_pread_crc32(fd, buf, len, offset, crc_out): read len bytes at offset from fd into buf (as
 * pread(2), repeated over short reads and EINTR) and store zlib's CRC-32 of the bytes read in
 * *crc_out. Returns the bytes read (fewer than len only at the end of the file) or -errno.
 * One call for a disk tier hit: called through ctypes.CDLL, it runs the read and the check
 * without the GIL, so the reading thread takes the GIL back once. Callers check sk_has_clmul().
 */
EXPORT int64_t sk_pread_crc32(int fd, unsigned char *buf, size_t len, int64_t offset, uint32_t *crc_out) {
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, buf + got, len - got, (off_t)(offset + (int64_t)got));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -(int64_t)errno;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    size_t bulk = got >= 64 ? got & ~(size_t)15 : 0;
    uint32_t crc = bulk ? sk_crc32_fold(0, buf, bulk) : 0;
    *crc_out = crc_bytes(crc, buf + bulk, got - bulk);
    return (int64_t)got;
}
