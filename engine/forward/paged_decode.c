/* Decode attention over the paged KV pool, reading each key and value row in place.

   Why: MLX has no gather-free attention on the CPU, so the MLX path first copies
   every decoding sequence's blocks into a contiguous array (on SmolLM2-135M, 32
   sequences of ~330 tokens, the gathers are half of decode attention's time) and
   then reads that copy again. Here each (sequence, KV head) task walks its block
   table once, computing the scores of all the query heads that share the KV head
   from one read of each key row, then their weighted sums. Softmax uses the same
   Cephes exp as engine/forward/fast_math.py.

   Where it goes: a decode step's attention reads every key and value of its sequences
   once a layer; the vector path below reads them at about what the memory gives on
   AVX-512 cores, and on AVX2 cores walking blocks scattered over the pool bounds it
   (prefetching the next block measured no faster).

   Layouts (float32, row-major): q and out [batch, heads, dim]; k and v
   [kv_heads, slots, dim]; tables [batch, width] block ids; lengths [batch] keys
   to attend (the new token included). Query head h reads KV head h / group. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#include "team.h"

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

/* s[t] = e**(s[t] - max s) for t < length, in place; returns 1 / their sum (the softmax's
   normaliser, applied by the caller where it suits it). */
static inline float exp_from_max(float *s, int length) {
  float best = s[0], total = 0.0f;
  for (int t = 1; t < length; t++) best = s[t] > best ? s[t] : best;
#pragma omp simd reduction(+ : total)
  for (int t = 0; t < length; t++) {
    s[t] = exp_clamped(s[t] - best);
    total += s[t];
  }
  return 1.0f / total;
}

/* The rows from position t0 of a sequence that lie in one block (*rows of them, consecutive
   in the pool): block by block, a walk over a block table reads memory in order. */
static inline const float *block_at(const float *pool, const int32_t *table, int t0, int length,
                                    int bs, int dim, int *rows) {
  *rows = length - t0 < bs ? length - t0 : bs;
  return pool + (int64_t)table[t0 / bs] * bs * dim;
}

/* One task: a sequence's query heads that share one KV head, and where its rows live. */
typedef struct {
  int group, length;
  const int32_t *table;
  const float *keys, *values, *q;
  float *out;
} Task;

static inline Task task_view(const Work *w, int task) {
  const int b = task / w->kv_heads, h = task % w->kv_heads;
  const int group = w->heads / w->kv_heads;
  const int64_t head0 = ((int64_t)b * w->heads + (int64_t)h * group) * w->dim;
  const int64_t kv0 = (int64_t)h * w->slots * w->dim;
  return (Task){.group = group,
                .length = w->lengths[b],
                .table = w->tables + (int64_t)b * w->width,
                .keys = w->k + kv0,
                .values = w->v + kv0,
                .q = w->q + head0,
                .out = w->out + head0};
}

static void attend(const Work *w, int task, float *scores) {
  const Task tk = task_view(w, task);
  const int group = tk.group, dim = w->dim, bs = w->block_size, length = tk.length;

  int rows;
  for (int t0 = 0; t0 < length; t0 += bs) {
    const float *block = block_at(tk.keys, tk.table, t0, length, bs, dim, &rows);
    for (int j = 0; j < rows; j++) {
      const float *key = block + (int64_t)j * dim;
      for (int g = 0; g < group; g++) {
        const float *qg = tk.q + (int64_t)g * dim;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < dim; d++) acc += qg[d] * key[d];
        scores[(int64_t)g * length + t0 + j] = acc * w->scale;
      }
    }
  }
  for (int g = 0; g < group; g++) {
    float *s = scores + (int64_t)g * length;
    const float inv = exp_from_max(s, length);
#pragma omp simd
    for (int t = 0; t < length; t++) s[t] *= inv;
    for (int d = 0; d < dim; d++) tk.out[(int64_t)g * dim + d] = 0.0f;
  }
  for (int t0 = 0; t0 < length; t0 += bs) {
    const float *block = block_at(tk.values, tk.table, t0, length, bs, dim, &rows);
    for (int j = 0; j < rows; j++) {
      const float *value = block + (int64_t)j * dim;
      for (int g = 0; g < group; g++) {
        const float weight = scores[(int64_t)g * length + t0 + j];
        float *o = tk.out + (int64_t)g * dim;
#pragma omp simd
        for (int d = 0; d < dim; d++) o[d] += weight * value[d];
      }
    }
  }
}


