// CPU kernels of the family (activations.h), one template over the trait for
// every activation and dtype. Each kernel set (portable, AVX2, AVX-512; the
// choice of relu_cpu.cpp's cpu_kernels()) compiles the same loop under its
// own target, where the compiler vectorizes the trait's selects and
// arithmetic; only packing the 64 mask bits of a block to a word, and back,
// is written with each set's instructions.
#include "activations.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define FAMILY_X86 1
#include <immintrin.h>
#define FAMILY_AVX2 __attribute__((target("avx2,fma")))
#define FAMILY_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,fma")))
#endif

#define FAMILY_INLINE inline __attribute__((always_inline))

namespace relu_ext {
namespace {

// Elements per mask word; threads split tensors on these, so no two write
// one mask byte. Blocks per task: 32K elements, as relu_cpu.cpp.
constexpr int64_t kBlock = 64;
constexpr int64_t kGrainBlocks = 512;

// The mask bits of a block, one byte (0 or 1) per element, to a word and back.
template <int I>
FAMILY_INLINE uint64_t pack(const uint8_t* k);
template <int I>
FAMILY_INLINE void unpack(uint64_t w, uint8_t* k);

template <>
FAMILY_INLINE uint64_t pack<kScalar>(const uint8_t* k) {
  uint64_t w = 0;
  for (int j = 0; j < kBlock; ++j) w |= uint64_t(k[j]) << j;
  return w;
}

template <>
FAMILY_INLINE void unpack<kScalar>(uint64_t w, uint8_t* k) {
  for (int j = 0; j < kBlock; ++j) k[j] = (w >> j) & 1;
}

#ifdef FAMILY_X86
FAMILY_AVX2 uint32_t pack32_avx2(const uint8_t* k) {
  // A 0 / 1 byte shifted left by 7 puts the bit where movemask reads it.
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k));
  return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_slli_epi16(v, 7)));
}

FAMILY_AVX2 void unpack32_avx2(uint32_t w, uint8_t* k) {
  // Byte j takes mask byte j / 8, then tests its bit j % 8.
  const __m256i bytes = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(w)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(k), _mm256_and_si256(set, _mm256_set1_epi8(1)));
}

FAMILY_AVX512 uint64_t pack64_avx512(const uint8_t* k) {
  const __m512i v = _mm512_loadu_si512(k);
  return _mm512_test_epi8_mask(v, v);
}

FAMILY_AVX512 void unpack64_avx512(uint64_t w, uint8_t* k) {
  _mm512_storeu_si512(k, _mm512_maskz_mov_epi8(w, _mm512_set1_epi8(1)));
}

template <>
FAMILY_INLINE uint64_t pack<kAvx2>(const uint8_t* k) {
  return uint64_t(pack32_avx2(k)) | (uint64_t(pack32_avx2(k + 32)) << 32);
}

template <>
FAMILY_INLINE void unpack<kAvx2>(uint64_t w, uint8_t* k) {
  unpack32_avx2(static_cast<uint32_t>(w), k);
  unpack32_avx2(static_cast<uint32_t>(w >> 32), k + 32);
}

template <>
FAMILY_INLINE uint64_t pack<kAvx512>(const uint8_t* k) {
  return pack64_avx512(k);
}

template <>
FAMILY_INLINE void unpack<kAvx512>(uint64_t w, uint8_t* k) {
  unpack64_avx512(w, k);
}
#endif

template <typename Act, typename T>
using P = typename Act::template Params<T>;

