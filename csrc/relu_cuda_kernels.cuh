// CUDA kernels: the device code. Same contract as the CPU ones (relu.h), on
// raw bits. relu_cuda.cu launches them; tests/cuda_emulation.cpp runs this
// same code on the CPU, one fiber per lane (which is why it is a header that
// needs nothing from the CUDA runtime).
//
// A warp works on rows of 32 * V elements, each lane one 16-byte vector of V
// elements (V = 1 when a pointer is not 16-byte aligned, e.g. x[1:]), and
// takes K consecutive rows per loop iteration: it issues all K loads before
// it uses the first, so that each thread has K * 16 bytes in flight (the
// unroll, a run-time choice among the compiled K = 1, 2, 4: set_cuda_unroll).
// Forward: ballot j of a row collects bit j of every lane; regrouping the V
// ballots gives the V 32-bit mask words of the row, which lanes 0..V-1 store.
// Backward: the V mask bits of a lane's vector share one byte.
// Indices are 64-bit throughout; loops are grid-stride over a grid of at most
// the blocks that fit on the device at once, so any size runs in one wave.
#pragma once

#include <cstdint>

#include "relu.h"

namespace relu_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

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

// V elements at `base` (a multiple of V); past `n`, +0 (a dropped element: mask bit 0).
template <typename U, int V>
__device__ __forceinline__ Pack<U, V> load(const U* p, int64_t base, int64_t n) {
  if (base + V <= n) return *reinterpret_cast<const Pack<U, V>*>(p + base);
  Pack<U, V> v;
#pragma unroll
  for (int j = 0; j < V; ++j) v.v[j] = base + j < n ? p[base + j] : U(0);
  return v;
}

template <typename U, int V>
__device__ __forceinline__ void store(U* p, int64_t base, int64_t n, const Pack<U, V>& v) {
  if (base + V <= n) {
    *reinterpret_cast<Pack<U, V>*>(p + base) = v;
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (base + j < n) p[base + j] = v.v[j];
    }
  }
}

// The kernels' loop: groups of K rows of 32 * V elements, grid-stride, one
// group per warp at a time. body(row, lane) runs with the group's first row;
// lane `lane` has the V elements from row * 32 * V + lane * V in each row.
// The group is the same for the whole warp, so every lane reaches every
// ballot in the body.
template <int V, int K, typename Body>
__device__ __forceinline__ void for_each_group(int64_t n, Body&& body) {
  constexpr int64_t kGroup = int64_t(32) * V * K;
  const int lane = threadIdx.x & 31;
  const int64_t ngroups = (n + kGroup - 1) / kGroup;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t grp = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; grp < ngroups; grp += nwarps) {
    body(grp * K, lane);
  }
}

template <typename U, U kInf, int V, int K>
__global__ void __launch_bounds__(kThreads)
    fwd_kernel(const U* x, U* y, uint8_t* mask, int64_t n) {  // x may alias y: no __restrict__
  using P = Pack<U, V>;
  constexpr int64_t kRow = 32 * V;
  for_each_group<V, K>(n, [&](int64_t row0, int lane) {
    P in[K];
#pragma unroll
    for (int k = 0; k < K; ++k) in[k] = load<U, V>(x, (row0 + k) * kRow + lane * V, n);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t row = row0 + k;
      P out;
      uint32_t ballot[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const bool keep = relu_keep<U, kInf>(in[k].v[j]);
        out.v[j] = relu_value(in[k].v[j], keep);
        ballot[j] = __ballot_sync(0xFFFFFFFFu, keep);
      }
      store<U, V>(y, row * kRow + lane * V, n, out);
      if (mask != nullptr && lane < V) {
        const int64_t word = row * V + lane;
        const int64_t first = word * 32;
        const uint32_t w = tile_word<V>(ballot, lane);
        if (first + 32 <= n) {
          reinterpret_cast<uint32_t*>(mask)[word] = w;
        } else if (first < n) {  // the mask is ceil(n / 8) bytes: store only those
          for (int64_t b = 0; b < (n - first + 7) / 8; ++b) mask[word * 4 + b] = static_cast<uint8_t>(w >> (8 * b));
        }
      }
    }
  });
}

template <typename U, int V, int K>
__global__ void __launch_bounds__(kThreads)
    bwd_kernel(const U* __restrict__ g, const uint8_t* __restrict__ mask, U* __restrict__ out, int64_t n) {
  using P = Pack<U, V>;
  constexpr int64_t kRow = 32 * V;
  for_each_group<V, K>(n, [&](int64_t row0, int lane) {
    P in[K];
    uint32_t bits[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t base = (row0 + k) * kRow + lane * V;
      in[k] = load<U, V>(g, base, n);
      bits[k] = base < n ? mask[base >> 3] >> (base & 7) : 0u;  // V divides 8: all V bits in this byte
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      P o;
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = ((bits[k] >> j) & 1u) ? in[k].v[j] : U(0);
      store<U, V>(out, (row0 + k) * kRow + lane * V, n, o);
    }
  });
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

}  // namespace
}  // namespace relu_ext
