// CPU emulation of the CUDA device features an `mx.fast.cuda_kernel` body uses.
//
// Execution model (see emulate.py): blocks run one after another; the threads of the
// running block are real std::threads, so __syncthreads and warp shuffles are real
// rendezvous. `__shared__` expands to `static`: a function-static variable is one object
// shared by every thread, and since only one block runs at a time and all its threads
// meet at a barrier before the next block starts, that object is exactly the block's
// shared memory. (Its contents carry over between blocks, as stale shared memory would.)
// A barrier that is not reached by every live thread within EMU_DEADLOCK_SECONDS
// aborts the launch with an error instead of hanging.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __grid_constant__
#define __shared__ static
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
#define MAX_NDIM 10
#define WARP_SIZE 32

namespace cuda {
namespace std = ::std;
}
namespace cooperative_groups {}

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};
using uint3 = dim3;
constexpr int warpSize = 32;
inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {

struct Aborted {};  // thrown out of a kernel once the launch has failed
inline std::atomic<bool> failed{false};
inline std::mutex error_mutex;
inline std::string error_message;
inline double deadlock_seconds = 20.0;

inline void fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(error_mutex);
  if (!failed.exchange(true)) error_message = why;
}

// A reusable barrier whose waits give up (failing the launch) after deadlock_seconds,
// and whose members may leave for good (a thread that returned from the kernel).
class Barrier {
 public:
  void reset(int count) { count_ = count, waiting_ = 0; }
  void wait(const char* what) {
    std::unique_lock<std::mutex> lock(m_);
    if (failed) throw Aborted{};
    auto gen = gen_;
    if (++waiting_ >= count_) return release();
    auto deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration<double>(deadlock_seconds);
    while (gen_ == gen) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      if (failed) throw Aborted{};
      if (std::chrono::steady_clock::now() > deadline) {
        fail(std::string("deadlock: not every thread of the block/warp reached ") + what);
        throw Aborted{};
      }
    }
  }
  void drop() {
    std::unique_lock<std::mutex> lock(m_);
    --count_;
    if (count_ > 0 && waiting_ >= count_) release();
  }

 private:
  void release() {
    waiting_ = 0, ++gen_;
    cv_.notify_all();
  }
  std::mutex m_;
  std::condition_variable cv_;
  int count_ = 0, waiting_ = 0;
  std::uint64_t gen_ = 0;
};

struct Warp {
  Barrier barrier;
  std::array<std::uint64_t, 32> slots{};
  int size = 32;
};

inline Barrier block_barrier;
inline std::vector<Warp> warps;
inline unsigned char* dynamic_smem = nullptr;
inline thread_local int lane = 0, warp_id = 0;

template <typename T>
T exchange(const T& value, int src) {
  static_assert(sizeof(T) <= 8, "warp exchange supports values of up to 8 bytes");
  Warp& w = warps[warp_id];
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  w.slots[lane] = bits;
  w.barrier.wait("a warp shuffle");
  T out = value;
  if (src >= 0 && src < w.size) std::memcpy(&out, &w.slots[src], sizeof(T));
  w.barrier.wait("a warp shuffle");
  return out;
}

}  // namespace emu

inline void __syncthreads() { emu::block_barrier.wait("__syncthreads()"); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warps[emu::warp_id].barrier.wait("__syncwarp()"); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// Shuffles follow the CUDA programming guide: `width` splits the warp into segments and a
// source outside the caller's segment yields the caller's own value.
template <typename T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
  int base = emu::lane - emu::lane % width;
  return emu::exchange(v, base + ((src % width) + width) % width);
}
template <typename T>
T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
  int src = emu::lane ^ mask;
  int base = emu::lane - emu::lane % width;
  return emu::exchange(v, src < base + width ? src : emu::lane);
}
template <typename T>
T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
  int in_seg = emu::lane % width + static_cast<int>(delta);
  return emu::exchange(v, in_seg < width ? emu::lane + static_cast<int>(delta) : emu::lane);
}
template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  int in_seg = emu::lane % width - static_cast<int>(delta);
  return emu::exchange(v, in_seg >= 0 ? emu::lane - static_cast<int>(delta) : emu::lane);
}
inline unsigned __ballot_sync(unsigned, int pred) {
  unsigned bits = 0;
  for (int i = 0; i < emu::warps[emu::warp_id].size; ++i) {
    bits |= (emu::exchange(pred ? 1 : 0, i) ? 1u : 0u) << i;
  }
  return bits;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) {
  unsigned full = emu::warps[emu::warp_id].size == 32 ? 0xffffffffu
                                                      : (1u << emu::warps[emu::warp_id].size) - 1;
  return __ballot_sync(m, pred) == full;
}

