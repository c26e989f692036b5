/* Finiteness on the CPU, written once for every pass that tells it (_nonfinite.c's scan, _ddp_hook.cpp's
 * division of a DDP bucket): an IEEE float is NaN or Inf exactly when all its exponent bits are set, and
 * adding one to the exponent field of such an element carries into the sign bit, and of no other. So
 * CARRY_<width>(bits) has its sign bit set (NONFINITE_<width>) exactly for NaN and Inf: an AND and an ADD
 * per element in unsigned integers, ORed over a run and tested once, a loop compilers vectorise. */
#ifndef COMMLENS_FINITE_H
#define COMMLENS_FINITE_H

#include <stdint.h>

#define CARRY32(bits) ((uint32_t)(((bits) & 0x7f800000u) + 0x00800000u))                      /* float32 */
#define CARRY64(bits) ((uint64_t)(((bits) & 0x7ff0000000000000ull) + 0x0010000000000000ull))  /* float64 */
#define CARRY16(bits) ((uint16_t)(((bits) & 0x7c00u) + 0x0400u))                              /* float16 */
#define CARRY_BF16(bits) ((uint16_t)(((bits) & 0x7f80u) + 0x0080u))                           /* bfloat16 */
#define NONFINITE32 0x80000000u
/* The exponent field: a pass that also wants the values' scale takes its largest, all ones exactly where a
 * value is NaN or Inf. */
#define EXPONENT32(bits) ((uint32_t)((bits) & 0x7f800000u))
#define EXPONENT64(bits) ((uint64_t)((bits) & 0x7ff0000000000000ull))
#define EXPONENT16(bits) ((uint16_t)((bits) & 0x7c00u))   /* float16 */
#define EXPONENT_BF16(bits) ((uint16_t)((bits) & 0x7f80u)) /* bfloat16 */
#define NONFINITE64 0x8000000000000000ull
#define NONFINITE16 0x8000u

/* On x86-64 Linux, copies of a pass for CPUs with AVX-512 (64 bytes an instruction) and AVX2 (32),
 * chosen when the library loads; elsewhere (aarch64's NEON, macOS) the one the compiler vectorises. */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define WITH_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef WITH_SIMD_CLONES
#define WITH_SIMD_CLONES
#endif

#endif
