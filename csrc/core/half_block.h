// float16 to float and back a block of kHalfBlock elements at a time, with
// the hardware's conversions (F16C in the AVX2 kernel set, AVX-512F's own):
// GCC does not vectorize c10::Half's. Exact one way, round to nearest even
// the other, as c10::Half's; a NaN stays a NaN, its payload the hardware's
// (PyTorch's vectorized loops convert the same way). Shared by the family's
// kernels (family_cpu.cpp) and the BatchNorm replay (replay_cpu.cpp), whose
// float16 paths run in float between the two.
#pragma once

#include <type_traits>

#include <c10/util/Half.h>

#include "core/bits.h"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define RELU_EXT_HALF_BLOCK 1
#include <immintrin.h>
#endif

namespace relu_ext {

constexpr int kHalfBlock = 64;

template <int I>
struct HalfBlock;  // none for the portable set: it computes on c10::Half

#ifdef RELU_EXT_HALF_BLOCK
template <>
struct HalfBlock<kAvx2> {
  __attribute__((target("avx2,f16c"))) static void widen(const c10::Half* h, float* f) {
    for (int v = 0; v < kHalfBlock / 8; ++v) {
      _mm256_storeu_ps(f + 8 * v, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8 * v))));
    }
  }
  __attribute__((target("avx2,f16c"))) static void narrow(const float* f, c10::Half* h) {
    for (int v = 0; v < kHalfBlock / 8; ++v) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 8 * v),
                       _mm256_cvtps_ph(_mm256_loadu_ps(f + 8 * v), _MM_FROUND_TO_NEAREST_INT));
    }
  }
  // f rounded to float16 and back, in place.
  __attribute__((target("avx2,f16c"))) static void round(float* f) {
    for (int v = 0; v < kHalfBlock / 8; ++v) {
      const __m256 x = _mm256_loadu_ps(f + 8 * v);
      _mm256_storeu_ps(f + 8 * v, _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)));
    }
  }
  // Whether f narrowed to float16 differs from h in any bit (in registers: a
  // narrow to memory read back at another width would stall on store forwarding).
  __attribute__((target("avx2,f16c"))) static bool differs(const float* f, const c10::Half* h) {
    __m128i acc = _mm_setzero_si128();
    for (int v = 0; v < kHalfBlock / 8; ++v) {
      const __m128i n = _mm256_cvtps_ph(_mm256_loadu_ps(f + 8 * v), _MM_FROUND_TO_NEAREST_INT);
      acc = _mm_or_si128(acc, _mm_xor_si128(n, _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8 * v))));
    }
    return !_mm_testz_si128(acc, acc);
  }
};

template <>
struct HalfBlock<kAvx512> {
  __attribute__((target("avx512f"))) static void widen(const c10::Half* h, float* f) {
    for (int v = 0; v < kHalfBlock / 16; ++v) {
      _mm512_storeu_ps(f + 16 * v, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16 * v))));
    }
  }
  __attribute__((target("avx512f"))) static void narrow(const float* f, c10::Half* h) {
    for (int v = 0; v < kHalfBlock / 16; ++v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + 16 * v),
                          _mm512_cvtps_ph(_mm512_loadu_ps(f + 16 * v), _MM_FROUND_TO_NEAREST_INT));
    }
  }
  __attribute__((target("avx512f"))) static void round(float* f) {
    for (int v = 0; v < kHalfBlock / 16; ++v) {
      const __m512 x = _mm512_loadu_ps(f + 16 * v);
      _mm512_storeu_ps(f + 16 * v, _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)));
    }
  }
  __attribute__((target("avx512f"))) static bool differs(const float* f, const c10::Half* h) {
    __m256i acc = _mm256_setzero_si256();
    for (int v = 0; v < kHalfBlock / 16; ++v) {
      const __m256i n = _mm512_cvtps_ph(_mm512_loadu_ps(f + 16 * v), _MM_FROUND_TO_NEAREST_INT);
      acc = _mm256_or_si256(acc, _mm256_xor_si256(n, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16 * v))));
    }
    return !_mm256_testz_si256(acc, acc);
  }
};
#endif

// Whether the float16 kernels of set I go through HalfBlock.
template <typename T, int I>
#ifdef RELU_EXT_HALF_BLOCK
constexpr bool kViaFloat = std::is_same_v<T, c10::Half> && I != kScalar;
#else
constexpr bool kViaFloat = false;
#endif

}  // namespace relu_ext