// Whole blocks through the vectorizable loop (the input block is copied
// first, so that x may alias y without defeating the vectorizer), the last
// partial block element by element. `begin` is a multiple of kBlock.
template <typename Act, typename T, int I, bool kMask>
FAMILY_INLINE void fwd_body(const T* x, T* y, uint8_t* mask, int64_t begin, int64_t end, const P<Act, T>& p) {
  int64_t i0 = begin;
  for (; i0 + kBlock <= end; i0 += kBlock) {
    T in[kBlock];
    uint8_t k[kBlock];
    std::memcpy(in, x + i0, sizeof(in));
    for (int j = 0; j < kBlock; ++j) {
      y[i0 + j] = Act::forward(in[j], p);
      if constexpr (kMask) k[j] = Act::keep(in[j], p);
    }
    if constexpr (kMask) {
      const uint64_t w = pack<I>(k);
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
FAMILY_INLINE void bwd_body(const T* __restrict g, const uint8_t* mask, T* __restrict out, int64_t begin, int64_t end,
                            const P<Act, T>& p) {
  int64_t i0 = begin;
  for (; i0 + kBlock <= end; i0 += kBlock) {
    uint64_t w;
    uint8_t k[kBlock];
    std::memcpy(&w, mask + i0 / 8, 8);
    unpack<I>(w, k);
    for (int j = 0; j < kBlock; ++j) out[i0 + j] = Act::grad(g[i0 + j], k[j] != 0, p);
  }
  for (int64_t i = i0; i < end; ++i) out[i] = Act::grad(g[i], ((mask[i >> 3] >> (i & 7)) & 1) != 0, p);
}

template <typename Act, typename T, bool kMask>
void fwd_scalar(const T* x, T* y, uint8_t* mask, int64_t begin, int64_t end, const P<Act, T>& p) {
  fwd_body<Act, T, kScalar, kMask>(x, y, mask, begin, end, p);
}
template <typename Act, typename T>
void bwd_scalar(const T* g, const uint8_t* mask, T* out, int64_t begin, int64_t end, const P<Act, T>& p) {
  bwd_body<Act, T, kScalar>(g, mask, out, begin, end, p);
}

#ifdef FAMILY_X86
template <typename Act, typename T, bool kMask>
FAMILY_AVX2 void fwd_avx2(const T* x, T* y, uint8_t* mask, int64_t begin, int64_t end, const P<Act, T>& p) {
  fwd_body<Act, T, kAvx2, kMask>(x, y, mask, begin, end, p);
}
template <typename Act, typename T>
FAMILY_AVX2 void bwd_avx2(const T* g, const uint8_t* mask, T* out, int64_t begin, int64_t end, const P<Act, T>& p) {
  bwd_body<Act, T, kAvx2>(g, mask, out, begin, end, p);
}
template <typename Act, typename T, bool kMask>
FAMILY_AVX512 void fwd_avx512(const T* x, T* y, uint8_t* mask, int64_t begin, int64_t end, const P<Act, T>& p) {
  fwd_body<Act, T, kAvx512, kMask>(x, y, mask, begin, end, p);
}
template <typename Act, typename T>
FAMILY_AVX512 void bwd_avx512(const T* g, const uint8_t* mask, T* out, int64_t begin, int64_t end,
                              const P<Act, T>& p) {
  bwd_body<Act, T, kAvx512>(g, mask, out, begin, end, p);
}
#endif

template <typename Act, typename T>
using FwdFn = void (*)(const T*, T*, uint8_t*, int64_t, int64_t, const P<Act, T>&);
template <typename Act, typename T>
using BwdFn = void (*)(const T*, const uint8_t*, T*, int64_t, int64_t, const P<Act, T>&);

template <typename Act, typename T, bool kMask>
FwdFn<Act, T> pick_fwd() {
#ifdef FAMILY_X86
  if (cpu_kernels() == kAvx512) return &fwd_avx512<Act, T, kMask>;
  if (cpu_kernels() == kAvx2) return &fwd_avx2<Act, T, kMask>;
#endif
  return &fwd_scalar<Act, T, kMask>;
}

template <typename Act, typename T>
BwdFn<Act, T> pick_bwd() {
#ifdef FAMILY_X86
  if (cpu_kernels() == kAvx512) return &bwd_avx512<Act, T>;
  if (cpu_kernels() == kAvx2) return &bwd_avx2<Act, T>;
#endif
  return &bwd_scalar<Act, T>;
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
    const auto kernel = mask ? pick_fwd<Act, scalar_t, true>() : pick_fwd<Act, scalar_t, false>();
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
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
