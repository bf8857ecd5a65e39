// The activation table: ReLU and its 1-bit family, each as a trait that the
// ops and their autograd node (family.cpp), install() (install.cpp), the
// Python module (module.cpp), the BatchNorm replay (replay_cpu.cpp) and the
// kernels are written once over. The family's kernels are generic over the
// trait (family_cpu.cpp, kernels.cuh); ReLU's are its own, tuned on
// the raw bits (core/bits.h, relu_cpu.cpp, cuda.cu), behind the same
// act_forward_* / act_backward_* names.
//
// A trait gives, for a storage type T (float, double, c10::Half,
// c10::BFloat16; M = at::opmath_type<T>, float for the 16-bit types):
//   Params<T>      the scalar arguments as PyTorch converts them for T
//                  (c10::Scalar::to<T>, which raises on overflow as PyTorch does);
//                  params<T, kCuda>(args) builds them for the CPU or CUDA kernels;
//   forward<kCuda>(x, p)  the output, computed as PyTorch's scalar CPU loop
//                  does (kCuda false) or as its CUDA kernel does (kCuda true);
//   keep(x, p)     the mask bit: PyTorch's backward predicate on the input;
//   grad(g, k, p)  grad_in from grad and the mask bit;
//   widen(p)       Params<M> with which the functions above, applied to
//                  to_m(x) and rounded to T once, give what they give on x
//                  (the 16-bit ops compute in opmath and round once): the
//                  CPU's float16 kernels convert a block with the hardware's
//                  instructions and run the trait on floats;
//   nan_output(args)  whether PyTorch's op writes NaN to every element for
//                  these arguments, whatever the input (hardtanh is clamp,
//                  which fills its output with NaN where a bound is NaN);
//                  the mask (keep) is computed as ever.
// kArgs: how many Scalar arguments the op takes; kSchemaArgs: them in schema
// syntax (with PyTorch's defaults); kNode: the backward node's name;
// kGradScales: whether grad computes with g (in opmath) rather than picking
// g or 0 (the CPU's float16 backward converts only then); kInts: whether the
// public op has its own integer kernel (relu) rather than PyTorch's.
//
// Layouts and what a backward reads, as PyTorch's kernels and
// derivatives.yaml have them (layout.h): kOutputLikeInput: the forward
// allocates empty_like(x) (hardtanh) rather than a TensorIterator output;
// kGradLeads: the backward's TensorIterator takes grad_output first
// (hardtanh_backward, hardsigmoid_backward) rather than self;
// kReadsResult / kInplaceReadsResult: the backward formula of the op / of its
// in-place form reads the output (relu: threshold_backward(grad, result, 0))
// rather than the input (an in-place form: a clone of it). That tensor's
// strides lay out grad_in, and a gradient taken with create_graph=True
// depends on it (with a zero derivative). kTangentAddsZero: the forward
// derivative of PyTorch's backward op adds zeros to its result
// (threshold_backward's: zeros_like(self_t) + threshold_backward(grad_output_t,
// ...)), so that a -0.0 in grad's tangent comes out +0.0 (forward-over-reverse:
// torch.func.hessian, jvp of a gradient).
//
// PyTorch's CUDA kernels differ from its CPU ones in two ops, and relu_ext's
// CUDA kernels follow them there (kCuda): threshold compares with the
// threshold rounded to T (threshold.to<scalar_t>()), and hardsigmoid
// multiplies by the float 1/6 instead of dividing by 6 (otherwise 1-ulp
// differences from PyTorch's CUDA results in float32 / float64).
//
// Where PyTorch's vectorized CPU loop and its scalar loop disagree, the
// scalar loop is followed:
// NaN payloads (the vectorized hardtanh / hardsigmoid / 16-bit loops write
// all-ones NaNs) and hardtanh's gradient at a NaN input or with a NaN bound
// (the scalar predicate `!(x <= min || x >= max)` passes it, the vectorized
// loop drops it).
#pragma once

