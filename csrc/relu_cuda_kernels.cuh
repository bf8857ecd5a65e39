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
// Forward: a lane's V elements are consecutive, so its V mask bits are
// consecutive too; the lanes of each 32-bit mask word pool theirs with
// shuffles (row_word), and one lane per word stores it.
// Backward: the V mask bits of a lane's vector share one byte. nonzero_kernel
// builds its bitmap as the forward does; compaction has its own section below.
// Indices are 64-bit throughout; loops are grid-stride, so any grid covers any
// size (by default one wave of the blocks that fit on the device at once;
// set_cuda_waves in relu_cuda.cu).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "activations.h"
#include "relu.h"

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
// (st.global.u16 or .u32) in some loops, which held bfloat16 forwards to
// 38-88% of a copy's bandwidth on an H200; PTX says what to store. 16-bit
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
      uint32_t bits = 0;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const bool keep = relu_keep<U, kInf>(in[k].v[j]);
        out.v[j] = relu_value(in[k].v[j], keep);
        bits |= uint32_t(keep) << j;
      }
      store<U, V>(y, row * kRow + lane * V, n, out);
      if (mask != nullptr) store_row_mask<V>(mask, row, lane, bits, n);
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

// The family (activations.h): the same loops as fwd_kernel / bwd_kernel, on
// the trait's values instead of bits. Elements past n get mask bit 0, as on
// the CPU.
template <typename Act, typename T, int V, int K>
__global__ void __launch_bounds__(kThreads)
    act_fwd_kernel(const T* x, T* y, uint8_t* mask, int64_t n, typename Act::template Params<T> p) {
  using P = Pack<T, V>;
  constexpr int64_t kRow = 32 * V;
  for_each_group<V, K>(n, [&](int64_t row0, int lane) {
    P in[K];
#pragma unroll
    for (int k = 0; k < K; ++k) in[k] = load<T, V>(x, (row0 + k) * kRow + lane * V, n);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t base = (row0 + k) * kRow + lane * V;
      P out;
      uint32_t bits = 0;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        out.v[j] = Act::template forward<true>(in[k].v[j], p);
        bits |= uint32_t(base + j < n && Act::keep(in[k].v[j], p)) << j;
      }
      store<T, V>(y, base, n, out);
      if (mask != nullptr) store_row_mask<V>(mask, row0 + k, lane, bits, n);
    }
  });
}

template <typename Act, typename T, int V, int K>
__global__ void __launch_bounds__(kThreads)
    act_bwd_kernel(const T* __restrict__ g, const uint8_t* __restrict__ mask, T* __restrict__ out, int64_t n,
                   typename Act::template Params<T> p) {
  using P = Pack<T, V>;
  constexpr int64_t kRow = 32 * V;
  for_each_group<V, K>(n, [&](int64_t row0, int lane) {
    P in[K];
    uint32_t bits[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t base = (row0 + k) * kRow + lane * V;
      in[k] = load<T, V>(g, base, n);
      bits[k] = base < n ? mask[base >> 3] >> (base & 7) : 0u;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      P o;
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = Act::grad(in[k].v[j], ((bits[k] >> j) & 1u) != 0, p);
      store<T, V>(out, (row0 + k) * kRow + lane * V, n, o);
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


// --- Compaction (save_compact) -----------------------------------------------
// Same contract as compact_cpu.cpp: elements move as integers of their width,
// mask bits past n are ignored. A warp owns tiles of kTile elements
// (grid-stride). count_kernel writes each tile's number of kept elements;
// their inclusive sum (at::cumsum on the device) tells each tile where its
// values start, so tiles need nothing from each other. In compact and expand
// a warp walks its tile in rows of 32 * V elements (a lane: one 16-byte
// vector, or V = 1 when unaligned), kRowsInFlight rows loaded before the
// first is used; the ballots of a row's mask bits tell each lane how many
// kept elements the lanes below it have, so a row's values are contiguous
// and in memory order. The mask may have any alignment: it is read by bytes.

constexpr int64_t kTile = 2048;
constexpr int kRowsInFlight = 4;
static_assert(kTile % (32 * 8 * kRowsInFlight) == 0, "a tile must be whole groups of rows of every V");

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, d);
  return v;
}

// body(tile, lane) for each of this warp's tiles; the whole warp takes the
// same tiles, so every lane reaches every collective in the body.
template <typename Body>
__device__ __forceinline__ void for_each_tile(int64_t n, Body&& body) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int lane = threadIdx.x & 31;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; t < tiles; t += nwarps) {
    body(t, lane);
  }
}

