// BatchNorm -> activation replay on the CPU (save_compact's recipes): an
// activation output whose input is a BatchNorm output is rebuilt from what
// the BatchNorm node keeps anyway (its input x) and two numbers per channel,
// exactly as PyTorch's CPU kernels computed it (aten/src/ATen/native/cpu/
// batch_norm_kernel.cpp):
//   alpha = invstd * weight, beta = bias - mean * alpha   (opmath; one fma where the
//                                                         parameters are in opmath, two roundings
//                                                         where they are 16-bit: c10's Half /
//                                                         BFloat16 operators are not contracted)
//   invstd = 1 / sqrt(running_var + eps)                  (eval; training keeps save_invstd)
//   bn = T(fma(x, alpha, beta))                           (opmath, rounded to x's dtype)
//   y = act(bn)                                           (the trait's CPU forward)
// or, after a residual add (`out += identity`, x2 given with its own terms):
//   y = act(T(bn + T(fma(x2, alpha2, beta2))))            (the sum in opmath, as PyTorch's add;
//                                                         alpha2 = 1, beta2 = -0.0 add x2 as it is)
// PyTorch's kernels are built with FMA contraction for AVX2 / AVX-512; where
// it ran otherwise (another ISA, a layout its fast paths do not take) the
// replay differs, which the pack-time verification sees (bn_act_verify):
// the tensor is then kept another way, never rebuilt wrong.
//
// An element's channel follows from its memory offset o in a dense tensor:
// (o / stride(1)) % size(1). Runs of stride(1) elements share a channel
// (NCHW: a plane), or, with stride(1) == 1 (channels last, N x C), rows of
// size(1) elements walk the channels.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math", "no-math-errno", "fp-contract=off")  // vectorized selects and fma; no fma but ours
#endif

#include "compact/compact.h"
#include "core/half_block.h"
#include "core/isa.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#define REPLAY_INLINE inline __attribute__((always_inline))

namespace relu_ext {
namespace {

constexpr int64_t kGrain = 32768;

template <typename T>
REPLAY_INLINE auto bits_of(T v) {
  using U = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
  U u;
  std::memcpy(&u, &v, sizeof(T));
  return u;
}

template <typename Act, typename T>
using P = typename Act::template Params<T>;

constexpr int64_t kBlock = kHalfBlock;

// A BatchNorm input and its per-channel terms, as one stretch reads them:
// a, b for a stretch of one channel, or the arrays ar, br for a row of channels.
template <typename T>
struct Src {
  const T* x;
  const OpMath<T>* ar;
  const OpMath<T>* br;
  OpMath<T> a, b;
};

// The BatchNorm output in T (opmath fma, rounded once).
template <typename T, bool kRow>
REPLAY_INLINE T bn_at(const T* __restrict x, const OpMath<T>* __restrict ar, const OpMath<T>* __restrict br,
                      OpMath<T> a, OpMath<T> b, int64_t j) {
  return from_m<T>(std::fma(to_m(x[j]), kRow ? ar[j] : a, kRow ? br[j] : b));
}

// One element: the BatchNorm output, with kRes plus the second one (added in
// opmath and rounded to T: PyTorch's `out += identity`), then the activation.
template <typename Act, typename T, bool kVerify, bool kRow, bool kRes, typename U>
REPLAY_INLINE void one(const T* __restrict x, const OpMath<T>* __restrict ar, const OpMath<T>* __restrict br,
                       OpMath<T> a, OpMath<T> b, const T* __restrict x2, const OpMath<T>* __restrict ar2,
                       const OpMath<T>* __restrict br2, OpMath<T> a2, OpMath<T> b2, T* __restrict y, int64_t j,
                       const P<Act, T>& p, U& diff) {
  T v = bn_at<T, kRow>(x, ar, br, a, b, j);
  if constexpr (kRes) v = from_m<T>(to_m(v) + to_m(bn_at<T, kRow>(x2, ar2, br2, a2, b2, j)));
  v = Act::forward(v, p);
  if constexpr (kVerify) {
    diff |= bits_of(v) ^ bits_of(y[j]);
  } else {
    std::memcpy(y + j, &v, sizeof(T));  // (a 16-bit struct's member store keeps GCC from vectorizing)
  }
}

#ifdef RELU_EXT_HALF_BLOCK
// bfloat16 to float and back a block at a time, on the bits with AVX2's
// integer instructions (c10::BFloat16's own operations vectorize poorly;
// docs/performance.md has the figures). Exact one way; the other is
// from_m's: round to nearest even, a NaN becomes 0x7FC0. Only the AVX2 set
// runs it (pick_body() below).
struct Bf16Block {
  // Eight bfloat16 as floats.
  __attribute__((target("avx2"))) static __m256 load8(const c10::BFloat16* h) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  // Eight floats rounded to bfloat16, as the upper halves of 32-bit lanes (the lower ones 0).
  __attribute__((target("avx2"))) static __m256i round8(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb),
                                       _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
  }
  // Sixteen floats rounded to sixteen bfloat16, in order.
  __attribute__((target("avx2"))) static __m256i pack16(const float* f) {
    const __m256i lo = _mm256_srli_epi32(round8(_mm256_loadu_ps(f)), 16);
    const __m256i hi = _mm256_srli_epi32(round8(_mm256_loadu_ps(f + 8)), 16);
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);  // (packus interleaves the 128-bit lanes)
  }
  __attribute__((target("avx2"))) static void widen(const c10::BFloat16* h, float* f) {
    for (int v = 0; v < kHalfBlock / 8; ++v) _mm256_storeu_ps(f + 8 * v, load8(h + 8 * v));
  }
  __attribute__((target("avx2"))) static void round(float* f) {
    for (int v = 0; v < kHalfBlock / 8; ++v) {
      _mm256_storeu_ps(f + 8 * v, _mm256_castsi256_ps(round8(_mm256_loadu_ps(f + 8 * v))));
    }
  }
  __attribute__((target("avx2"))) static void narrow(const float* f, c10::BFloat16* h) {
    for (int v = 0; v < kHalfBlock / 16; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + 16 * v), pack16(f + 16 * v));
    }
  }
  __attribute__((target("avx2"))) static bool differs(const float* f, const c10::BFloat16* h) {
    __m256i acc = _mm256_setzero_si256();
    for (int v = 0; v < kHalfBlock / 16; ++v) {
      const __m256i had = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16 * v));
      acc = _mm256_or_si256(acc, _mm256_xor_si256(pack16(f + 16 * v), had));
    }
    return !_mm256_testz_si256(acc, acc);
  }
};