#include <array>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

#include <ATen/OpMathType.h>
#include <ATen/core/ATen_fwd.h>  // at::Tensor, declared (the kernels' headers stay light for nvcc)
#include <c10/core/Scalar.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include "core/bits.h"
#include "core/isa.h"

namespace relu_ext {

// An op's Scalar arguments, in schema order; unused ones stay 0.
using ActArgs = std::array<c10::Scalar, 2>;

template <typename T>
using OpMath = at::opmath_type<T>;

// T to opmath and back (round to nearest even; a NaN becomes the canonical
// NaN, as c10's conversions give). On the CPU bfloat16's is written without
// a branch, so that the compiler vectorizes it.
template <typename T>
RELU_HD OpMath<T> to_m(T x) {
  return static_cast<OpMath<T>>(x);
}
template <typename T>
RELU_HD T from_m(OpMath<T> v) {
  return static_cast<T>(v);
}
#if !defined(__CUDACC__)
template <>
inline c10::BFloat16 from_m<c10::BFloat16>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(v != v ? uint16_t(0x7FC0) : rounded, c10::BFloat16::from_bits());
}
#endif

// relu(x): core/bits.h's contract, here in opmath terms for the replay
// (x < 0 -> +0, else x itself: NaN payload and -0.0 kept; mask !(y <= 0)).
struct Relu {
  static constexpr const char* kName = "relu";
  static constexpr const char* kNode = "ReluExtBackward0";
  static constexpr const char* kSchemaArgs = "";
  static constexpr int kArgs = 0;
  static constexpr bool kGradScales = false;
  static constexpr bool kInts = true;
  static constexpr bool kOutputLikeInput = false;
  static constexpr bool kGradLeads = false;
  static constexpr bool kReadsResult = true;
  static constexpr bool kInplaceReadsResult = true;
  static constexpr bool kTangentAddsZero = true;
  template <typename T>
  struct Params {};
  template <typename T, bool kCuda = false>
  static Params<T> params(const ActArgs&) {
    return {};
  }
  static bool nan_output(const ActArgs&) { return false; }
  template <typename T>
  static Params<OpMath<T>> widen(const Params<T>&) {
    return {};
  }
  template <bool kCuda = false, typename T>
  RELU_HD static T forward(T x, const Params<T>&) {
    return to_m(x) < OpMath<T>(0) ? T(0) : x;
  }
  template <typename T>
  RELU_HD static bool keep(T x, const Params<T>&) {
    return !(to_m(x) <= OpMath<T>(0));
  }
  template <typename T>
  RELU_HD static T grad(T g, bool keep, const Params<T>&) {
    return keep ? g : T(0);
  }
};

