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

#include <ATen/core/Tensor.h>

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
void dispatch_bits(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kHalf: fn(Format<uint16_t, kInfF16>{}); break;
    case at::kBFloat16: fn(Format<uint16_t, kInfBF16>{}); break;
    case at::kFloat: fn(Format<uint32_t, kInfF32>{}); break;
    case at::kDouble: fn(Format<uint64_t, kInfF64>{}); break;
    default: TORCH_CHECK(false, "relu_ext: unsupported dtype ", dtype);
  }
}

// Calls fn(U{}) with the unsigned integer of `t`'s element width (the
// compaction kernels move elements as such integers).
template <typename Fn>
void dispatch_width(const at::Tensor& t, Fn&& fn) {
  switch (t.element_size()) {
    case 2: fn(uint16_t{}); break;
    case 4: fn(uint32_t{}); break;
    case 8: fn(uint64_t{}); break;
    default: TORCH_CHECK(false, "relu_ext: no compaction for elements of ", t.element_size(), " bytes");
  }
}

// ReLU's float kernels are act_forward_* / act_backward_*<Relu>
// (activations.h). forward_int_* is its integer forward (int8/16/32/64,
// uint8) on dense tensors in memory order, x possibly aliasing y:
// y = x < 0 ? 0 : x, as torch.relu; integers carry no gradient, so no mask.
void forward_int_cpu(const at::Tensor& x, const at::Tensor& y);
// CPU kernel sets, each needing more of the CPU than the one before; the set
// in use is chosen at run time (relu_cpu.cpp) and serves every CPU kernel.
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
Isa cpu_kernels();
const char* cpu_isa();  // the name of cpu_kernels()
// Whether the activations' kernels (relu_cpu.cpp, family_cpu.cpp) for
// elements of type T take the AVX-512 set's 512-bit code on an AVX-512 CPU;
// otherwise they run the AVX2 code there. The 32- and 64-bit ones only move
// data, and their 512-bit stores measured 5-25% slower at 4M-16M elements
// (Zen 4), where the 256-bit code runs at PyTorch's speed; PyTorch itself
// runs the AVX2 code of its element-wise kernels on AVX-512 CPUs
// (REGISTER_DISPATCH). The 16-bit kernels keep 512 bits: the family's, which
// convert through float, took 0.55-0.8x the 256-bit code's time; ReLU's, on
// the bits, 0.85-1.09x.
template <typename T>
constexpr bool kActivation512 = sizeof(T) == 2;
void set_cpu_isa(const std::string& name);

// Compaction by a bitmap (compact_cpu.cpp), on dense tensors in memory order,
// elements of 2, 4 or 8 bytes moved as integers. compact: the elements whose
// bit is set, and in *missed the number of the others that are not +0 (bits
// all zero), which expand cannot restore; expand: the inverse into `out`
// (bits unset become +0); nonzero_mask: the bitmap of elements whose bits are
// not all zero.
at::Tensor compact_cpu(const at::Tensor& y, const uint8_t* mask, int64_t* missed);
void expand_cpu(const at::Tensor& values, const uint8_t* mask, const at::Tensor& out);
void nonzero_mask_cpu(const at::Tensor& y, uint8_t* mask);
// A tensor of +0 and at most one other bit pattern (CPU dropout's noise: 0
// and 1 / (1 - p)): binary_mask writes its nonzero_mask and that pattern into
// `value` (a scalar of y's dtype; +0 when there is none), and returns false,
// the mask then unfinished, when y has a second nonzero pattern;
// binary_expand is the inverse into `out`.
bool binary_mask_cpu(const at::Tensor& y, uint8_t* mask, const at::Tensor& value);
void binary_expand_cpu(const uint8_t* mask, const at::Tensor& value, const at::Tensor& out);
// Whether a and b (CPU, the same sizes and dtype, any strides) hold the same
// bits (compact_cpu.cpp; save_compact's check that a concatenation begins
// with the one before it). torch.equal compares numbers (NaN != NaN), one
// element at a time; this compares memory, a contiguous run at a time.
bool same_bits_cpu(const at::Tensor& a, const at::Tensor& b);

#ifdef WITH_CUDA
void forward_int_cuda(const at::Tensor& x, const at::Tensor& y);
// Rows of 32 16-byte vectors a warp loads per loop iteration in the vector
// kernels (1, 2 or 4; all three are compiled): for tests and tuning.
int cuda_unroll();
void set_cuda_unroll(int64_t rows);
int cuda_waves();
void set_cuda_waves(int64_t waves);
// Compaction as the CPU's above, on y's device and current stream. compact
// sets `missed` to an int64 scalar tensor on the device (not read back: the
// one host sync is for the size of values); nonzero_mask's mask must be
// 4-byte aligned (a fresh allocation is).
at::Tensor compact_cuda(const at::Tensor& y, const uint8_t* mask, at::Tensor& missed);
void expand_cuda(const at::Tensor& values, const uint8_t* mask, const at::Tensor& out);
void nonzero_mask_cuda(const at::Tensor& y, uint8_t* mask);
#endif

}  // namespace relu_ext
