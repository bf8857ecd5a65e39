// The CUDA kernels' launches, shared by both subsystems' launchers
// (activations/cuda.cu, compact/cuda.cu): grid size, unroll choice, stream.
// Host code: only .cu files include it.
#pragma once

#include "core/cuda.cuh"
#include "core/cuda_launch.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

namespace relu_ext {

// Blocks of kThreads for `threads_needed` threads, at most cuda_waves() times as
// many as fit on the current device at once (asked of the CUDA runtime once
// per kernel and device: it depends on the kernel's registers); the
// grid-stride loops do the rest. With 0 waves, only CUDA's grid limit caps it.
template <typename Kernel>
inline unsigned int grid_for(Kernel kernel, int64_t threads_needed, int device) {
  constexpr int64_t kGridLimit = (int64_t(1) << 31) - 1;  // gridDim.x
  const int64_t blocks = std::max<int64_t>(1, (threads_needed + kThreads - 1) / kThreads);
  const int waves = cuda_waves();
  if (waves == 0) return static_cast<unsigned int>(std::min(blocks, kGridLimit));
  static std::mutex lock;
  static std::map<std::pair<const void*, int>, int64_t> fit;  // (kernel, device) -> blocks
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  int64_t most = 0;
  {
    const std::lock_guard<std::mutex> guard(lock);
    const auto it = fit.find(key);
    if (it != fit.end()) most = it->second;
  }
  if (most == 0) {
    int per_sm = 0, sms = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    most = int64_t(std::max(per_sm, 1)) * sms;
    const std::lock_guard<std::mutex> guard(lock);
    fit[key] = most;
  }
  return static_cast<unsigned int>(std::min(blocks, most * waves));
}

// Calls fn(std::integral_constant<int, K>{}) for the unroll in use.
template <typename Fn>
void with_unroll(Fn&& fn) {
  switch (cuda_unroll()) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    default: fn(std::integral_constant<int, 2>{}); break;
  }
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, int64_t threads_needed, int device, cudaStream_t stream, Args... args) {
  kernel<<<grid_for(kernel, threads_needed, device), kThreads, 0, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int I>
using Int = std::integral_constant<int, I>;

// An element-wise kernel over n elements of T: kernel_of(V, K) with V-element
// 16-byte vectors and K rows per warp and iteration when `vec` (every
// pointer it reads or writes is 16-byte aligned), else kernel_of(1, 1), one
// element at a time. K is set_cuda_unroll's choice where kTunable (ReLU's
// kernels are compiled for each), else the default.
template <typename T, bool kTunable, typename KernelOf, typename... Args>
void launch_elementwise(bool vec, int64_t n, int device, cudaStream_t stream, KernelOf kernel_of, Args... args) {
  constexpr int V = 16 / sizeof(T);
  if (!vec) return launch(kernel_of(Int<1>{}, Int<1>{}), n, device, stream, args...);
  const auto go = [&](auto unroll) {
    constexpr int K = decltype(unroll)::value;
    launch(kernel_of(Int<V>{}, unroll), (n + V * K - 1) / (V * K), device, stream, args...);
  };
  if constexpr (kTunable) {
    with_unroll(go);
  } else {
    go(Int<kDefaultUnroll>{});
  }
}

}  // namespace relu_ext