// Mask bits of elements first .. first + V - 1 (bit j: element first + j),
// those past n cleared (the last byte may hold garbage there). V divides 8
// and `first` is a multiple of V, so they lie in one byte.
template <int V>
__device__ __forceinline__ uint32_t mask_bits(const uint8_t* mask, int64_t first, int64_t n) {
  if (first >= n) return 0;
  const uint32_t bits = (uint32_t(mask[first >> 3]) >> (first & 7)) & ((1u << V) - 1u);
  return n - first >= V ? bits : bits & ((1u << (n - first)) - 1u);
}

// counts[t]: the kept elements of tile t; a lane counts every 32nd byte.
__global__ void __launch_bounds__(kThreads)
    count_kernel(const uint8_t* __restrict__ mask, int64_t n, int64_t* __restrict__ counts) {
  for_each_tile(n, [&](int64_t t, int lane) {
    uint32_t kept = 0;
#pragma unroll
    for (int j = 0; j < kTile / 8 / 32; ++j) kept += __popc(mask_bits<8>(mask, (t * (kTile / 8) + j * 32 + lane) * 8, n));
    kept = warp_sum(kept);
    if (lane == 0) counts[t] = kept;
  });
}

// Tile t's rows, kRowsInFlight at a time: load(k, first) for each row of the
// group, then body(k, first, bits, at), where `first` is the lane's first
// element of row k, `bits` its V mask bits and `at` the index in values of
// its first kept element. ends: the inclusive sum of count_kernel's counts.
template <int V, typename Load, typename Body>
__device__ __forceinline__ void for_each_row(const uint8_t* mask, const int64_t* ends, int64_t n, int64_t t, int lane,
                                             Load&& load, Body&& body) {
  constexpr int64_t kRow = 32 * V;
  const int64_t end = (t + 1) * kTile < n ? (t + 1) * kTile : n;
  const uint32_t lanes_below = (1u << lane) - 1u;
  int64_t at = t == 0 ? 0 : ends[t - 1];
  for (int64_t row0 = t * kTile; row0 < end; row0 += kRow * kRowsInFlight) {
    uint32_t bits[kRowsInFlight];
    int64_t where[kRowsInFlight];
#pragma unroll
    for (int k = 0; k < kRowsInFlight; ++k) {
      const int64_t first = row0 + k * kRow + lane * V;
      bits[k] = mask_bits<V>(mask, first, n);
      load(k, first);
    }
#pragma unroll
    for (int k = 0; k < kRowsInFlight; ++k) {
      uint32_t before = 0, row_kept = 0;
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, (bits[k] >> j) & 1u);
        before += __popc(ballot & lanes_below);
        row_kept += __popc(ballot);
      }
      where[k] = at + before;
      at += row_kept;
    }
#pragma unroll
    for (int k = 0; k < kRowsInFlight; ++k) body(k, row0 + k * kRow + lane * V, bits[k], where[k]);
  }
}

// values: exactly the kept elements; *missed (zeroed before) gets the number
// of the others that are not +0, one atomic per warp.
template <typename U, int V>
__global__ void __launch_bounds__(kThreads)
    compact_kernel(const U* __restrict__ y, const uint8_t* __restrict__ mask, const int64_t* __restrict__ ends,
                   int64_t n, U* __restrict__ values, unsigned long long* __restrict__ missed) {
  unsigned long long dropped = 0;  // this lane's unkept elements that are not +0
  for_each_tile(n, [&](int64_t t, int lane) {
    Pack<U, V> in[kRowsInFlight];  // past n: +0, unkept
    for_each_row<V>(
        mask, ends, n, t, lane, [&](int k, int64_t first) { in[k] = load<U, V>(y, first, n); },
        [&](int k, int64_t, uint32_t bits, int64_t at) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            if ((bits >> j) & 1u) {
              values[at++] = in[k].v[j];
            } else {
              dropped += in[k].v[j] != U(0);
            }
          }
        });
  });
  dropped = warp_sum(dropped);
  if ((threadIdx.x & 31) == 0 && dropped != 0) atomicAdd(missed, dropped);
}

// The inverse: out gets values in the kept places and +0 elsewhere. Reads of
// values stay below the mask's kept count, which the host has checked is
// values' size.
template <typename U, int V>
__global__ void __launch_bounds__(kThreads)
    expand_kernel(const U* __restrict__ values, const uint8_t* __restrict__ mask, const int64_t* __restrict__ ends,
                  int64_t n, U* __restrict__ out) {
  for_each_tile(n, [&](int64_t t, int lane) {
    for_each_row<V>(
        mask, ends, n, t, lane, [](int, int64_t) {},
        [&](int, int64_t first, uint32_t bits, int64_t at) {
          Pack<U, V> o;
#pragma unroll
          for (int j = 0; j < V; ++j) o.v[j] = ((bits >> j) & 1u) ? values[at++] : U(0);
          store<U, V>(out, first, n, o);
        });
  });
}

