// CPU kernels of the family (activations.h), one template over the trait for
// every activation and dtype. Each kernel set (portable, AVX2, AVX-512; the
// choice of cpu_kernels() and activations.h's kActivation512) compiles the same
// loop under its own target, where the compiler vectorizes the trait's
// selects and arithmetic; only packing the 64 mask bits of a block to a
// word, and back, is written with each set's instructions.
//
// The compiler may evaluate a compare on both arms of a select only when a
// compare cannot trap; without this, GCC keeps the loops scalar ("control
// flow in loop"). Set before any include, so that the traits' functions are
// compiled alike and are inlined into the loops. It changes no result:
// nothing here reads FP exception flags or enables their traps. (No FMA in
// the targets: a contracted a * b + c would round differently from PyTorch.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include "activations/activations.h"
#include "core/half_block.h"
#include "core/isa.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstring>
#include <type_traits>


#define FAMILY_INLINE inline __attribute__((always_inline))

namespace relu_ext {
namespace {

// Elements per mask word; threads split tensors on these, so no two write
// one mask byte. Blocks per task: 32K elements, as relu_cpu.cpp.
constexpr int64_t kBlock = kHalfBlock;
constexpr int64_t kGrainBlocks = 512;

// The mask bits of a block as lanes of the elements' width (all ones or
// zero: what vector compares give, so the element loop stays one width), to
// a word and back.
template <int I, typename U>
struct Lanes {
  static uint64_t pack(const U* k) {
    uint64_t w = 0;
    for (int j = 0; j < kBlock; ++j) w |= uint64_t(k[j] & 1) << j;
    return w;
  }
  static void unpack(uint64_t w, U* k) {
    for (int j = 0; j < kBlock; ++j) k[j] = ((w >> j) & 1) ? U(~U(0)) : U(0);
  }
};

#ifdef RELU_EXT_X86
RELU_EXT_AVX2 inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
RELU_EXT_AVX2 inline void store256(void* p, __m256i v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }

template <>
struct Lanes<kAvx2, uint32_t> {
  RELU_EXT_AVX2 static uint64_t pack(const uint32_t* k) {
    uint64_t w = 0;
    for (int v = 0; v < 8; ++v) {
      w |= uint64_t(static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(load256(k + 8 * v))))) << (8 * v);
    }
    return w;
  }
  RELU_EXT_AVX2 static void unpack(uint64_t w, uint32_t* k) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int v = 0; v < 8; ++v) {
      const __m256i bits = _mm256_set1_epi32(static_cast<int>((w >> (8 * v)) & 0xFF));
      store256(k + 8 * v, _mm256_cmpeq_epi32(_mm256_and_si256(bits, sel), sel));
    }
  }
};

template <>
struct Lanes<kAvx2, uint64_t> {
  RELU_EXT_AVX2 static uint64_t pack(const uint64_t* k) {
    uint64_t w = 0;
    for (int v = 0; v < 16; ++v) {
      w |= uint64_t(static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(load256(k + 4 * v))))) << (4 * v);
    }
    return w;
  }
  RELU_EXT_AVX2 static void unpack(uint64_t w, uint64_t* k) {
    const __m256i sel = _mm256_setr_epi64x(1, 2, 4, 8);
    for (int v = 0; v < 16; ++v) {
      const __m256i bits = _mm256_set1_epi64x(static_cast<long long>((w >> (4 * v)) & 0xF));
      store256(k + 4 * v, _mm256_cmpeq_epi64(_mm256_and_si256(bits, sel), sel));
    }
  }
};

// AVX-512 (16-bit elements, whose compares are made in float): a test
// against itself is the lanes' mask; a zero-masked move of all ones is the
// way back.
template <>
struct Lanes<kAvx512, uint32_t> {
  RELU_EXT_AVX512 static uint64_t pack(const uint32_t* k) {
    uint64_t w = 0;
    for (int v = 0; v < 4; ++v) {
      const __m512i a = _mm512_loadu_si512(k + 16 * v);
      w |= uint64_t(_mm512_test_epi32_mask(a, a)) << (16 * v);
    }
    return w;
  }
  RELU_EXT_AVX512 static void unpack(uint64_t w, uint32_t* k) {
    for (int v = 0; v < 4; ++v) {
      _mm512_storeu_si512(k + 16 * v, _mm512_maskz_mov_epi32(__mmask16(w >> (16 * v)), _mm512_set1_epi32(-1)));
    }
  }
};

#endif

// The mask lanes' type: the unsigned integer of the opmath type's width (the
// compares are made in opmath, float for the 16-bit types).
template <typename T>
using LaneOf = std::conditional_t<sizeof(OpMath<T>) == 4, uint32_t, uint64_t>;

template <typename Act, typename T>
using P = typename Act::template Params<T>;

