// The activations' CUDA kernels: the device code. Same contract as the CPU
// ones (core/bits.h, activations.h), on the shared loops of core/cuda.cuh;
// cuda.cu launches them, tests/activations/cuda_emulation.cpp runs them on the CPU.
#pragma once

#include "activations/activations.h"
#include "core/cuda.cuh"

namespace relu_ext {
namespace {

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


}  // namespace
}  // namespace relu_ext
