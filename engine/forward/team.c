/* The threads the C kernels share (products.c, paged_decode.c).

   Why: starting a thread per call costs about as much as a small product (tens of
   microseconds, 150 calls a SmolLM2 step), and threads of different kernels must not
   spin against each other on the same cores. Workers outlive the calls: after a part a
   worker spins a few microseconds for the next call (the kernels of a layer follow each
   other that closely), then sleeps on a condition variable, so it does not hold a core
   while the caller runs other work (MLX, Python). One call at a time (a lock); a forked
   child starts workers of its own. */

#include "team.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define MAX_THREADS 16
#define SPINS 4000

static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_uint generation;
static atomic_int remaining;
static TeamPart current_part;
static void *current_context;
static int team; /* threads taking part in the current call */
static int workers;
/* The generation each worker was started at: it runs the calls after it. */
static unsigned born[MAX_THREADS];

static void forget_workers(void) {
  workers = 0;
  pthread_mutex_init(&call_lock, NULL);
  pthread_mutex_init(&wake_lock, NULL);
  pthread_cond_init(&wake, NULL);
}

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_workers); }

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static void *worker(void *arg) {
  const int id = (int)(intptr_t)arg;
  unsigned seen = born[id];
  for (;;) {
    unsigned now;
    int spins = 0;
    while ((now = atomic_load_explicit(&generation, memory_order_acquire)) == seen) {
      if (++spins < SPINS) {
        relax();
        continue;
      }
      pthread_mutex_lock(&wake_lock);
      while (atomic_load_explicit(&generation, memory_order_acquire) == seen)
        pthread_cond_wait(&wake, &wake_lock);
      pthread_mutex_unlock(&wake_lock);
    }
    seen = now;
    if (id < team) {
      current_part(current_context, id, team);
      atomic_fetch_sub_explicit(&remaining, 1, memory_order_release);
    }
  }
  return NULL;
}

int batchd_team_run(TeamPart part, void *context, int threads) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, register_fork_handler);
  threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
  pthread_mutex_lock(&call_lock);
  while (workers < threads - 1) {
    pthread_t id;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    born[workers + 1] = atomic_load_explicit(&generation, memory_order_relaxed);
    const int made = pthread_create(&id, &attr, worker, (void *)(intptr_t)(workers + 1));
    pthread_attr_destroy(&attr);
    if (made != 0) break;
    workers++;
  }
  if (threads > workers + 1) threads = workers + 1;
  if (threads > 1) {
    current_part = part;
    current_context = context;
    team = threads;
    atomic_store_explicit(&remaining, threads - 1, memory_order_relaxed);
    pthread_mutex_lock(&wake_lock);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&wake_lock);
  }
  part(context, 0, threads);
  while (atomic_load_explicit(&remaining, memory_order_acquire) > 0) relax();
  pthread_mutex_unlock(&call_lock);
  return threads;
}