// The same with AVX-512 where the CPU has AVX512_BF16 (Zen 4, Sapphire Rapids):
// its conversion rounds to nearest even in one instruction, but reads a
// denormal as zero and keeps a NaN's payload, so sixteen floats with a
// denormal or a NaN among them take the integer rounding above instead.
struct Bf16Block512 {
  // Sixteen bfloat16 as floats.
  RELU_EXT_AVX512_BF16 static __m512 load16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  RELU_EXT_AVX512_BF16 static __m256i at(const c10::BFloat16* h) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
  }
  // Sixteen floats rounded to bfloat16 as from_m rounds them.
  RELU_EXT_AVX512_BF16 static __m256i narrow16(__m512 f) {
    if (__builtin_expect(_mm512_fpclass_ps_mask(f, 0xA1) == 0, 1)) {  // (no NaN, quiet or signalling, no denormal)
      return (__m256i)_mm512_cvtneps_pbh(f);      // (16 bfloat16, as their bits)
    }
    const __mmask16 nan = _mm512_fpclass_ps_mask(f, 0x81);
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
  }
  RELU_EXT_AVX512_BF16 static void widen(const c10::BFloat16* h, float* f) {
    for (int v = 0; v < kHalfBlock / 16; ++v) _mm512_storeu_ps(f + 16 * v, load16(at(h + 16 * v)));
  }
  RELU_EXT_AVX512_BF16 static void round(float* f) {
    for (int v = 0; v < kHalfBlock / 16; ++v) {
      _mm512_storeu_ps(f + 16 * v, load16(narrow16(_mm512_loadu_ps(f + 16 * v))));
    }
  }
  RELU_EXT_AVX512_BF16 static void narrow(const float* f, c10::BFloat16* h) {
    for (int v = 0; v < kHalfBlock / 16; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + 16 * v), narrow16(_mm512_loadu_ps(f + 16 * v)));
    }
  }
  RELU_EXT_AVX512_BF16 static bool differs(const float* f, const c10::BFloat16* h) {
    __m256i acc = _mm256_setzero_si256();
    for (int v = 0; v < kHalfBlock / 16; ++v) {
      acc = _mm256_or_si256(acc, _mm256_xor_si256(narrow16(_mm512_loadu_ps(f + 16 * v)), at(h + 16 * v)));
    }
    return !_mm256_testz_si256(acc, acc);
  }
};