// One block of kBlock elements: the output, and the mask bits as lanes of
// T's width in k. Out of place the pointers are __restrict (the compiler
// need not fear that a store changes an input); in place the loop reads and
// writes the same element, which it may vectorize as it is. (A local copy of
// the block would do instead, but a 32-byte load of what two 16-byte stores
// just wrote stalls on store forwarding.)
template <typename Act, typename T, typename U>
FAMILY_INLINE void fwd_block(const T* __restrict x, T* __restrict y, U* __restrict k, const P<Act, T>& p) {
  for (int j = 0; j < kBlock; ++j) {
    y[j] = Act::forward(x[j], p);
    k[j] = Act::keep(x[j], p) ? U(~U(0)) : U(0);
  }
}

template <typename Act, typename T, typename U>
FAMILY_INLINE void fwd_block_inplace(T* a, U* __restrict k, const P<Act, T>& p) {
  for (int j = 0; j < kBlock; ++j) {
    const T v = a[j];
    a[j] = Act::forward(v, p);
    k[j] = Act::keep(v, p) ? U(~U(0)) : U(0);
  }
}

// float16 through float: the block is read whole before it is written, so
// x may be y.
template <typename Act, int I, typename U>
FAMILY_INLINE void fwd_block_via_float(const c10::Half* x, c10::Half* y, U* __restrict k, const P<Act, float>& p) {
  alignas(64) float v[kBlock];
  HalfBlock<I>::widen(x, v);
  for (int j = 0; j < kBlock; ++j) {
    k[j] = Act::keep(v[j], p) ? U(~U(0)) : U(0);
    v[j] = Act::forward(v[j], p);
  }
  HalfBlock<I>::narrow(v, y);
}

// Whole blocks, then the last partial block element by element. The
// parameters are copied: a store through y could otherwise change them as
// far as the compiler knows, and it would reload them for every element.
// `begin` is a multiple of kBlock; x == y in place.
template <typename Act, typename T, int I, bool kMask, bool kInplace>
FAMILY_INLINE void fwd_body(const T* x, T* y, uint8_t* mask, int64_t begin, int64_t end, const P<Act, T>& params) {
  using U = LaneOf<T>;
  const P<Act, T> p = params;
  [[maybe_unused]] const auto pw = Act::widen(p);
  int64_t i0 = begin;
  for (; i0 + kBlock <= end; i0 += kBlock) {
    alignas(64) U k[kBlock];
    if constexpr (kViaFloat<T, I>) {
      fwd_block_via_float<Act, I>(x + i0, y + i0, k, pw);
    } else if constexpr (kInplace) {
      fwd_block_inplace<Act>(y + i0, k, p);
    } else {
      fwd_block<Act>(x + i0, y + i0, k, p);
    }
    if constexpr (kMask) {
      const uint64_t w = Lanes<I, U>::pack(k);
      std::memcpy(mask + i0 / 8, &w, 8);
    }
  }
  if (i0 < end) {
    uint64_t w = 0;
    for (int64_t j = 0; i0 + j < end; ++j) {
      const T v = x[i0 + j];
      y[i0 + j] = Act::forward(v, p);
      w |= uint64_t(Act::keep(v, p)) << j;
    }
    if (kMask) std::memcpy(mask + i0 / 8, &w, (end - i0 + 7) / 8);
  }
}

template <typename Act, typename T, int I>
FAMILY_INLINE void bwd_body(const T* __restrict g, const uint8_t* __restrict mask, T* __restrict out, int64_t begin,
                            int64_t end, const P<Act, T>& params) {
  using U = LaneOf<T>;
  const P<Act, T> p = params;
  [[maybe_unused]] const auto pw = Act::widen(p);
  int64_t i0 = begin;
  for (; i0 + kBlock <= end; i0 += kBlock) {
    uint64_t w;
    alignas(64) U k[kBlock];
    std::memcpy(&w, mask + i0 / 8, 8);
    Lanes<I, U>::unpack(w, k);
    if constexpr (kViaFloat<T, I> && Act::kGradScales) {
      alignas(64) float v[kBlock];
      HalfBlock<I>::widen(g + i0, v);
      for (int j = 0; j < kBlock; ++j) v[j] = Act::grad(v[j], k[j] != 0, pw);
      HalfBlock<I>::narrow(v, out + i0);
    } else {
      for (int j = 0; j < kBlock; ++j) out[i0 + j] = Act::grad(g[i0 + j], k[j] != 0, p);
    }
  }
  for (int64_t i = i0; i < end; ++i) out[i] = Act::grad(g[i], ((mask[i >> 3] >> (i & 7)) & 1) != 0, p);
}

template <typename Act, typename T, bool kMask, bool kInplace>
void fwd_scalar(const T* x, T* y, uint8_t* mask, int64_t begin, int64_t end, const P<Act, T>& p) {
  fwd_body<Act, T, kScalar, kMask, kInplace>(x, y, mask, begin, end, p);
}
template <typename Act, typename T>
void bwd_scalar(const T* g, const uint8_t* mask, T* out, int64_t begin, int64_t end, const P<Act, T>& p) {
  bwd_body<Act, T, kScalar>(g, mask, out, begin, end, p);
}

