/* Matrix products over weights packed once at load, for the few rows of a decode step.

   Why: OpenBLAS packs the weight operand into its own panel layout on every call. At
   decode's 32 rows that packing reads and writes as much memory as the products
   themselves (on SmolLM2-135M, 2 cores: about half of the q/k/v and gate/up time), so
   the products run at half the rate of large ones. Here the weights are laid out in
   panels once (engine/forward/native.py) and each call only reads them.

   Layout: a weight [k, n] (x @ w, float32) becomes ceil(n / PANEL) panels, each [k, PANEL]
   row-major (columns past n are zeros). SwiGLU's gate and up share panels: the first VL
   columns of a panel are VL gate columns, the next VL the matching up columns, and the
   product writes silu(gate) * up, so the gate and up products are never stored.

   Each output element is one ordered sum over k (fused multiply-adds), whatever the
   rows, the thread count or the other columns of the call: results do not depend on the
   batch. They differ from OpenBLAS's in the last bits (it splits and orders the sums its
   own way).

   Threads: the team of team.c, each thread a run of panels. */

#include <stdint.h>
#include <string.h>

#include "fast_exp.h"
#include "simd.h"
#include "team.h"

/* Rows of a tile: 2 * ROWS accumulators and the panel's two vectors fill the registers. */
#if VL == 16
#define ROWS 8
#else
#define ROWS 6
#endif
#define PANEL (2 * VL)

int batchd_panel_width(void) { return PANEL; }

/* Rows one pass over a panel computes: a product of fewer rows costs about as much. */
int batchd_tile_rows(void) { return ROWS; }

typedef struct {
  const float *x, *panels, *bias;
  float *y;
  int64_t m, k, n; /* n: output columns (for SwiGLU, the gate's columns) */
  int swiglu;
  int panel_count;
} Product;

/* Rows [0, rows) of x times one panel: out[r][0..cols) (cols <= PANEL, or <= VL with
   swiglu). */
static inline void tile(const Product *p, const float *x, const float *panel,
                        const float *bias, float *out, int rows, int cols) {
  vec acc[ROWS][2];
  const float *xr[ROWS];
  const vec b0 = bias ? load_vec(bias) : (vec){0};
  const vec b1 = bias ? load_vec(bias + VL) : (vec){0};
  for (int r = 0; r < ROWS; r++) {
    acc[r][0] = b0;
    acc[r][1] = b1;
    xr[r] = x + (int64_t)(r < rows ? r : 0) * p->k;
  }
  for (int64_t kk = 0; kk < p->k; kk++) {
    const vec w0 = load_vec(panel + kk * PANEL);
    const vec w1 = load_vec(panel + kk * PANEL + VL);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; r++) {
      const vec b = (vec){0} + xr[r][kk];
      acc[r][0] += b * w0;
      acc[r][1] += b * w1;
    }
  }
  for (int r = 0; r < rows; r++) {
    float *row = out + (int64_t)r * p->n;
    float both[PANEL];
    memcpy(both, &acc[r][0], sizeof(vec));
    memcpy(both + VL, &acc[r][1], sizeof(vec));
    if (p->swiglu) {
#pragma omp simd
      for (int c = 0; c < VL; c++) both[c] = both[c] / (1.0f + exp_clamped(-both[c])) * both[VL + c];
    }
    memcpy(row, both, (size_t)cols * sizeof(float));
  }
}

/* Panels [first, last) of a product, every row. */
static void run_panels(const Product *p, int first, int last) {
  const int width = p->swiglu ? VL : PANEL;
  for (int i = first; i < last; i++) {
    const float *panel = p->panels + (int64_t)i * p->k * PANEL;
    int cols = (int)(p->n - (int64_t)i * width);
    cols = cols > width ? width : cols;
    for (int64_t r0 = 0; r0 < p->m; r0 += ROWS) {
      const int rows = p->m - r0 < ROWS ? (int)(p->m - r0) : ROWS;
      tile(p, p->x + r0 * p->k, panel, p->bias ? p->bias + (int64_t)i * PANEL : NULL, p->y + r0 * p->n + (int64_t)i * width, rows, cols);
    }
  }
}

static void share(void *context, int part, int parts) {
  const Product *p = context;
  run_panels(p, (int)((int64_t)p->panel_count * part / parts),
             (int)((int64_t)p->panel_count * (part + 1) / parts));
}

/* y = x @ w + bias for x [m, k] and w packed as above (bias NULL, or packed like a row of
   a panel: [panels, PANEL]); with swiglu, y = silu(x @ gate) * (x @ up). Returns 0, or -1
   on bad arguments. Fewer threads than asked run it where workers could not be started. */
int batchd_product(const float *x, int64_t m, int64_t k, const float *panels, const float *bias,
                   int64_t n, float *y, int swiglu, int threads) {
  if (m < 0 || k < 1 || n < 1) return -1;
  if (m == 0) return 0;
  const int width = swiglu ? VL : PANEL;
  Product p = {x, panels, bias, y, m, k, n, swiglu, (int)((n + width - 1) / width)};
  batchd_team_run(share, &p, threads < p.panel_count ? threads : p.panel_count);
  return 0;
}