// hardtanh(x, min_val, max_val) = clamp(x, min, max): the forward compares
// with the bounds rounded to T, as PyTorch's clamp does (a bound that rounds
// to +0.0 keeps a -0.0 input: std::max(-0.0, +0.0) is -0.0), the backward's
// mask with the bounds in opmath, as PyTorch's backward does; the output is
// x itself (NaN payload kept) or a bound in T.
struct Hardtanh {
  static constexpr const char* kName = "hardtanh";
  static constexpr const char* kNode = "HardtanhExtBackward0";
  static constexpr const char* kSchemaArgs = ", Scalar min_val=-1, Scalar max_val=1";
  static constexpr int kArgs = 2;
  static constexpr bool kGradScales = false;
  static constexpr bool kInts = false;
  static constexpr bool kOutputLikeInput = true;
  static constexpr bool kGradLeads = true;
  static constexpr bool kReadsResult = false;
  static constexpr bool kInplaceReadsResult = false;
  static constexpr bool kTangentAddsZero = false;
  template <typename T>
  struct Params {
    OpMath<T> lo, hi;
    T lo_t, hi_t;
  };
  template <typename T, bool kCuda = false>
  static Params<T> params(const ActArgs& a) {
    // A NaN bound: the output is NaN (nan_output) and PyTorch converts no
    // bound to T, so a 16-bit overflow of the other one raises nothing.
    if (nan_output(a)) return {a[0].to<OpMath<T>>(), a[1].to<OpMath<T>>(), T(0), T(0)};
    return {a[0].to<OpMath<T>>(), a[1].to<OpMath<T>>(), a[0].to<T>(), a[1].to<T>()};
  }
  static bool nan_output(const ActArgs& a) {
    return a[0].toDouble() != a[0].toDouble() || a[1].toDouble() != a[1].toDouble();
  }
  template <typename T>
  static Params<OpMath<T>> widen(const Params<T>& p) {
    return {p.lo, p.hi, to_m(p.lo_t), to_m(p.hi_t)};
  }
  template <bool kCuda = false, typename T>
  RELU_HD static T forward(T x, const Params<T>& p) {
    const OpMath<T> v = to_m(x), lo = to_m(p.lo_t), hi = to_m(p.hi_t);
    const bool low = v < lo;  // std::max(x, lo): x when NaN
    const OpMath<T> m = low ? lo : v;
    // A max and a min instruction where T is the opmath type: float and
    // double, and the float16 kernels' float pass (widen), whose T bounds
    // are the 16-bit ones, which every float of a 16-bit value rounds back to.
    if constexpr (std::is_same_v<T, OpMath<T>>) return hi < m ? hi : m;
    return hi < m ? p.hi_t : (low ? p.lo_t : x);  // std::min(.., hi)
  }
  template <typename T>
  RELU_HD static bool keep(T x, const Params<T>& p) {
    const OpMath<T> v = to_m(x);
    return !(v <= p.lo || v >= p.hi);
  }
  template <typename T>
  RELU_HD static T grad(T g, bool keep, const Params<T>&) {
    return keep ? g : T(0);
  }
};

// leaky_relu(x, negative_slope): x > 0 ? x : x * slope, in opmath.
struct LeakyRelu {
  static constexpr const char* kName = "leaky_relu";
  static constexpr const char* kNode = "LeakyReluExtBackward0";
  static constexpr const char* kSchemaArgs = ", Scalar negative_slope=0.01";
  static constexpr int kArgs = 1;
  static constexpr bool kGradScales = true;
  static constexpr bool kInts = false;
  static constexpr bool kOutputLikeInput = false;
  static constexpr bool kGradLeads = false;
  static constexpr bool kReadsResult = false;
  static constexpr bool kInplaceReadsResult = true;
  static constexpr bool kTangentAddsZero = false;
  template <typename T>
  struct Params {
    OpMath<T> slope;
  };
  template <typename T, bool kCuda = false>
  static Params<T> params(const ActArgs& a) {
    return {a[0].to<OpMath<T>>()};
  }
  static bool nan_output(const ActArgs&) { return false; }
  template <typename T>
  static Params<OpMath<T>> widen(const Params<T>& p) {
    return {p.slope};
  }
  template <bool kCuda = false, typename T>
  RELU_HD static T forward(T x, const Params<T>& p) {
    const OpMath<T> v = to_m(x);
    return v > OpMath<T>(0) ? x : from_m<T>(v * p.slope);
  }
  template <typename T>
  RELU_HD static bool keep(T x, const Params<T>&) {
    return to_m(x) > OpMath<T>(0);
  }
  template <typename T>
  RELU_HD static T grad(T g, bool keep, const Params<T>& p) {
    return keep ? g : from_m<T>(to_m(g) * p.slope);
  }
};