// The 16-bit types in the vector sets go through float a block at a time:
// float16 with the hardware's conversions (half_block.h), bfloat16 with the
// block above. Each BatchNorm output is rounded to T and back (what the add
// and the activation read), the activation runs on floats with its
// parameters in float (the trait's widen) and is rounded to T once. Every
// value the activation sees is a T, so this gives the bits the loop on T
// below gives (which the portable set runs).
template <typename T, int I>
constexpr bool kBlocked = I != kScalar && (std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>);
#else
struct Bf16Block;
struct Bf16Block512;
template <typename T, int I>
constexpr bool kBlocked = false;
#endif
template <typename T, int I>
using BlockOf = std::conditional_t<std::is_same_v<T, c10::Half>, HalfBlock<I>,
                                   std::conditional_t<I == kAvx512, Bf16Block512, Bf16Block>>;

template <typename T, int I, bool kRow>
REPLAY_INLINE void block_bn(const T* __restrict x, const float* __restrict ar, const float* __restrict br, float a,
                            float b, float* __restrict v) {
  using B = BlockOf<T, I>;
  B::widen(x, v);
  for (int64_t k = 0; k < kBlock; ++k) v[k] = std::fma(v[k], kRow ? ar[k] : a, kRow ? br[k] : b);
  B::round(v);
}

template <typename Act, typename T, int I, bool kVerify, bool kRow, bool kRes>
REPLAY_INLINE void block(const Src<T>& s, const Src<T>& s2, int64_t j, T* __restrict y, const P<Act, float>& pw,
                         uint16_t& diff) {
  using B = BlockOf<T, I>;
  alignas(64) float v[kBlock];
  block_bn<T, I, kRow>(s.x + j, kRow ? s.ar + j : nullptr, kRow ? s.br + j : nullptr, s.a, s.b, v);
  if constexpr (kRes) {
    alignas(64) float w[kBlock];
    block_bn<T, I, kRow>(s2.x + j, kRow ? s2.ar + j : nullptr, kRow ? s2.br + j : nullptr, s2.a, s2.b, w);
    for (int64_t k = 0; k < kBlock; ++k) v[k] += w[k];
    B::round(v);
  }
  for (int64_t k = 0; k < kBlock; ++k) v[k] = Act::forward(v[k], pw);
  if constexpr (kVerify) {
    diff |= B::differs(v, y + j);
  } else {
    B::narrow(v, y + j);
  }
}

// One channel's stretch of `len` elements (kRow false) or a row of channels,
// in blocks of a fixed count with __restrict pointers, which the compiler
// vectorizes; kVerify: compare with y
// (returns the OR of the bit differences), else write y.
template <typename Act, typename T, int I, bool kVerify, bool kRow, bool kRes>
REPLAY_INLINE uint64_t stretch(const Src<T>& s, const Src<T>& s2, T* __restrict y, int64_t len, const P<Act, T>& p) {
  using U = decltype(bits_of(T{}));
  U diff = 0;
  int64_t j = 0;
  const T* __restrict x = s.x;
  const T* __restrict x2 = s2.x;
  const OpMath<T>* __restrict ar = s.ar;
  const OpMath<T>* __restrict br = s.br;
  const OpMath<T>* __restrict ar2 = s2.ar;
  const OpMath<T>* __restrict br2 = s2.br;
  const OpMath<T> a = s.a, b = s.b, a2 = s2.a, b2 = s2.b;
  if constexpr (kBlocked<T, I>) {
    const auto pw = Act::widen(p);
    for (; j + kBlock <= len; j += kBlock) block<Act, T, I, kVerify, kRow, kRes>(s, s2, j, y, pw, diff);
  } else {
    for (; j + kBlock <= len; j += kBlock) {
      for (int64_t k = j; k < j + kBlock; ++k) {
        one<Act, T, kVerify, kRow, kRes>(x, ar, br, a, b, x2, ar2, br2, a2, b2, y, k, p, diff);
      }
    }
  }
  for (; j < len; ++j) one<Act, T, kVerify, kRow, kRes>(x, ar, br, a, b, x2, ar2, br2, a2, b2, y, j, p, diff);
  return diff;
}

