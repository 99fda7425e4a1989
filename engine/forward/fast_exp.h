/* The Cephes exp shared by the C kernels (paged_decode.c, products.c): the same as
   engine/forward/fast_math.py computes. */

#ifndef BATCHD_FAST_EXP_H
#define BATCHD_FAST_EXP_H

#include <stdint.h>

/* e**x clamped to [e**-87, e**88], as fast_math.exp computes it (Cephes expf). */
static inline float exp_clamped(float x) {
  x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
  int biased = (int)(x * 1.4426950408889634f + 127.5f);
  float n = (float)(biased - 127);
  float r = x - n * 0.693359375f - n * -2.12194440e-4f;
  float p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  union {
    int32_t i;
    float f;
  } bits = {.i = biased << 23};
  return (p * (r * r) + r + 1.0f) * bits.f;
}

#endif