// threshold(x, threshold, value): x <= threshold ? value : x, value in T.
// On the CPU the threshold is compared in opmath (not rounded to a 16-bit
// type); PyTorch's CUDA kernel rounds it to T first, forward and backward.
struct Threshold {
  static constexpr const char* kName = "threshold";
  static constexpr const char* kNode = "ThresholdExtBackward0";
  static constexpr const char* kSchemaArgs = ", Scalar threshold, Scalar value";
  static constexpr int kArgs = 2;
  static constexpr bool kGradScales = false;
  static constexpr bool kInts = false;
  static constexpr bool kOutputLikeInput = false;
  static constexpr bool kGradLeads = false;
  static constexpr bool kReadsResult = false;
  static constexpr bool kInplaceReadsResult = false;
  static constexpr bool kTangentAddsZero = true;
  template <typename T>
  struct Params {
    OpMath<T> threshold;
    T value;
  };
  template <typename T, bool kCuda = false>
  static Params<T> params(const ActArgs& a) {
    // Only the CUDA path converts to T, so only it raises on a 16-bit overflow, as PyTorch's does.
    return {kCuda ? OpMath<T>(a[0].to<T>()) : a[0].to<OpMath<T>>(), a[1].to<T>()};
  }
  static bool nan_output(const ActArgs&) { return false; }
  template <typename T>
  static Params<OpMath<T>> widen(const Params<T>& p) {
    return {p.threshold, to_m(p.value)};
  }
  template <bool kCuda = false, typename T>
  RELU_HD static T forward(T x, const Params<T>& p) {
    return to_m(x) <= p.threshold ? p.value : x;
  }
  template <typename T>
  RELU_HD static bool keep(T x, const Params<T>& p) {
    return !(to_m(x) <= p.threshold);
  }
  template <typename T>
  RELU_HD static T grad(T g, bool keep, const Params<T>&) {
    return keep ? g : T(0);
  }
};

// hardsigmoid(x) = min(max(x + 3, 0), 6) / 6 in opmath (on CUDA, and for the
// 16-bit types, * (1/6): the same results);
// gradient g * (1/6) inside (-3, 3); 1/6 is the float 1.0f / 6.0f for every
// dtype, as in PyTorch.
struct Hardsigmoid {
  static constexpr const char* kName = "hardsigmoid";
  static constexpr const char* kNode = "HardsigmoidExtBackward0";
  static constexpr const char* kSchemaArgs = "";
  static constexpr int kArgs = 0;
  static constexpr bool kGradScales = true;
  static constexpr bool kInts = false;
  static constexpr bool kOutputLikeInput = false;
  static constexpr bool kGradLeads = true;
  static constexpr bool kReadsResult = false;
  static constexpr bool kInplaceReadsResult = false;
  static constexpr bool kTangentAddsZero = false;
  // The clamp's bounds 0 and 6, as values: given constants, GCC turns the
  // clamp and the division into compares, masked selects and a masked
  // division, which made the CPU's training forward 1.5x PyTorch's time.
  template <typename T>
  struct Params {
    OpMath<T> zero, six;
  };
  template <typename T, bool kCuda = false>
  static Params<T> params(const ActArgs&) {
    return {OpMath<T>(0), OpMath<T>(6)};
  }
  static bool nan_output(const ActArgs&) { return false; }
  template <typename T>
  static Params<OpMath<T>> widen(const Params<T>& p) {
    return {p.zero, p.six};
  }
  template <bool kCuda = false, typename T>
  RELU_HD static T forward(T x, const Params<T>& p) {
    using M = OpMath<T>;
    const M a = to_m(x) + M(3);
    const M lo = a < p.zero ? p.zero : a;  // std::max(a, 0)
    const M hi = p.six < lo ? p.six : lo;  // std::min(lo, 6)
    // For the 16-bit types the product with 1/6 and the quotient round to
    // the same T for every one of the 65536 inputs (tests/activations/test_family.py
    // checks them all), and the division bounds the CPU loop.
    return from_m<T>(kCuda || sizeof(T) == 2 ? hi * M(1.0f / 6.0f) : hi / M(6));
  }
  template <typename T>
  RELU_HD static bool keep(T x, const Params<T>&) {
    using M = OpMath<T>;
    const M v = to_m(x);
    return v > M(-3) && v < M(3);
  }
  template <typename T>
  RELU_HD static T grad(T g, bool keep, const Params<T>&) {
    using M = OpMath<T>;
    return keep ? from_m<T>(to_m(g) * M(1.0f / 6.0f)) : T(0);
  }
};