template <typename T>
T atomicAdd(T* addr, T v) { return std::atomic_ref<T>(*addr).fetch_add(v); }
template <typename T>
T atomicMax(T* addr, T v) {
  std::atomic_ref<T> ref(*addr);
  T old = ref.load();
  while (old < v && !ref.compare_exchange_weak(old, v)) {}
  return old;
}

#include "cuda_emu_fp16.h"

// ---- float math intrinsics (the fast-math ones are exact here, not approximate) ----
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __saturatef(float x) { return std::min(std::max(x, 0.0f), 1.0f); }
inline float __int_as_float(int i) { return emu_bit_cast<float>(i); }
inline int __float_as_int(float f) { return emu_bit_cast<int>(f); }
inline float __uint_as_float(unsigned u) { return emu_bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return emu_bit_cast<unsigned>(f); }
using std::exp, std::log, std::sqrt, std::fabs, std::fmax, std::fmin, std::abs, std::isinf, std::isnan;
using ::expf, ::logf, ::sqrtf, ::fabsf, ::fmaxf, ::fminf, ::tanhf, ::powf, ::floorf, ::ceilf;
inline int min(int a, int b) { return std::min(a, b); }
inline int max(int a, int b) { return std::max(a, b); }
inline unsigned min(unsigned a, unsigned b) { return std::min(a, b); }
inline unsigned max(unsigned a, unsigned b) { return std::max(a, b); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

using Shape = std::array<std::int32_t, MAX_NDIM>;
using Strides = std::array<std::int64_t, MAX_NDIM>;

namespace emu {

// Runs `kernel` for every block, one block at a time, each block's threads in parallel.
inline int launch(const dim3& grid, const dim3& block, std::size_t smem,
                  const std::function<void()>& kernel, char* err, std::size_t err_len) {
  gridDim = grid, blockDim = block;
  int n = static_cast<int>(block.x * block.y * block.z);
  std::vector<unsigned char> dyn(smem + 16);
  dynamic_smem = dyn.data();
  failed = false, error_message.clear();
  warps = std::vector<Warp>((n + 31) / 32);
  Barrier block_end;
  block_end.reset(n);
  auto reset = [&] {
    block_barrier.reset(n);
    for (std::size_t w = 0; w < warps.size(); ++w) {
      warps[w].size = std::min(32, n - static_cast<int>(w) * 32);
      warps[w].barrier.reset(warps[w].size);
    }
  };
  reset();
  auto body = [&](int tid) {
    threadIdx = dim3{tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)};
    lane = tid % 32, warp_id = tid / 32;
    try {
      for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            blockIdx = dim3{bx, by, bz};
            kernel();
            block_barrier.drop();
            warps[warp_id].barrier.drop();
            block_end.wait("the end of the block");
            if (tid == 0) reset();
            block_end.wait("the end of the block");
          }
    } catch (const Aborted&) {
    } catch (const std::exception& e) {
      fail(std::string("exception in kernel: ") + e.what());
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < n; ++t) threads.emplace_back(body, t);
  for (auto& t : threads) t.join();
  if (!failed) return 0;
  std::snprintf(err, err_len, "%s", error_message.c_str());
  return 1;
}

}  // namespace emu