// Bitmap of the elements that are not +0, built like the forward's mask.
template <typename U, int V, int K>
__global__ void __launch_bounds__(kThreads) nonzero_kernel(const U* __restrict__ y, uint8_t* __restrict__ mask, int64_t n) {
  constexpr int64_t kRow = 32 * V;
  for_each_group<V, K>(n, [&](int64_t row0, int lane) {
    Pack<U, V> in[K];
#pragma unroll
    for (int k = 0; k < K; ++k) in[k] = load<U, V>(y, (row0 + k) * kRow + lane * V, n);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      uint32_t bits = 0;
#pragma unroll
      for (int j = 0; j < V; ++j) bits |= uint32_t(in[k].v[j] != U(0)) << j;
      store_row_mask<V>(mask, row0 + k, lane, bits, n);
    }
  });
}

// --- BatchNorm replay (save_compact's recipes) --------------------------------
// An activation output after a BatchNorm, rebuilt, or compared bit for bit
// with the real one, from the BatchNorm's input as PyTorch's CUDA BatchNorm
// computes its output: the contiguous and channels-last transforms
// (ATen/native/cuda/Normalization.cuh) evaluate  w * (x - mean) * invstd + b
// in opmath, which nvcc contracts to fma(w * (x - mean), invstd, b), then
// round to T. Written here with explicit roundings (rn_fma, which
// nvcc never contracts), so that the check and the rebuild compute the same
// bits. A residual add rounds each side to T and adds in opmath (PyTorch's
// add). cuDNN's BatchNorm computes its own way: the check tells whether this
// formula gives its bits (see docs/save_compact.md).
// Terms per channel c of C, in opmath: alpha = [w; invstd], beta = [mean; b]
// (2 x C, what bn_terms gives on CUDA). An element's channel follows from its
// memory offset o in a dense tensor: (o / inner) % C, inner = stride(1).

// fma(a, b, c) rounded once (__fmaf_rn / __fma_rn, never contracted with
// anything else). Each step below is one: a - m is fma(a, 1, -m), a * b is
// fma(a, b, -0.0), a + b is fma(a, 1, b), each exactly the one rounding of
// the plain operation, the sign of zero included.
template <typename M>
RELU_HD M rn_fma(M a, M b, M c) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<M, float>) return __fmaf_rn(a, b, c); else return __fma_rn(a, b, c);
#else
  return std::fma(a, b, c);  // (the emulation)
#endif
}

// A BatchNorm input and its terms (see above); x null: none (no residual add).
template <typename T>
struct BnInput {
  const T* x;
  const OpMath<T>* alpha;
  const OpMath<T>* beta;
};

template <typename T, typename I>
RELU_HD T bn_transform(const BnInput<T>& in, I o, I c, I channels) {
  using M = OpMath<T>;
  const M w = in.alpha[c], invstd = in.alpha[channels + c], mean = in.beta[c], b = in.beta[channels + c];
  const M d = rn_fma(to_m(in.x[o]), M(1), -mean);
  return from_m<T>(rn_fma(rn_fma(w, d, M(-0.0)), invstd, b));
}

template <typename T>
RELU_HD bool bits_differ(T a, T b) {
  using U = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  U ua, ub;
  memcpy(&ua, &a, sizeof(T));
  memcpy(&ub, &b, sizeof(T));
  return ua != ub;
}

// y = act(BN(x) [+ BN2(x2)]) over n elements, one per thread and step
// (grid-stride); with kVerify, y is only read and *differ set to 1 where an
// element differs. Offsets in I: uint32_t below 2^31 elements (its two
// divisions per element are a fraction of 64-bit ones'), else int64_t.
template <typename Act, typename T, bool kVerify, typename I>
__global__ void __launch_bounds__(kThreads)
bn_act_kernel(BnInput<T> in, BnInput<T> in2, I inner, I channels, I n, typename Act::template Params<T> p, T* y,
              int* differ) {
  const I stride = static_cast<I>(gridDim.x) * kThreads;
  for (I o = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; o < n; o += stride) {
    const I c = (o / inner) % channels;
    T v = bn_transform(in, o, c, channels);
    if (in2.x != nullptr) v = from_m<T>(rn_fma(to_m(v), OpMath<T>(1), to_m(bn_transform(in2, o, c, channels))));
    const T r = Act::template forward<true>(v, p);
    if constexpr (kVerify) {
      if (bits_differ(r, y[o])) *differ = 1;
    } else {
      y[o] = r;
    }
  }
}

}  // namespace
}  // namespace relu_ext