#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
/* Head sizes that are a multiple of VL take a vector path: a VL-float vector type as wide
   as the machine's registers (16 floats, one AVX-512 register; else 8, one AVX2 register
   or two NEON ones). The plain loops above spend ~150 cycles a key row on 3 query heads (a
   horizontal sum per dot product, the output rows loaded and stored for every key); here a
   key's products stay vectors and one shuffle tree sums VL keys' vectors at once, and the
   weighted sum of values runs in registers. A vector wider than the registers is slower
   than the plain loops: it spills to the stack. */
#define VECTOR_PATH 1
#include "simd.h"

/* fold<run>(a, b): the lanes of a and b taken in runs of `run`, the first run of each
   pair of runs from a and b alternately, added to the second runs: every output run is
   the sum of two runs of one input. LANE is the source of output lane i (0 to VL-1 in a,
   VL to 2VL-1 in b) among the first runs; the second runs are `run` lanes further on. */
#define LANE(run, i) ((i) / (run) / 2 * 2 * (run) + (i) % (run) + (i) / (run) % 2 * VL)
#define LANES8(run, o)                                                                    \
  LANE(run, 0) + o, LANE(run, 1) + o, LANE(run, 2) + o, LANE(run, 3) + o, LANE(run, 4) + o, \
      LANE(run, 5) + o, LANE(run, 6) + o, LANE(run, 7) + o
#if VL == 16
#define LANES(run, o)                                                                     \
  LANES8(run, o), LANE(run, 8) + o, LANE(run, 9) + o, LANE(run, 10) + o, LANE(run, 11) + o, \
      LANE(run, 12) + o, LANE(run, 13) + o, LANE(run, 14) + o, LANE(run, 15) + o
#else
#define LANES(run, o) LANES8(run, o)
#endif
#define FOLD(run)                                                  \
  static inline vec fold##run(vec a, vec b) {                      \
    return __builtin_shufflevector(a, b, LANES(run, 0)) +          \
           __builtin_shufflevector(a, b, LANES(run, run));         \
  }
#if VL == 16
FOLD(8)
#endif
FOLD(4)
FOLD(2)
FOLD(1)

/* Lane j of the result is the sum of the lanes of p[BITREV[j]]: the tree of folds leaves
   lane j holding the vector it was given in position bit-reversed j, so vectors stored
   at BITREV[key] come out in key order. */
#if VL == 16
static const int BITREV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
static inline vec sum_lanes(const vec *p) {
  vec a = fold8(p[0], p[1]), b = fold8(p[2], p[3]), c = fold8(p[4], p[5]);
  vec d = fold8(p[6], p[7]), e = fold8(p[8], p[9]), f = fold8(p[10], p[11]);
  vec g = fold8(p[12], p[13]), h = fold8(p[14], p[15]);
  return fold1(fold2(fold4(a, b), fold4(c, d)), fold2(fold4(e, f), fold4(g, h)));
}
#else
static const int BITREV[8] = {0, 4, 2, 6, 1, 5, 3, 7};
static inline vec sum_lanes(const vec *p) {
  vec a = fold4(p[0], p[1]), b = fold4(p[2], p[3]), c = fold4(p[4], p[5]);
  vec d = fold4(p[6], p[7]);
  return fold1(fold2(a, b), fold2(c, d));
}
#endif

/* Most vectors a head of up to 256 floats spans. */
#define MAX_CHUNKS (256 / VL)

