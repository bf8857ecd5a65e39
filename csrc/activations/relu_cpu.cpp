// CPU kernels. One template per integer width serves all float formats (see
// core/bits.h). The instruction set is chosen at run time (AVX-512, AVX2 or
// portable C++), so one binary runs on any x86-64 CPU; no -march flag is
// needed or wanted. AVX-512 is taken only with BW and VBMI2 (the 16-bit lanes
// and compress / expand of compact_cpu.cpp), as on Zen 4 and Ice Lake on.
#include "activations/activations.h"
#include "core/bits.h"
#include "core/isa.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>


namespace relu_ext {
namespace {

// Elements per 64-bit mask word; threads split the tensor on these blocks so
// no two threads ever write the same mask byte.
constexpr int64_t kBlock = 64;
// Blocks per task: 32K elements, ATen's usual grain for cheap element-wise ops.
constexpr int64_t kGrainBlocks = 512;

// Portable path; also finishes the last, partial block of the vector paths.
// `begin` is a multiple of kBlock.
template <typename U, U kInf>
void fwd_scalar(const U* x, U* y, uint8_t* mask, int64_t begin, int64_t end) {
  for (int64_t i0 = begin; i0 < end; i0 += kBlock) {
    const int64_t m = std::min(kBlock, end - i0);
    uint64_t word = 0;
    for (int64_t j = 0; j < m; ++j) {
      const U b = x[i0 + j];
      const bool keep = relu_keep<U, kInf>(b);
      word |= uint64_t(keep) << j;
      y[i0 + j] = relu_value(b, keep);
    }
    if (mask) std::memcpy(mask + i0 / 8, &word, (m + 7) / 8);  // little-endian: bit k -> byte k/8
  }
}

template <typename U>
void bwd_scalar(const U* g, const uint8_t* mask, U* out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    out[i] = ((mask[i >> 3] >> (i & 7)) & 1) ? g[i] : U(0);
  }
}

#ifdef RELU_EXT_X86

// AVX2: compares yield all-ones lanes; movemask packs them to bits, and
// `expand` turns mask bits back into lanes.
template <typename U>
struct Avx2;

template <>
struct Avx2<uint16_t> {
  static constexpr int kLanes = 16;
  RELU_EXT_AVX2 static __m256i set1(uint16_t v) { return _mm256_set1_epi16(static_cast<short>(v)); }
  RELU_EXT_AVX2 static __m256i gt(__m256i a, __m256i b) { return _mm256_cmpgt_epi16(a, b); }
  RELU_EXT_AVX2 static __m256i eq(__m256i a, __m256i b) { return _mm256_cmpeq_epi16(a, b); }
  RELU_EXT_AVX2 static uint32_t bits(__m256i k) {
    // Saturating pack keeps 0 / -1 per lane and puts the 16 lanes in order.
    const __m128i packed = _mm_packs_epi16(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
    return static_cast<uint32_t>(_mm_movemask_epi8(packed));
  }
  RELU_EXT_AVX2 static __m256i expand(uint32_t bits) {
    const __m256i sel = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                          8192, 16384, static_cast<short>(0x8000));
    return _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<short>(bits)), sel), sel);
  }
};

template <>
struct Avx2<uint32_t> {
  static constexpr int kLanes = 8;
  RELU_EXT_AVX2 static __m256i set1(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
  RELU_EXT_AVX2 static __m256i gt(__m256i a, __m256i b) { return _mm256_cmpgt_epi32(a, b); }
  RELU_EXT_AVX2 static __m256i eq(__m256i a, __m256i b) { return _mm256_cmpeq_epi32(a, b); }
  RELU_EXT_AVX2 static uint32_t bits(__m256i k) {
    return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(k)));
  }
  RELU_EXT_AVX2 static __m256i expand(uint32_t bits) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits & 0xFF)), sel), sel);
  }
};

