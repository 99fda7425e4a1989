/* Decode attention over the paged KV pool, reading each key and value row in place.

   Why: MLX has no gather-free attention on the CPU, so the MLX path first copies
   every decoding sequence's blocks into a contiguous array (on SmolLM2-135M, 32
   sequences of ~330 tokens, the gathers are half of decode attention's time) and
   then reads that copy again. Here each (sequence, KV head) task walks its block
   table once, computing the scores of all the query heads that share the KV head
   from one read of each key row, then their weighted sums from one read of each
   value row. Softmax uses the same Cephes exp as engine/forward/fast_math.py.

   Layouts (float32, row-major): q and out [batch, heads, dim]; k and v
   [kv_heads, slots, dim]; tables [batch, width] block ids; lengths [batch] keys
   to attend (the new token included). Query head h reads KV head h / group. */

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_THREADS 16

typedef struct {
  const float *q, *k, *v;
  const int32_t *tables, *lengths;
  float *out;
  int64_t slots;
  int heads, kv_heads, dim, width, block_size;
  float scale;
  int first, last; /* this worker's tasks: [first, last) of batch * kv_heads */
  int failed;
} Work;

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

/* The rows from position t0 of a sequence that lie in one block (*rows of them, consecutive
   in the pool): block by block, a walk over a block table reads memory in order. */
static inline const float *block_at(const float *pool, const int32_t *table, int t0, int length,
                                    int bs, int dim, int *rows) {
  *rows = length - t0 < bs ? length - t0 : bs;
  return pool + (int64_t)table[t0 / bs] * bs * dim;
}

static void attend(const Work *w, int task, float *scores) {
  const int b = task / w->kv_heads, h = task % w->kv_heads;
  const int group = w->heads / w->kv_heads, dim = w->dim, bs = w->block_size;
  const int length = w->lengths[b];
  const int32_t *table = w->tables + (int64_t)b * w->width;
  const float *keys = w->k + (int64_t)h * w->slots * dim;
  const float *values = w->v + (int64_t)h * w->slots * dim;
  const int64_t head0 = ((int64_t)b * w->heads + (int64_t)h * group) * dim;
  const float *q = w->q + head0;
  float *out = w->out + head0;

  int rows;
  for (int t0 = 0; t0 < length; t0 += bs) {
    const float *block = block_at(keys, table, t0, length, bs, dim, &rows);
    for (int j = 0; j < rows; j++) {
      const float *key = block + (int64_t)j * dim;
      for (int g = 0; g < group; g++) {
        const float *qg = q + (int64_t)g * dim;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < dim; d++) acc += qg[d] * key[d];
        scores[(int64_t)g * length + t0 + j] = acc * w->scale;
      }
    }
  }
  for (int g = 0; g < group; g++) {
    float *s = scores + (int64_t)g * length;
    float best = s[0], total = 0.0f;
    for (int t = 1; t < length; t++) best = s[t] > best ? s[t] : best;
#pragma omp simd reduction(+ : total)
    for (int t = 0; t < length; t++) {
      s[t] = exp_clamped(s[t] - best);
      total += s[t];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int t = 0; t < length; t++) s[t] *= inv;
    for (int d = 0; d < dim; d++) out[(int64_t)g * dim + d] = 0.0f;
  }
  for (int t0 = 0; t0 < length; t0 += bs) {
    const float *block = block_at(values, table, t0, length, bs, dim, &rows);
    for (int j = 0; j < rows; j++) {
      const float *value = block + (int64_t)j * dim;
      for (int g = 0; g < group; g++) {
        const float weight = scores[(int64_t)g * length + t0 + j];
        float *o = out + (int64_t)g * dim;
#pragma omp simd
        for (int d = 0; d < dim; d++) o[d] += weight * value[d];
      }
    }
  }
}

static void *run(void *arg) {
  Work *w = (Work *)arg;
  int longest = 1;
  for (int task = w->first; task < w->last; task++) {
    int length = w->lengths[task / w->kv_heads];
    longest = length > longest ? length : longest;
  }
  float *scores = malloc(sizeof(float) * (size_t)longest * (size_t)(w->heads / w->kv_heads));
  if (scores == NULL) {
    w->failed = 1;
    return NULL;
  }
  for (int task = w->first; task < w->last; task++) attend(w, task, scores);
  free(scores);
  return NULL;
}

/* Returns 0 on success, -1 on bad arguments, -2 when memory or threads ran out. */
int batchd_paged_decode(const float *q, const float *k, const float *v, const int32_t *tables,
                        const int32_t *lengths, float *out, int batch, int heads, int kv_heads,
                        int dim, int64_t slots, int width, int block_size, float scale,
                        int threads) {
  if (batch < 1 || kv_heads < 1 || heads % kv_heads != 0 || dim < 1 || block_size < 1)
    return -1;
  for (int b = 0; b < batch; b++) {
    if (lengths[b] < 1 || lengths[b] > (int64_t)width * block_size) return -1;
  }
  threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
  const int tasks = batch * kv_heads;
  if (threads > tasks) threads = tasks;
  /* Cut the tasks into runs of about equal work (keys read) per thread. */
  int64_t total = 0;
  for (int b = 0; b < batch; b++) total += (int64_t)lengths[b] * kv_heads;
  Work work[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  int first = 0;
  int64_t done = 0;
  for (int i = 0; i < threads; i++) {
    int last = first;
    const int64_t goal = total * (i + 1) / threads;
    while (last < tasks && (i == threads - 1 || done < goal)) {
      done += lengths[last / kv_heads];
      last++;
    }
    work[i] = (Work){q, k, v, tables, lengths, out, slots, heads, kv_heads, dim, width,
                     block_size, scale, first, last, 0};
    first = last;
  }
  int started = 0;
  for (int i = 1; i < threads; i++) {
    if (pthread_create(&ids[i], NULL, run, &work[i]) != 0) break;
    started = i;
  }
  for (int i = started + 1; i < threads; i++) run(&work[i]); /* threads that did not start */
  run(&work[0]);
  int failed = work[0].failed;
  for (int i = 1; i < threads; i++) {
    if (i <= started) pthread_join(ids[i], NULL);
    failed |= work[i].failed;
  }
  return failed ? -2 : 0;
}

/* out = silu(gate) * up = gate / (1 + e**-gate) * up, elementwise over n floats. */
void batchd_swiglu(const float *gate, const float *up, float *out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    const float e = exp_clamped(-gate[i]);
    out[i] = gate[i] / (1.0f + e) * up[i];
  }
}