#ifdef RELU_EXT_X86
template <typename Act, typename T, bool kMask, bool kInplace>
RELU_EXT_AVX2 void fwd_avx2(const T* x, T* y, uint8_t* mask, int64_t begin, int64_t end, const P<Act, T>& p) {
  fwd_body<Act, T, kAvx2, kMask, kInplace>(x, y, mask, begin, end, p);
}
template <typename Act, typename T>
RELU_EXT_AVX2 void bwd_avx2(const T* g, const uint8_t* mask, T* out, int64_t begin, int64_t end, const P<Act, T>& p) {
  bwd_body<Act, T, kAvx2>(g, mask, out, begin, end, p);
}
template <typename Act, typename T, bool kMask, bool kInplace>
RELU_EXT_AVX512 void fwd_avx512(const T* x, T* y, uint8_t* mask, int64_t begin, int64_t end, const P<Act, T>& p) {
  fwd_body<Act, T, kAvx512, kMask, kInplace>(x, y, mask, begin, end, p);
}
template <typename Act, typename T>
RELU_EXT_AVX512 void bwd_avx512(const T* g, const uint8_t* mask, T* out, int64_t begin, int64_t end,
                              const P<Act, T>& p) {
  bwd_body<Act, T, kAvx512>(g, mask, out, begin, end, p);
}
#endif

template <typename Act, typename T>
using FwdFn = void (*)(const T*, T*, uint8_t*, int64_t, int64_t, const P<Act, T>&);
template <typename Act, typename T>
using BwdFn = void (*)(const T*, const uint8_t*, T*, int64_t, int64_t, const P<Act, T>&);

// The 32- and 64-bit kernels run the AVX2 code on AVX-512 CPUs too
// (kActivation512); the 16-bit ones, which convert through float,
// gain from 512 bits.
template <typename Act, typename T, bool kMask, bool kInplace>
FwdFn<Act, T> pick_fwd() {
  constexpr auto scalar = &fwd_scalar<Act, T, kMask, kInplace>;
  if constexpr (kActivation512<T>) {
    return pick<FwdFn<Act, T>>(scalar, RELU_EXT_X86_ONLY((&fwd_avx2<Act, T, kMask, kInplace>)),
                               RELU_EXT_X86_ONLY((&fwd_avx512<Act, T, kMask, kInplace>)));
  } else {
    return pick<FwdFn<Act, T>>(scalar, RELU_EXT_X86_ONLY((&fwd_avx2<Act, T, kMask, kInplace>)));
  }
}

template <typename Act, typename T>
FwdFn<Act, T> pick_fwd(bool mask, bool inplace) {
  if (inplace) return mask ? pick_fwd<Act, T, true, true>() : pick_fwd<Act, T, false, true>();
  return mask ? pick_fwd<Act, T, true, false>() : pick_fwd<Act, T, false, false>();
}

template <typename Act, typename T>
BwdFn<Act, T> pick_bwd() {
  if constexpr (kActivation512<T>) {
    return pick<BwdFn<Act, T>>(&bwd_scalar<Act, T>, RELU_EXT_X86_ONLY((&bwd_avx2<Act, T>)),
                               RELU_EXT_X86_ONLY((&bwd_avx512<Act, T>)));
  } else {
    return pick<BwdFn<Act, T>>(&bwd_scalar<Act, T>, RELU_EXT_X86_ONLY((&bwd_avx2<Act, T>)));
  }
}

template <typename Fn>
void parallel_blocks(int64_t n, Fn&& fn) {
  at::parallel_for(0, (n + kBlock - 1) / kBlock, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    fn(b0 * kBlock, std::min(b1 * kBlock, n));
  });
}

}  // namespace

template <typename Act>
void act_forward_cpu(const at::Tensor& x, const at::Tensor& y, uint8_t* mask, const ActArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), Act::kName, [&] {
    const auto p = Act::template params<scalar_t>(args);
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const auto kernel = pick_fwd<Act, scalar_t>(mask != nullptr, xp == yp);
    parallel_blocks(x.numel(), [&](int64_t begin, int64_t end) { kernel(xp, yp, mask, begin, end, p); });
  });
}

template <typename Act>
void act_backward_cpu(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in, const ActArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), Act::kName, [&] {
    const auto p = Act::template params<scalar_t>(args);
    const auto kernel = pick_bwd<Act, scalar_t>();
    const scalar_t* gp = grad.const_data_ptr<scalar_t>();
    scalar_t* op = grad_in.data_ptr<scalar_t>();
    parallel_blocks(grad.numel(), [&](int64_t begin, int64_t end) { kernel(gp, mask, op, begin, end, p); });
  });
}

#define RELU_EXT_INSTANTIATE(Act)                                                                        \
  template void act_forward_cpu<Act>(const at::Tensor&, const at::Tensor&, uint8_t*, const ActArgs&); \
  template void act_backward_cpu<Act>(const at::Tensor&, const uint8_t*, const at::Tensor&, const ActArgs&);
RELU_EXT_FAMILY(RELU_EXT_INSTANTIATE)
#undef RELU_EXT_INSTANTIATE

}  // namespace relu_ext