template <>
struct Avx2<uint64_t> {
  static constexpr int kLanes = 4;
  RELU_EXT_AVX2 static __m256i set1(uint64_t v) { return _mm256_set1_epi64x(static_cast<long long>(v)); }
  RELU_EXT_AVX2 static __m256i gt(__m256i a, __m256i b) { return _mm256_cmpgt_epi64(a, b); }
  RELU_EXT_AVX2 static __m256i eq(__m256i a, __m256i b) { return _mm256_cmpeq_epi64(a, b); }
  RELU_EXT_AVX2 static uint32_t bits(__m256i k) {
    return static_cast<uint32_t>(_mm256_movemask_pd(_mm256_castsi256_pd(k)));
  }
  RELU_EXT_AVX2 static __m256i expand(uint32_t bits) {
    const __m256i sel = _mm256_setr_epi64x(1, 2, 4, 8);
    return _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(bits & 0xF), sel), sel);
  }
};

template <typename U, U kInf, bool kMask>
RELU_EXT_AVX2 void fwd_avx2(const U* x, U* y, uint8_t* mask, int64_t begin, int64_t end) {
  using T = Avx2<U>;
  constexpr int L = T::kLanes;
  const __m256i zero = _mm256_setzero_si256();
  const __m256i abs = T::set1(Bits<U>::kAbs);
  const __m256i inf = T::set1(kInf);
  const __m256i sign = T::set1(Bits<U>::kSign);
  int64_t i0 = begin;
  for (; i0 + kBlock <= end; i0 += kBlock) {
    uint64_t word = 0;
    for (int v = 0; v < kBlock / L; ++v) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i0 + v * L));
      const __m256i keep = _mm256_or_si256(T::gt(b, zero), T::gt(_mm256_and_si256(b, abs), inf));
      const __m256i out = _mm256_and_si256(b, _mm256_or_si256(keep, T::eq(b, sign)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i0 + v * L), out);
      if constexpr (kMask) word |= uint64_t(T::bits(keep)) << (v * L);
    }
    if constexpr (kMask) std::memcpy(mask + i0 / 8, &word, 8);
  }
  fwd_scalar<U, kInf>(x, y, kMask ? mask : nullptr, i0, end);
}

// float32 / float64 through float compares, fewer instructions than the bit
// tests above: an ordered `x < 0` is false for NaN and for -0.0, so
// `andnot(x < 0, x)` is the forward exactly, and the unordered `!(x <= 0)` is
// the mask. That holds while the CPU does not read denormals as zero
// (MXCSR.DAZ, per thread, e.g. after torch.set_flush_denormal(True)): then
// the bit-test kernel runs instead.
template <typename U>
struct Avx2Float;

template <>
struct Avx2Float<uint32_t> {
  static constexpr int kLanes = 8;
  RELU_EXT_AVX2 static __m256 load(const uint32_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
  RELU_EXT_AVX2 static void store(uint32_t* p, __m256 v) { _mm256_storeu_ps(reinterpret_cast<float*>(p), v); }
  RELU_EXT_AVX2 static __m256 lt0(__m256 v) { return _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ); }
  RELU_EXT_AVX2 static __m256 keep(__m256 v) { return _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_NLE_UQ); }
  RELU_EXT_AVX2 static __m256 andnot(__m256 k, __m256 v) { return _mm256_andnot_ps(k, v); }
  RELU_EXT_AVX2 static uint32_t bits(__m256 k) { return static_cast<uint32_t>(_mm256_movemask_ps(k)); }
};

template <>
struct Avx2Float<uint64_t> {
  static constexpr int kLanes = 4;
  RELU_EXT_AVX2 static __m256d load(const uint64_t* p) { return _mm256_loadu_pd(reinterpret_cast<const double*>(p)); }
  RELU_EXT_AVX2 static void store(uint64_t* p, __m256d v) { _mm256_storeu_pd(reinterpret_cast<double*>(p), v); }
  RELU_EXT_AVX2 static __m256d lt0(__m256d v) { return _mm256_cmp_pd(v, _mm256_setzero_pd(), _CMP_LT_OQ); }
  RELU_EXT_AVX2 static __m256d keep(__m256d v) { return _mm256_cmp_pd(v, _mm256_setzero_pd(), _CMP_NLE_UQ); }
  RELU_EXT_AVX2 static __m256d andnot(__m256d k, __m256d v) { return _mm256_andnot_pd(k, v); }
  RELU_EXT_AVX2 static uint32_t bits(__m256d k) { return static_cast<uint32_t>(_mm256_movemask_pd(k)); }
};