// The table, declared once: X(Trait). Every list of ops, nodes, install
// targets and replays in C++ is generated from RELU_EXT_ACTIVATIONS;
// RELU_EXT_FAMILY is the part whose kernels are the generic ones.
#define RELU_EXT_FAMILY(X) \
  X(Hardtanh)              \
  X(LeakyRelu)             \
  X(Threshold)             \
  X(Hardsigmoid)
#define RELU_EXT_ACTIVATIONS(X) \
  X(Relu)                       \
  RELU_EXT_FAMILY(X)

// fn(Trait{}) for the activation named `name` (the replays take it by name).
template <typename Fn>
void with_act(const std::string& name, Fn&& fn) {
#define RELU_EXT_ACT(Act) \
  if (name == Act::kName) return fn(Act{});
  RELU_EXT_ACTIVATIONS(RELU_EXT_ACT)
#undef RELU_EXT_ACT
  TORCH_CHECK(false, "relu_ext: no activation '", name, "' to replay (relu, hardtanh, leaky_relu, threshold, hardsigmoid)");
}

// A replay's float arguments as activation `act`'s Scalars (its count checked).
template <typename Act>
ActArgs act_args(const std::string& act, c10::ArrayRef<double> args) {
  TORCH_CHECK(static_cast<int64_t>(args.size()) == Act::kArgs, "relu_ext: ", act, " takes ", Act::kArgs,
              " arguments, got ", args.size());
  ActArgs a;
  for (size_t i = 0; i < args.size() && i < a.size(); ++i) a[i] = c10::Scalar(args[i]);
  return a;
}

// Kernels on dense tensors in memory order (x may alias y; mask may be null:
// no mask is written). Float dtypes only: integer tensors never reach them
// (relu's go to forward_int_*). ReLU's are relu_cpu.cpp's, on the raw bits
// (core/bits.h).
template <typename Act>
void act_forward_cpu(const at::Tensor& x, const at::Tensor& y, uint8_t* mask, const ActArgs& args);
template <typename Act>
void act_backward_cpu(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in, const ActArgs& args);
template <>
void act_forward_cpu<Relu>(const at::Tensor& x, const at::Tensor& y, uint8_t* mask, const ActArgs& args);
template <>
void act_backward_cpu<Relu>(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in,
                            const ActArgs& args);
// ReLU's integer forward (int8/16/32/64, uint8) on dense tensors in memory
// order, x possibly aliasing y: y = x < 0 ? 0 : x, as torch.relu; integers
// carry no gradient, so no mask.
void forward_int_cpu(const at::Tensor& x, const at::Tensor& y);
// Whether the CPU kernels for elements of type T take the AVX-512 set's
// 512-bit code on an AVX-512 CPU; otherwise they run the AVX2 code there. The
// 32- and 64-bit ones only move data, and their 512-bit stores were slower
// than the 256-bit code, which runs at PyTorch's speed (docs/performance.md);
// PyTorch itself runs the AVX2 code of its element-wise kernels on AVX-512
// CPUs. The 16-bit kernels gain from 512 bits.
template <typename T>
constexpr bool kActivation512 = sizeof(T) == 2;

#ifdef WITH_CUDA
void forward_int_cuda(const at::Tensor& x, const at::Tensor& y);
template <typename Act>
void act_forward_cuda(const at::Tensor& x, const at::Tensor& y, uint8_t* mask, const ActArgs& args);
template <typename Act>
void act_backward_cuda(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in, const ActArgs& args);
#endif

}  // namespace relu_ext
