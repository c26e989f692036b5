/* A collective's result as one number, for C and C++ alike: the Python function (_fingerprint.c), the C
 * all_reduce and the DDP hook compute the same.
 *
 * The number is two sums over the bytes as uint32 words w_i, in one pass the compiler vectorises: the
 * weighted sum of w_i * (2i + 1) mod 2^32, which any flipped bit changes (each weight is odd, so a
 * change of +-2^b in one word is never 0 mod 2^32) and which two words swapped change unless their
 * difference is 0 mod 2^31 / (j - i); and the plain sum's low 16 bits beside it: 48 bits in all, so that
 * a Prometheus sample (a float64) holds it exactly. The tail (nbytes % 4) is added as a last word. */
#ifndef COMMLENS_FINGERPRINT_H
#define COMMLENS_FINGERPRINT_H

#include <stdint.h>
#include <string.h>

#include "_finite.h"

/* Over this many bytes a caller holding the GIL lets other threads run while it hashes (it holds the tensor). */
#define FINGERPRINT_HOLDING_THE_GIL (1 << 20)

/* A word read from any address: a tensor of 1- or 2-byte elements may begin at an odd one. */
typedef uint32_t __attribute__((aligned(1), may_alias)) fingerprint_word;

WITH_SIMD_CLONES
static uint64_t fingerprint_sums(const fingerprint_word *w, int64_t n, uint32_t *plain) {
    uint32_t weighted = 0, sum = 0;
    for (int64_t i = 0; i < n; i++) {
        weighted += w[i] * (uint32_t)(2 * i + 1);
        sum += w[i];
    }
    *plain = sum;
    return weighted;
}

static inline uint64_t fingerprint_of(const unsigned char *bytes, int64_t nbytes) {
    int64_t words = nbytes / 4;
    uint32_t plain, tail = 0;
    uint64_t weighted = fingerprint_sums((const fingerprint_word *)bytes, words, &plain);
    if (nbytes % 4) {
        memcpy(&tail, bytes + 4 * words, (size_t)(nbytes % 4));
        weighted = (uint32_t)(weighted + tail * (uint32_t)(2 * words + 1));
        plain += tail;
    }
    return weighted | (uint64_t)(plain & 0xffffu) << 32;
}

#endif