constexpr unsigned kMxcsrDaz = 0x0040;

template <typename U, U kInf, bool kMask>
RELU_EXT_AVX2 void fwd_avx2_float(const U* x, U* y, uint8_t* mask, int64_t begin, int64_t end) {
  if (_mm_getcsr() & kMxcsrDaz) return fwd_avx2<U, kInf, kMask>(x, y, mask, begin, end);
  using T = Avx2Float<U>;
  constexpr int L = T::kLanes;
  int64_t i0 = begin;
  for (; i0 + kBlock <= end; i0 += kBlock) {
    uint64_t word = 0;
    for (int v = 0; v < kBlock / L; ++v) {
      const auto b = T::load(x + i0 + v * L);
      T::store(y + i0 + v * L, T::andnot(T::lt0(b), b));
      if constexpr (kMask) word |= uint64_t(T::bits(T::keep(b))) << (v * L);
    }
    if constexpr (kMask) std::memcpy(mask + i0 / 8, &word, 8);
  }
  fwd_scalar<U, kInf>(x, y, kMask ? mask : nullptr, i0, end);
}

template <typename U>
RELU_EXT_AVX2 void bwd_avx2(const U* g, const uint8_t* mask, U* out, int64_t begin, int64_t end) {
  using T = Avx2<U>;
  constexpr int L = T::kLanes;
  int64_t i0 = begin;
  for (; i0 + kBlock <= end; i0 += kBlock) {
    uint64_t word;
    std::memcpy(&word, mask + i0 / 8, 8);
    for (int v = 0; v < kBlock / L; ++v) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i0 + v * L));
      const __m256i lanes = T::expand(static_cast<uint32_t>(word >> (v * L)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i0 + v * L), _mm256_and_si256(b, lanes));
    }
  }
  bwd_scalar(g, mask, out, i0, end);
}

// AVX-512, for the 16-bit formats (kActivation512: the 32- and 64-bit
// ones run the AVX2 code): compares yield mask registers, which are the mask
// bits as they are stored, and a zero-masked move is the select.
template <typename U>
struct Avx512;

template <>
struct Avx512<uint16_t> {
  static constexpr int kLanes = 32;
  RELU_EXT_AVX512 static __m512i set1(uint16_t v) { return _mm512_set1_epi16(static_cast<short>(v)); }
  RELU_EXT_AVX512 static uint64_t gt(__m512i a, __m512i b) { return _mm512_cmpgt_epi16_mask(a, b); }
  RELU_EXT_AVX512 static uint64_t eq(__m512i a, __m512i b) { return _mm512_cmpeq_epi16_mask(a, b); }
  RELU_EXT_AVX512 static __m512i select(uint64_t k, __m512i v) { return _mm512_maskz_mov_epi16(__mmask32(k), v); }
};

template <typename U, U kInf, bool kMask>
RELU_EXT_AVX512 void fwd_avx512(const U* x, U* y, uint8_t* mask, int64_t begin, int64_t end) {
  using T = Avx512<U>;
  constexpr int L = T::kLanes;
  const __m512i zero = _mm512_setzero_si512();
  const __m512i abs = T::set1(Bits<U>::kAbs);
  const __m512i inf = T::set1(kInf);
  const __m512i sign = T::set1(Bits<U>::kSign);
  int64_t i0 = begin;
  for (; i0 + kBlock <= end; i0 += kBlock) {
    uint64_t word = 0;
    for (int v = 0; v < kBlock / L; ++v) {
      const __m512i b = _mm512_loadu_si512(x + i0 + v * L);
      const uint64_t keep = T::gt(b, zero) | T::gt(_mm512_and_si512(b, abs), inf);
      _mm512_storeu_si512(y + i0 + v * L, T::select(keep | T::eq(b, sign), b));
      if constexpr (kMask) word |= keep << (v * L);
    }
    if constexpr (kMask) std::memcpy(mask + i0 / 8, &word, 8);
  }
  fwd_scalar<U, kInf>(x, y, kMask ? mask : nullptr, i0, end);
}

