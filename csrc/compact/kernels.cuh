// save_compact's CUDA kernels: compaction by a bitmap and the BatchNorm
// replay (device code). cuda.cu launches them, tests/activations/cuda_emulation.cpp runs
// them on the CPU.
#pragma once

#include "activations/activations.h"
#include "core/cuda.cuh"

namespace relu_ext {
namespace {

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

// values (`total` elements): the kept elements; *missed (zeroed before) gets
// the number of the others that are not +0, one atomic per warp, and 1 more
// where the mask keeps other than `total` elements (nothing is written past
// values then): the size came from a count the host did not wait for.
template <typename U, int V>
__global__ void __launch_bounds__(kThreads)
    compact_kernel(const U* __restrict__ y, const uint8_t* __restrict__ mask, const int64_t* __restrict__ ends,
                   int64_t n, U* __restrict__ values, int64_t total, unsigned long long* __restrict__ missed) {
  unsigned long long dropped = 0;  // this lane's unkept elements that are not +0
  if (blockIdx.x == 0 && threadIdx.x == 0 && ends[(n + kTile - 1) / kTile - 1] != total) dropped = 1;
  for_each_tile(n, [&](int64_t t, int lane) {
    Pack<U, V> in[kRowsInFlight];  // past n: +0, unkept
    for_each_row<V>(
        mask, ends, n, t, lane, [&](int k, int64_t first) { in[k] = load<U, V>(y, first, n); },
        [&](int k, int64_t, uint32_t bits, int64_t at) {
#pragma unroll
          for (int j = 0; j < V; ++j) {
            if ((bits >> j) & 1u) {
              if (at < total) values[at] = in[k].v[j];
              ++at;
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
// values stay below `total`, its size (the mask keeps as many where the host
// checked it, or where values came from compact with this mask).
template <typename U, int V>
__global__ void __launch_bounds__(kThreads)
    expand_kernel(const U* __restrict__ values, int64_t total, const uint8_t* __restrict__ mask,
                  const int64_t* __restrict__ ends, int64_t n, U* __restrict__ out) {
  for_each_tile(n, [&](int64_t t, int lane) {
    for_each_row<V>(
        mask, ends, n, t, lane, [](int, int64_t) {},
        [&](int, int64_t first, uint32_t bits, int64_t at) {
          Pack<U, V> o;
#pragma unroll
          for (int j = 0; j < V; ++j) {
            const bool kept = (bits >> j) & 1u;
            o.v[j] = kept && at < total ? values[at] : U(0);
            at += kept;
          }
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
// (grid-stride); with a differ flag, y is only read and *differ set to 1
// where an element differs. (A flag, not a template parameter: the branch is
// the same for every thread, and one kernel for both halves the device code
// every architecture compiles.) Offsets in I: uint32_t below 2^31 elements
// (its two divisions per element are a fraction of 64-bit ones'), else int64_t.
template <typename Act, typename T, typename I>
__global__ void __launch_bounds__(kThreads)
bn_act_kernel(BnInput<T> in, BnInput<T> in2, I inner, I channels, I n, typename Act::template Params<T> p, T* y,
              int* differ) {
  const I stride = static_cast<I>(gridDim.x) * kThreads;
  for (I o = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x; o < n; o += stride) {
    const I c = (o / inner) % channels;
    T v = bn_transform(in, o, c, channels);
    if (in2.x != nullptr) v = from_m<T>(rn_fma(to_m(v), OpMath<T>(1), to_m(bn_transform(in2, o, c, channels))));
    const T r = Act::template forward<true>(v, p);
    if (differ == nullptr) {
      y[o] = r;
    } else if (bits_differ(r, y[o])) {
      *differ = 1;
    }
  }
}

}  // namespace
}  // namespace relu_ext
