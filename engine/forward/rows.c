/* The per-row pieces of a layer on packed weights (engine/forward/model_runner.py's packed
   forward) around the products of products.c: RMSNorm, and RoPE with the pool's writes.

   Why in C: MLX's CPU RoPE with per-row positions and the pool's scatter cost an
   evaluation each, a large part of a SmolLM2 decode step; here they cost next to
   nothing. RoPE's angles still come from the model's own MLX rope module (once a
   step, for every layer: see rope_table in the runner), so every rope variant mlx-lm
   builds (scaled, YaRN, ...) rotates the same way. */

#include <math.h>
#include <stdint.h>
#include <string.h>

/* out = x / sqrt(mean(x**2) + eps) * weight, row by row, for x [rows, dim] (RMSNorm, as
   MLX composes it: the row's scale first, then the weight). */
void batchd_rms_norm(const float *x, const float *weight, float *out, int64_t rows,
                     int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float *row = x + r * dim;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < dim; i++) total += row[i] * row[i];
    const float scale = 1.0f / sqrtf(total / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[r * dim + i] = row[i] * scale * weight[i];
  }
}

/* Rotate one head of dim floats by the table row t: with traditional, pairs (2i, 2i + 1)
   by (t[2i], t[2i + 1]); else pairs (i, i + dim / 2) by (t[i], t[i + dim / 2]). A pair
   (x, y) becomes (x a - y b, x b + y a). */
static void rotate(const float *x, const float *t, float *out, int dim, int traditional) {
  const int half = dim / 2;
  for (int i = 0; i < half; i++) {
    const int xi = traditional ? 2 * i : i, yi = traditional ? 2 * i + 1 : i + half;
    const float a = t[xi], b = t[yi];
    const float x0 = x[xi], y0 = x[yi];
    out[xi] = x0 * a - y0 * b;
    out[yi] = x0 * b + y0 * a;
  }
}

/* From qkv [n, (heads + 2 kv_heads) * dim] (a packed product's output): the queries,
   normed per head when q_norm is given (qwen3) and rotated, into q_out [n, heads, dim];
   the keys, likewise, and the values into the pool k_pool / v_pool [kv_heads, pool_slots,
   dim] at row slots[r]. table [n, dim] holds each row's rotation (see rotate). Returns 0,
   or -1 for a slot outside the pool or an odd dim. */
int batchd_rope_store(const float *qkv, int64_t n, int heads, int kv_heads, int dim,
                      const float *table, int traditional, const float *q_norm,
                      const float *k_norm, float norm_eps, float *q_out, float *k_pool,
                      float *v_pool, int64_t pool_slots, const int32_t *slots) {
  if (dim % 2 != 0 || dim > 1024) return -1;
  for (int64_t r = 0; r < n; r++) {
    if (slots[r] < 0 || slots[r] >= pool_slots) return -1;
  }
  const int64_t width = (int64_t)(heads + 2 * kv_heads) * dim;
  float normed[1024];
  for (int64_t r = 0; r < n; r++) {
    const float *row = qkv + r * width, *t = table + r * dim;
    for (int h = 0; h < heads + kv_heads; h++) {
      const float *x = row + (int64_t)h * dim;
      const float *weight = h < heads ? q_norm : k_norm;
      if (weight) {
        batchd_rms_norm(x, weight, normed, 1, dim, norm_eps);
        x = normed;
      }
      float *out = h < heads ? q_out + (r * heads + h) * dim
                             : k_pool + ((int64_t)(h - heads) * pool_slots + slots[r]) * dim;
      rotate(x, t, out, dim, traditional);
    }
    for (int h = 0; h < kv_heads; h++) {
      memcpy(v_pool + ((int64_t)h * pool_slots + slots[r]) * dim,
             row + (int64_t)(heads + kv_heads + h) * dim, sizeof(float) * (size_t)dim);
    }
  }
  return 0;
}
