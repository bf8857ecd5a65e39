// CUDA kernels. Same contract as the CPU ones (relu.h), on raw bits.
//
// Forward: a warp takes a tile of 32 * V elements, each lane one 16-byte
// vector of V elements (V = 1 when a pointer is not 16-byte aligned, e.g.
// x[1:]). Ballot j collects bit j of every lane; regrouping the V ballots gives
// the V 32-bit mask words of the tile, which lanes 0..V-1 store.
// Backward: each thread takes V elements, whose V mask bits share one byte.
// Indices are 64-bit throughout; loops are grid-stride, so any size runs.
#include "relu.h"

#include <ATen/Dispatch.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace relu_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Resident blocks per SM at 256 threads (2048 threads / SM on sm_80 and sm_90);
// a grid of that many covers the device once and loops over the rest.
constexpr int kBlocksPerSm = 8;

template <typename U, int V>
struct alignas(sizeof(U) * V) Pack {
  U v[V];
};

// Moves bit i of `x` to bit i * V, for i < 32 / V.
template <int V>
RELU_HD constexpr uint32_t spread(uint32_t x) {
  if constexpr (V == 2) {
    x = (x | (x << 8)) & 0x00FF00FFu;
    x = (x | (x << 4)) & 0x0F0F0F0Fu;
    x = (x | (x << 2)) & 0x33333333u;
    return (x | (x << 1)) & 0x55555555u;
  } else if constexpr (V == 4) {
    x = (x | (x << 12)) & 0x000F000Fu;
    x = (x | (x << 6)) & 0x03030303u;
    return (x | (x << 3)) & 0x11111111u;
  } else if constexpr (V == 8) {
    x = (x | (x << 14)) & 0x00030003u;
    return (x | (x << 7)) & 0x01010101u;
  } else {
    static_assert(V == 1, "V must be 1, 2, 4 or 8");
    return x;
  }
}

// Mask word k (elements 32k .. 32k+31 of the tile) from the tile's ballots.
// Element e of the tile sits in lane e / V, slot e % V, so word k takes
// L = 32 / V lanes from each ballot and interleaves them.
template <int V>
RELU_HD constexpr uint32_t tile_word(const uint32_t (&ballot)[V], int k) {
  if constexpr (V == 1) {
    return ballot[0];
  } else {
    constexpr int L = 32 / V;
    uint32_t w = 0;
    for (int j = 0; j < V; ++j) w |= spread<V>((ballot[j] >> (k * L)) & ((1u << L) - 1)) << j;
    return w;
  }
}

// Compile-time proof of tile_word against the definition, bit by bit.
template <int V>
constexpr bool tile_word_is_right() {
  const uint32_t patterns[] = {0xFFFFFFFFu, 0x80000001u, 0x12345678u, 0xDEADBEEFu, 0x0F0F00F0u};
  for (uint32_t seed : patterns) {
    uint32_t ballot[V] = {};
    for (int j = 0; j < V; ++j) ballot[j] = seed * (2u * j + 1u) ^ (seed >> j);
    for (int k = 0; k < V; ++k) {
      uint32_t want = 0;
      for (int bit = 0; bit < 32; ++bit) {
        const int e = 32 * k + bit;
        want |= ((ballot[e % V] >> (e / V)) & 1u) << bit;
      }
      if (tile_word<V>(ballot, k) != want) return false;
    }
  }
  return true;
}
static_assert(tile_word_is_right<1>() && tile_word_is_right<2>() && tile_word_is_right<4>() &&
                  tile_word_is_right<8>(),
              "mask word regrouping is wrong");

