// CUDA device code both subsystems' kernels share: the 16-byte packs, their
// loads and stores, the mask words a warp pools, and the warps' loop over
// groups of rows. A header that needs nothing from the CUDA runtime, so that
// tests/activations/cuda_emulation.cpp runs it on the CPU, one fiber per lane.
//
// A warp works on rows of 32 * V elements, each lane one 16-byte vector of V
// elements (V = 1 when a pointer is not 16-byte aligned, e.g. x[1:]), and
// takes K consecutive rows per loop iteration: it issues all K loads before
// it uses the first, so that each thread has K * 16 bytes in flight (the
// unroll, a run-time choice among the compiled K = 1, 2, 4: set_cuda_unroll).
// Forward: a lane's V elements are consecutive, so its V mask bits are
// consecutive too; the lanes of each 32-bit mask word pool theirs with
// shuffles (row_word), and one lane per word stores it.
// Backward: the V mask bits of a lane's vector share one byte. nonzero_kernel
// builds its bitmap as the forward does; compaction has its own layout
// (compact/kernels.cuh).
// Indices are 64-bit throughout; loops are grid-stride, so any grid covers any
// size (by default one wave of the blocks that fit on the device at once;
// set_cuda_waves, cuda_launch.cuh).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/bits.h"

namespace relu_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

template <typename U, int V>
struct alignas(sizeof(U) * V) Pack {
  U v[V];
};

// The mask word of a row's elements 32w .. 32w+31, w = lane / (32 / V), in
// lanes that are multiples of 32 / V. `bits`: this lane's V mask bits (bit
// j: its element j, all higher bits 0). A lane's V elements are consecutive,
// so the lanes of a word pool their bits in log2(32 / V) shuffles: at step
// d, lane l takes the d * V bits that lane l + d has so far (l ^ d == l + d
// for every lane a word's lane reads from). One ballot when V == 1. The
// other lanes get bits they do not store.
template <int V>
__device__ __forceinline__ uint32_t row_word(uint32_t bits) {
  if constexpr (V == 1) {
    return __ballot_sync(0xFFFFFFFFu, bits != 0);
  } else {
    static_assert(V == 2 || V == 4 || V == 8, "V must be 1, 2, 4 or 8");
#pragma unroll
    for (int d = 1; d < 32 / V; d *= 2) bits |= __shfl_xor_sync(0xFFFFFFFFu, bits, d) << (d * V);
    return bits;
  }
}

// V elements at `base` (a multiple of V); past `n`, +0 (a dropped element: mask bit 0).
template <typename U, int V>
__device__ __forceinline__ Pack<U, V> load(const U* p, int64_t base, int64_t n) {
  if (base + V <= n) return *reinterpret_cast<const Pack<U, V>*>(p + base);
  Pack<U, V> v;
#pragma unroll
  for (int j = 0; j < V; ++j) v.v[j] = base + j < n ? p[base + j] : U(0);
  return v;
}

// A 16-byte Pack at p (16-byte aligned) with one 16-byte store. nvcc (13.0)
// stored a Pack, or a uint4 made of its words, as 4 to 8 narrow stores
// (st.global.u16 or .u32) in some loops, which held bfloat16 forwards well
// below a copy's bandwidth (docs/performance.md); PTX says what to store. 16-bit
// elements are paired into words with shifts.
template <typename U, int V>
__device__ __forceinline__ void store16(U* p, const Pack<U, V>& v) {
  static_assert(sizeof(v) == 16, "a 16-byte Pack");
  uint32_t w[4];
  if constexpr (sizeof(U) == 2) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint16_t lo, hi;
      memcpy(&lo, &v.v[2 * j], 2);
      memcpy(&hi, &v.v[2 * j + 1], 2);
      w[j] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
  } else {
    memcpy(w, &v, 16);
  }
#if defined(__CUDA_ARCH__)
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
#else
  memcpy(p, w, 16);
#endif
}

template <typename U, int V>
__device__ __forceinline__ void store(U* p, int64_t base, int64_t n, const Pack<U, V>& v) {
  if (base + V <= n) {
    if constexpr (sizeof(v) == 16) {
      store16(p + base, v);
    } else {
      *reinterpret_cast<Pack<U, V>*>(p + base) = v;
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (base + j < n) p[base + j] = v.v[j];
    }
  }
}

// Mask word `word` (4-byte aligned mask); the mask is ceil(n / 8) bytes, so a
// word at the end stores only those.
__device__ __forceinline__ void store_mask_word(uint8_t* mask, int64_t word, uint32_t w, int64_t n) {
  const int64_t first = word * 32;
  if (first + 32 <= n) {
    reinterpret_cast<uint32_t*>(mask)[word] = w;
  } else if (first < n) {
    for (int64_t b = 0; b < (n - first + 7) / 8; ++b) mask[word * 4 + b] = static_cast<uint8_t>(w >> (8 * b));
  }
}

// Row `row`'s mask words from each lane's V bits (row_word), stored by the
// lanes that hold them. Every lane of the warp must call it.
template <int V>
__device__ __forceinline__ void store_row_mask(uint8_t* mask, int64_t row, int lane, uint32_t bits, int64_t n) {
  constexpr int kLanesPerWord = 32 / V;
  const uint32_t w = row_word<V>(bits);
  if (lane % kLanesPerWord == 0) store_mask_word(mask, row * V + lane / kLanesPerWord, w, n);
}

// The kernels' loop: groups of K rows of 32 * V elements, grid-stride, one
// group per warp at a time. body(row, lane) runs with the group's first row;
// lane `lane` has the V elements from row * 32 * V + lane * V in each row.
// The group is the same for the whole warp, so every lane reaches every
// collective in the body.
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

}  // namespace
}  // namespace relu_ext
