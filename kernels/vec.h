/* What the CPU kernels (decode_attn.c, skinny_linear.c, rotate_band.c) share: 16-float
 * vectors (GCC vector extensions: AVX-512 where -march=native has it, AVX2 pairs otherwise)
 * and reading fp32 or bf16 rows and elements into them. cbuild.py keys a kernel's build on
 * this file too. */
#ifndef LEYLINE_VEC_H
#define LEYLINE_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));

#define INLINE static inline __attribute__((always_inline))

INLINE v16 ld(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void st(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* rows are fp32 or bf16: element idx of base (BF is a compile-time constant where inlined
   into an instance, a plain flag elsewhere) */
INLINE const void *at(const void *base, int64_t idx, const int BF) {
    return (const char *)base + idx * (BF ? 2 : 4);
}

/* 16 elements from idx on, widened to fp32 (bf16 = the top half of fp32) */
INLINE v16 ld_row(const void *base, int64_t idx, const int BF) {
    if (!BF) return ld((const float *)base + idx);
    h16v h;
    memcpy(&h, (const uint16_t *)base + idx, sizeof h);
    return (v16)(__builtin_convertvector(h, i16v) << 16);
}

/* element idx of base, widened to fp32 */
INLINE float ld1(const void *base, int64_t idx, const int BF) {
    if (!BF) return ((const float *)base)[idx];
    uint32_t u = (uint32_t)((const uint16_t *)base)[idx] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE float hsum(v16 a) {
    v8 h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

#endif