template <typename U, U kInf, int V>
__global__ void __launch_bounds__(kThreads)
    fwd_kernel(const U* x, U* y, uint8_t* mask, int64_t n) {  // x may alias y: no __restrict__
  using P = Pack<U, V>;
  constexpr int64_t kTile = 32 * V;
  const int lane = threadIdx.x & 31;
  const int64_t ntiles = (n + kTile - 1) / kTile;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  // t is the same for the whole warp, so every lane reaches every ballot.
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < ntiles; t += nwarps) {
    const int64_t base = t * kTile + static_cast<int64_t>(lane) * V;
    const bool full = (t + 1) * kTile <= n;
    P in;
    if (full) {
      in = *reinterpret_cast<const P*>(x + base);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) in.v[j] = base + j < n ? x[base + j] : U(0);  // +0: bit 0
    }
    P out;
    uint32_t ballot[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const bool keep = relu_keep<U, kInf>(in.v[j]);
      out.v[j] = relu_value(in.v[j], keep);
      ballot[j] = __ballot_sync(0xFFFFFFFFu, keep);
    }
    if (full) {
      *reinterpret_cast<P*>(y + base) = out;
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (base + j < n) y[base + j] = out.v[j];
      }
    }
    if (mask != nullptr && lane < V) {
      const int64_t word = t * V + lane;
      const int64_t first = word * 32;
      const uint32_t w = tile_word<V>(ballot, lane);
      if (first + 32 <= n) {
        reinterpret_cast<uint32_t*>(mask)[word] = w;
      } else if (first < n) {  // the mask is ceil(n / 8) bytes: store only those
        for (int64_t b = 0; b < (n - first + 7) / 8; ++b) mask[word * 4 + b] = static_cast<uint8_t>(w >> (8 * b));
      }
    }
  }
}

template <typename U, int V>
__global__ void __launch_bounds__(kThreads)
    bwd_kernel(const U* __restrict__ g, const uint8_t* __restrict__ mask, U* __restrict__ out, int64_t n) {
  using P = Pack<U, V>;
  const int64_t nchunks = (n + V - 1) / V;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c < nchunks; c += stride) {
    const int64_t base = c * V;
    const uint32_t bits = mask[base >> 3] >> (base & 7);  // V divides 8: all V bits in this byte
    if (base + V <= n) {
      const P in = *reinterpret_cast<const P*>(g + base);
      P o;
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = ((bits >> j) & 1u) ? in.v[j] : U(0);
      *reinterpret_cast<P*>(out + base) = o;
    } else {
      for (int j = 0; base + j < n; ++j) out[base + j] = ((bits >> j) & 1u) ? g[base + j] : U(0);
    }
  }
}

// Integers: no mask, no bit tricks; one element per thread, grid-stride.
template <typename T>
__global__ void __launch_bounds__(kThreads) int_kernel(const T* x, T* y, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    const T v = x[i];
    y[i] = v > T(0) ? v : T(0);  // not `v < 0`: that is always false (and warned) for uint8
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

unsigned int grid_for(int64_t threads_needed, int device) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int64_t blocks = (threads_needed + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * kBlocksPerSm)));
}

}  // namespace

void forward_cuda(const at::Tensor& x, const at::Tensor& y, uint8_t* mask) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = aligned16(x.const_data_ptr()) && aligned16(y.data_ptr());
  dispatch_bits(x.scalar_type(), [&](auto fmt) {
    using U = typename decltype(fmt)::U;
    constexpr U kInf = decltype(fmt)::kInf;
    constexpr int V = 16 / sizeof(U);
    const U* xp = static_cast<const U*>(x.const_data_ptr());
    U* yp = static_cast<U*>(y.data_ptr());
    if (vec) {
      const unsigned int grid = grid_for((n + V - 1) / V, x.get_device());
      fwd_kernel<U, kInf, V><<<grid, kThreads, 0, stream>>>(xp, yp, mask, n);
    } else {
      fwd_kernel<U, kInf, 1><<<grid_for(n, x.get_device()), kThreads, 0, stream>>>(xp, yp, mask, n);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void forward_int_cuda(const at::Tensor& x, const at::Tensor& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INTEGRAL_TYPES(x.scalar_type(), "relu_ext_int", [&] {
    int_kernel<scalar_t><<<grid_for(n, x.get_device()), kThreads, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void backward_cuda(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in) {
  const int64_t n = grad.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = aligned16(grad.const_data_ptr()) && aligned16(grad_in.data_ptr());
  dispatch_bits(grad.scalar_type(), [&](auto fmt) {
    using U = typename decltype(fmt)::U;
    constexpr int V = 16 / sizeof(U);
    const U* gp = static_cast<const U*>(grad.const_data_ptr());
    U* op = static_cast<U*>(grad_in.data_ptr());
    if (vec) {
      bwd_kernel<U, V><<<grid_for((n + V - 1) / V, grad.get_device()), kThreads, 0, stream>>>(gp, mask, op, n);
    } else {
      bwd_kernel<U, 1><<<grid_for(n, grad.get_device()), kThreads, 0, stream>>>(gp, mask, op, n);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace relu_ext