// A BatchNorm input with its terms, as given to the kernel: a whole tensor's data.
template <typename T>
struct Input {
  const T* x;
  const OpMath<T>* alpha;
  const OpMath<T>* beta;

  // From offset o: channel c's run (a, b fixed), or the row of channels from c.
  Src<T> run(int64_t o, int64_t c) const { return {x + o, nullptr, nullptr, alpha[c], beta[c]}; }
  Src<T> row(int64_t o, int64_t c) const { return {x + o, alpha + c, beta + c, 0, 0}; }
};

// Elements [begin, end) in memory order, split into stretches of one channel
// (runs of `inner` elements) or rows of channels (inner == 1).
template <typename Act, typename T, int I, bool kVerify, bool kRes>
REPLAY_INLINE uint64_t body(Input<T> in, Input<T> in2, T* y, int64_t inner, int64_t channels, int64_t begin,
                            int64_t end, const P<Act, T>& params) {
  const P<Act, T> p = params;
  uint64_t diff = 0;
  int64_t o = begin;
  while (o < end) {
    if (inner == 1) {
      const int64_t c0 = o % channels, stop = std::min(end, o + channels - c0);
      const Src<T> s2 = kRes ? in2.row(o, c0) : Src<T>{};
      diff |= stretch<Act, T, I, kVerify, true, kRes>(in.row(o, c0), s2, y + o, stop - o, p);
      o = stop;
    } else {
      const int64_t k = o / inner, stop = std::min(end, (k + 1) * inner);
      const Src<T> s2 = kRes ? in2.run(o, k % channels) : Src<T>{};
      diff |= stretch<Act, T, I, kVerify, false, kRes>(in.run(o, k % channels), s2, y + o, stop - o, p);
      o = stop;
    }
  }
  return diff;
}

template <typename Act, typename T, bool kVerify, bool kRes>
using BodyFn = uint64_t (*)(Input<T>, Input<T>, T*, int64_t, int64_t, int64_t, int64_t, const P<Act, T>&);

template <typename Act, typename T, bool kVerify, bool kRes>
uint64_t body_scalar(Input<T> in, Input<T> in2, T* y, int64_t inner, int64_t c, int64_t begin, int64_t end,
                     const P<Act, T>& p) {
  return body<Act, T, kScalar, kVerify, kRes>(in, in2, y, inner, c, begin, end, p);
}
#ifdef RELU_EXT_X86
template <typename Act, typename T, bool kVerify, bool kRes>
RELU_EXT_AVX2_FMA uint64_t body_avx2(Input<T> in, Input<T> in2, T* y, int64_t inner, int64_t c, int64_t begin, int64_t end,
                               const P<Act, T>& p) {
  return body<Act, T, kAvx2, kVerify, kRes>(in, in2, y, inner, c, begin, end, p);
}
template <typename Act, typename T, bool kVerify, bool kRes>
RELU_EXT_AVX512_FMA uint64_t body_avx512(Input<T> in, Input<T> in2, T* y, int64_t inner, int64_t c, int64_t begin,
                                   int64_t end, const P<Act, T>& p) {
  return body<Act, T, kAvx512, kVerify, kRes>(in, in2, y, inner, c, begin, end, p);
}
// bfloat16's AVX-512 set, with AVX512_BF16's conversion (Bf16Block512).
template <typename Act, typename T, bool kVerify, bool kRes>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,avx512dq,avx512bf16,fma"))) uint64_t body_avx512bf16(
    Input<T> in, Input<T> in2, T* y, int64_t inner, int64_t c, int64_t begin, int64_t end, const P<Act, T>& p) {
  return body<Act, T, kAvx512, kVerify, kRes>(in, in2, y, inner, c, begin, end, p);
}
#endif

// The kernel set in use (cpu_kernels()), where the CPU also has FMA (the vector
// sets' targets include it); else the portable loop, whose std::fma is exact too.
// bfloat16 takes the AVX-512 set only with AVX512_BF16 (and DQ's fpclass), else
// the AVX2 code: its block is written in 256-bit instructions, and the
// compiler's 512-bit loops around them ran slower than the AVX2 code
// (docs/performance.md).
template <typename Act, typename T, bool kVerify, bool kRes>
BodyFn<Act, T, kVerify, kRes> pick_body() {
  using Fn = BodyFn<Act, T, kVerify, kRes>;
#ifdef RELU_EXT_X86
  static const bool fma = __builtin_cpu_supports("fma");
  Fn avx512 = nullptr;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    static const bool bf16 = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512dq");
    if (bf16) avx512 = &body_avx512bf16<Act, T, kVerify, kRes>;
  } else {
    avx512 = &body_avx512<Act, T, kVerify, kRes>;
  }
  if (fma) return pick<Fn>(&body_scalar<Act, T, kVerify, kRes>, &body_avx2<Act, T, kVerify, kRes>, avx512);