template <typename U>
RELU_EXT_AVX512 void bwd_avx512(const U* g, const uint8_t* mask, U* out, int64_t begin, int64_t end) {
  using T = Avx512<U>;
  constexpr int L = T::kLanes;
  int64_t i0 = begin;
  for (; i0 + kBlock <= end; i0 += kBlock) {
    uint64_t word;
    std::memcpy(&word, mask + i0 / 8, 8);
    for (int v = 0; v < kBlock / L; ++v) {
      _mm512_storeu_si512(out + i0 + v * L, T::select(word >> (v * L), _mm512_loadu_si512(g + i0 + v * L)));
    }
  }
  bwd_scalar(g, mask, out, i0, end);
}

#endif  // RELU_EXT_X86

template <typename U, U kInf>
using FwdFn = void (*)(const U*, U*, uint8_t*, int64_t, int64_t);
template <typename U>
using BwdFn = void (*)(const U*, const uint8_t*, U*, int64_t, int64_t);

template <typename U, U kInf, bool kMask>
FwdFn<U, kInf> pick_fwd() {
  if constexpr (kActivation512<U>) {
    return pick<FwdFn<U, kInf>>(&fwd_scalar<U, kInf>, RELU_EXT_X86_ONLY((&fwd_avx2<U, kInf, kMask>)),
                                RELU_EXT_X86_ONLY((&fwd_avx512<U, kInf, kMask>)));
  } else {
    return pick<FwdFn<U, kInf>>(&fwd_scalar<U, kInf>, RELU_EXT_X86_ONLY((&fwd_avx2_float<U, kInf, kMask>)));
  }
}

template <typename U, U kInf>
FwdFn<U, kInf> pick_fwd(bool with_mask) {
  return with_mask ? pick_fwd<U, kInf, true>() : pick_fwd<U, kInf, false>();
}

template <typename U>
BwdFn<U> pick_bwd() {
  if constexpr (kActivation512<U>) {
    return pick<BwdFn<U>>(&bwd_scalar<U>, RELU_EXT_X86_ONLY(&bwd_avx2<U>), RELU_EXT_X86_ONLY(&bwd_avx512<U>));
  } else {
    return pick<BwdFn<U>>(&bwd_scalar<U>, RELU_EXT_X86_ONLY(&bwd_avx2<U>));
  }
}

// Splits [0, n) on kBlock boundaries over ATen's intra-op thread pool.
template <typename Fn>
void parallel_blocks(int64_t n, Fn&& fn) {
  at::parallel_for(0, (n + kBlock - 1) / kBlock, kGrainBlocks, [&](int64_t b0, int64_t b1) {
    fn(b0 * kBlock, std::min(b1 * kBlock, n));
  });
}

}  // namespace

template <>
void act_forward_cpu<Relu>(const at::Tensor& x, const at::Tensor& y, uint8_t* mask, const ActArgs&) {
  dispatch_bits(x.scalar_type(), [&](auto fmt) {
    using U = typename decltype(fmt)::U;
    const auto kernel = pick_fwd<U, decltype(fmt)::kInf>(mask != nullptr);
    const U* xp = static_cast<const U*>(x.const_data_ptr());
    U* yp = static_cast<U*>(y.data_ptr());
    parallel_blocks(x.numel(), [&](int64_t begin, int64_t end) { kernel(xp, yp, mask, begin, end); });
  });
}

void forward_int_cpu(const at::Tensor& x, const at::Tensor& y) {
  AT_DISPATCH_INTEGRAL_TYPES(x.scalar_type(), "relu_ext_int", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    // A plain loop: -O3 turns it into vector max instructions for every width.
    at::parallel_for(0, x.numel(), kGrainBlocks * kBlock, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) yp[i] = std::max(xp[i], scalar_t(0));
    });
  });
}

template <>
void act_backward_cpu<Relu>(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in, const ActArgs&) {
  dispatch_bits(grad.scalar_type(), [&](auto fmt) {
    using U = typename decltype(fmt)::U;
    const auto kernel = pick_bwd<U>();
    const U* gp = static_cast<const U*>(grad.const_data_ptr());
    U* op = static_cast<U*>(grad_in.data_ptr());
    parallel_blocks(grad.numel(), [&](int64_t begin, int64_t end) { kernel(gp, mask, op, begin, end); });
  });
}

}  // namespace relu_ext
