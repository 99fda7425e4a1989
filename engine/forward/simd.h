/* The float vector type the C kernels share (paged_decode.c, products.c): one register of
   the machine's widest vectors, AVX-512's 16 floats or AVX2's 8. */

#ifndef BATCHD_SIMD_H
#define BATCHD_SIMD_H

#include <string.h>

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif
typedef float vec __attribute__((vector_size(VL * sizeof(float))));

static inline vec load_vec(const float *p) {
  vec x;
  memcpy(&x, p, sizeof x);
  return x;
}

#endif