#endif
  return &body_scalar<Act, T, kVerify, kRes>;
}

}  // namespace

void bn_terms_cpu(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                  const at::Tensor& mean, const at::Tensor& var, bool training, double eps, const at::Tensor& alpha,
                  const at::Tensor& beta) {
  AT_DISPATCH_FLOATING_TYPES(alpha.scalar_type(), "bn_terms", [&] {
    using M = scalar_t;  // opmath
    const int64_t channels = alpha.numel();
    const at::Tensor m = mean.to(alpha.scalar_type()).contiguous(), v = var.to(alpha.scalar_type()).contiguous();
    const at::Tensor w = weight ? weight->to(alpha.scalar_type()).contiguous() : at::Tensor();
    const at::Tensor b = bias ? bias->to(alpha.scalar_type()).contiguous() : at::Tensor();
    const M* mp = m.const_data_ptr<M>();
    const M* vp = v.const_data_ptr<M>();
    const M* wp = w.defined() ? w.const_data_ptr<M>() : nullptr;
    const M* bp = b.defined() ? b.const_data_ptr<M>() : nullptr;
    M* ap = alpha.data_ptr<M>();
    M* betap = beta.data_ptr<M>();
    const bool fused = mean.scalar_type() == alpha.scalar_type();
    for (int64_t c = 0; c < channels; ++c) {
      // The parameters' own dtype converts to opmath exactly; the arithmetic is PyTorch's.
      const M invstd = training ? vp[c] : M(1) / std::sqrt(vp[c] + static_cast<M>(eps));
      ap[c] = invstd * (wp ? wp[c] : M(1));
      const M b0 = bp ? bp[c] : M(0);
      betap[c] = fused ? std::fma(-mp[c], ap[c], b0) : b0 - mp[c] * ap[c];  // (no contraction in this file)
    }
  });
}

bool bn_act_cpu(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const at::Tensor& x2,
                const at::Tensor& alpha2, const at::Tensor& beta2, const std::string& act, c10::ArrayRef<double> args,
                const at::Tensor& y, bool verify) {
  const int64_t n = x.numel(), channels = x.size(1);
  const int64_t inner = channels == 1 ? n : x.stride(1);
  std::atomic<bool> differs{false};
  with_act(act, [&](auto tag) {
    using Act = decltype(tag);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_act", [&] {
      using T = scalar_t;
      const auto p = Act::template params<T>(act_args<Act>(act, args));
      const auto input = [](const at::Tensor& t, const at::Tensor& a, const at::Tensor& b) {
        return t.defined() ? Input<T>{t.const_data_ptr<T>(), a.const_data_ptr<OpMath<T>>(),
                                      b.const_data_ptr<OpMath<T>>()}
                           : Input<T>{};
      };
      const Input<T> in = input(x, alpha, beta), in2 = input(x2, alpha2, beta2);
      // Verification only reads y; the kernel's pointer is non-const for the rebuild.
      T* yp = const_cast<T*>(y.const_data_ptr<T>());
      const auto run = [&](auto verify_tag, auto res_tag) {
        constexpr bool kVerify = decltype(verify_tag)::value, kRes = decltype(res_tag)::value;
        const auto fn = pick_body<Act, T, kVerify, kRes>();
        at::parallel_for(0, n, kGrain, [&](int64_t b0, int64_t b1) {
          if (kVerify && differs.load(std::memory_order_relaxed)) return;
          if (fn(in, in2, yp, inner, channels, b0, b1, p) != 0) differs.store(true, std::memory_order_relaxed);
        });
      };
      using Yes = std::true_type;
      using No = std::false_type;
      if (verify) {
        x2.defined() ? run(Yes{}, Yes{}) : run(Yes{}, No{});
      } else {
        x2.defined() ? run(No{}, Yes{}) : run(No{}, No{});
      }
    });
  });
  return !differs.load();
}

}  // namespace relu_ext
