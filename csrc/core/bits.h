// Shared by the CPU and CUDA backends: the element-wise contract, written on
// the raw bits so that it is exact for every float format and independent of
// the FPU's denormal / NaN modes.
//
// Forward  (same as PyTorch's clamp_min(x, 0) on CPU and CUDA):
//   y = NaN -> x (payload kept), x < 0 -> +0, otherwise x (so -0.0 stays -0.0).
// Mask bit (same as PyTorch's threshold_backward(grad, y, 0) test):
//   keep = !(y <= 0)  ==  x > 0 or x is NaN.
// Backward: grad_in = keep ? grad : +0  (a select, not a product, so a NaN or
//   -0.0 gradient at a dropped element still gives +0, as PyTorch does).
//
// Mask layout: bit k of the mask (byte k / 8, bit k % 8) belongs to the k-th
// element of the tensor in memory order; ceil(n / 8) bytes, uint8.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#if defined(__CUDACC__)
#define RELU_HD __host__ __device__ __forceinline__
#else
#define RELU_HD inline
#endif

namespace relu_ext {

// `U` is the unsigned integer of the float's width; `kInf` the bit pattern of
// +inf (what tells NaN from inf when the exponent is all ones).
template <typename U>
struct Bits {
  static constexpr U kSign = U(U(1) << (8 * sizeof(U) - 1));
  static constexpr U kAbs = U(~kSign);
};

template <typename U, U kInf>
RELU_HD bool relu_keep(U b) {
  using S = typename std::make_signed<U>::type;
  return S(b) > 0 || U(b & Bits<U>::kAbs) > kInf;
}

template <typename U>
RELU_HD U relu_value(U b, bool keep) {
  return (keep || b == Bits<U>::kSign) ? b : U(0);
}

constexpr uint16_t kInfF16 = 0x7C00;
constexpr uint16_t kInfBF16 = 0x7F80;
constexpr uint32_t kInfF32 = 0x7F800000u;
constexpr uint64_t kInfF64 = 0x7FF0000000000000ull;

template <typename U_, U_ kInf_>
struct Format {
  using U = U_;
  static constexpr U kInf = kInf_;
};

// Calls `fn(Format<U, kInf>{})` for the float format of `dtype` (a tag, so a
// C++17 generic lambda can take it).
template <typename Fn>
void dispatch_bits(c10::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case c10::kHalf: fn(Format<uint16_t, kInfF16>{}); break;
    case c10::kBFloat16: fn(Format<uint16_t, kInfBF16>{}); break;
    case c10::kFloat: fn(Format<uint32_t, kInfF32>{}); break;
    case c10::kDouble: fn(Format<uint64_t, kInfF64>{}); break;
    default: TORCH_CHECK(false, "relu_ext: unsupported dtype ", dtype);
  }
}

// Calls fn(U{}) with the unsigned integer of an element's width in bytes (the
// compaction kernels move elements as such integers).
template <typename Fn>
void dispatch_width(int64_t width, Fn&& fn) {
  switch (width) {
    case 2: fn(uint16_t{}); break;
    case 4: fn(uint32_t{}); break;
    case 8: fn(uint64_t{}); break;
    default: TORCH_CHECK(false, "relu_ext: no compaction for elements of ", width, " bytes");
  }
}

}  // namespace relu_ext