/* attend() for dim = VL * chunks; inlined with chunks a constant where it is called. */
static inline __attribute__((always_inline)) void attend_vec(const Work *w, int task,
                                                             float *scores, vec *parts,
                                                             const int chunks) {
  const Task tk = task_view(w, task);
  const int group = tk.group, dim = w->dim, bs = w->block_size, length = tk.length;
  const int stride = (length + VL - 1) / VL * VL + VL; /* scores row of one query head */

  /* Scores, VL keys at a time (a table's block may hold fewer: the rest are zeros). */
  int rows;
  for (int t0 = 0; t0 < length; t0 += VL) {
    const int n = length - t0 < VL ? length - t0 : VL;
    for (int j = 0; j < n; j++) {
      const int t = t0 + j;
      const float *key = block_at(tk.keys, tk.table, t - t % bs, length, bs, dim, &rows) +
                         (int64_t)(t % bs) * dim;
      vec k[MAX_CHUNKS];
      for (int c = 0; c < chunks; c++) k[c] = load_vec(key + VL * c);
      for (int g = 0; g < group; g++) {
        const float *qg = tk.q + (int64_t)g * dim;
        vec acc = load_vec(qg) * k[0];
        for (int c = 1; c < chunks; c++) acc += load_vec(qg + VL * c) * k[c];
        parts[g * VL + BITREV[j]] = acc;
      }
    }
    for (int g = 0; g < group; g++) {
      for (int j = n; j < VL; j++) parts[g * VL + BITREV[j]] = (vec){0};
      const vec sums = sum_lanes(parts + g * VL) * w->scale;
      memcpy(scores + (int64_t)g * stride + t0, &sums, sizeof sums);
    }
  }
  for (int g = 0; g < group; g++) {
    float *s = scores + (int64_t)g * stride;
    const float inv = exp_from_max(s, length);
    /* The weighted sum of values, one query head at a time, in registers. */
    vec acc[MAX_CHUNKS];
    for (int c = 0; c < chunks; c++) acc[c] = (vec){0};
    for (int t0 = 0; t0 < length; t0 += bs) {
      const float *block = block_at(tk.values, tk.table, t0, length, bs, dim, &rows);
      for (int j = 0; j < rows; j++) {
        const float weight = s[t0 + j];
        const float *value = block + (int64_t)j * dim;
        for (int c = 0; c < chunks; c++) acc[c] += weight * load_vec(value + VL * c);
      }
    }
    for (int c = 0; c < chunks; c++) {
      const vec scaled = acc[c] * inv;
      memcpy(tk.out + (int64_t)g * dim + VL * c, &scaled, sizeof scaled);
    }
  }
}

static void attend_any(const Work *w, int task, float *scores, vec *parts) {
  switch (w->dim) {
    case 32: attend_vec(w, task, scores, parts, 32 / VL); break;
    case 64: attend_vec(w, task, scores, parts, 64 / VL); break;
    case 128: attend_vec(w, task, scores, parts, 128 / VL); break;
    default: attend_vec(w, task, scores, parts, w->dim / VL);
  }
}
#endif

static int vector_dim(int dim) {
#ifdef VECTOR_PATH
  return dim % VL == 0 && dim <= 256;
#else
  (void)dim;
  return 0;
#endif
}

static void *run(void *arg) {
  Work *w = (Work *)arg;
  int longest = 1;
  for (int task = w->first; task < w->last; task++) {
    int length = w->lengths[task / w->kv_heads];
    longest = length > longest ? length : longest;
  }
  const size_t group = (size_t)(w->heads / w->kv_heads);
  /* Room for each query head's scores rounded up to VL keys, plus VL (the vector path;
     VL <= 16). */
  float *scores = malloc(sizeof(float) * ((size_t)longest + 32) * group);
  if (scores == NULL) {
    w->failed = 1;
    return NULL;
  }
#ifdef VECTOR_PATH
  if (vector_dim(w->dim)) {
    vec *parts = aligned_alloc(64, sizeof(vec) * VL * group);
    if (parts == NULL) {
      w->failed = 1;
    } else {
      for (int task = w->first; task < w->last; task++) attend_any(w, task, scores, parts);
    }
    free(parts);
    free(scores);
    return NULL;
  }
#endif
  for (int task = w->first; task < w->last; task++) attend(w, task, scores);
  free(scores);
  return NULL;
}

typedef struct {
  Work *work;
  int count;
} Works;

/* Work items part, part + parts, ...: all of them where the team came out smaller. */
static void run_part(void *context, int part, int parts) {
  const Works *works = context;
  for (int i = part; i < works->count; i += parts) run(works->work + i);
}

/* Returns 0 on success, -1 on bad arguments, -2 when memory ran out. */
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
  Works works = {work, threads};
  batchd_team_run(run_part, &works, threads);
  int failed = 0;
  for (int i = 0; i < threads; i++) failed |= work[i].failed;
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
