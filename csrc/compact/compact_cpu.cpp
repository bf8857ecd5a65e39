// Compaction of a dense tensor by a bitmap, on the CPU (save_compact): the
// kept elements in memory order (compact), their inverse (expand: dropped
// elements become +0), the bitmap of nonzero elements, and a tensor of +0
// and one other bit pattern as that bitmap and the pattern (binary_mask /
// binary_expand). Elements move as the unsigned integers of their width, so
// every bit pattern (NaN payloads, -0.0, denormals) survives. Bitmaps follow
// the mask layout of core/bits.h.
//
// Work is split into chunks of kChunkBytes mask bytes: a first pass counts
// each chunk's kept elements (popcounts of the mask alone), an exclusive sum
// gives where each chunk's values start, and the chunks then run in parallel
// on disjoint ranges of both arrays.
//
// The instruction set follows relu_cpu.cpp's run-time choice (cpu_kernels()):
// AVX-512 has the moves themselves (vpcompress / vpexpand, masked loads and
// stores that touch only the lanes they name, so no step needs a range check);
// AVX2 moves a mask byte's (or nibble's) elements with one permute from a
// table indexed by the mask bits (vpermd for 4- and 8-byte elements, pshufb
// for 2-byte ones); the portable path does the rest of each chunk's work
// where a vector would reach past its range (see the *_avx2 functions).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>

#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

#include "compact/compact.h"
#include "core/bits.h"
#include "core/isa.h"


namespace relu_ext {
namespace {

constexpr int64_t kChunkBytes = 4096;  // 32768 elements, ATen's grain size

// Mask byte b with the bits past element n cleared (the last byte may be partial).
inline unsigned mask_byte(const uint8_t* mask, int64_t b, int64_t n) {
  const int64_t left = n - b * 8;
  return left >= 8 ? mask[b] : mask[b] & ((1u << left) - 1u);
}

__attribute__((always_inline)) inline int64_t popcount_of(const uint8_t* mask, int64_t b0, int64_t b1, int64_t n) {
  int64_t count = 0;
  int64_t b = b0;
  const int64_t full = std::min(b1, n / 8);  // bytes with all 8 bits inside the tensor
  for (; b + 8 <= full; b += 8) {
    uint64_t word;
    std::memcpy(&word, mask + b, 8);
    count += __builtin_popcountll(word);
  }
  for (; b < b1; ++b) count += __builtin_popcount(mask_byte(mask, b, n));
  return count;
}

#ifdef RELU_EXT_X86
// The same with the popcnt instruction, which every CPU with the vector
// kernels has: without it the builtin is a call into libgcc, about a tenth of
// an in-cache compact's time.
__attribute__((target("popcnt"))) int64_t popcount_x86(const uint8_t* mask, int64_t b0, int64_t b1, int64_t n) {
  return popcount_of(mask, b0, b1, n);
}
#endif

int64_t popcount(const uint8_t* mask, int64_t b0, int64_t b1, int64_t n, bool fast) {
#ifdef RELU_EXT_X86
  if (fast) return popcount_x86(mask, b0, b1, n);
#endif
  return popcount_of(mask, b0, b1, n);
}

int64_t chunks_of(int64_t n) { return ((n + 7) / 8 + kChunkBytes - 1) / kChunkBytes; }

// Where each chunk's values start; the last entry is the total. `fast`: the
// CPU has popcnt.
std::vector<int64_t> chunk_starts(const uint8_t* mask, int64_t n, bool fast) {
  const int64_t chunks = chunks_of(n), bytes = (n + 7) / 8;
  std::vector<int64_t> start(chunks + 1, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      start[c + 1] = popcount(mask, c * kChunkBytes, std::min(bytes, (c + 1) * kChunkBytes), n, fast);
    }
  });
  for (int64_t c = 0; c < chunks; ++c) start[c + 1] += start[c];
  return start;
}

// Calls fn(c, first mask byte, end mask byte) for every chunk, in parallel.
template <typename Fn>
void for_each_chunk(int64_t n, Fn&& fn) {
  const int64_t bytes = (n + 7) / 8;
  at::parallel_for(0, chunks_of(n), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) fn(c, c * kChunkBytes, std::min(bytes, (c + 1) * kChunkBytes));
  });
}

// Each mask byte's 8 elements go through a local buffer, so that the loop has
// no branch on the data and never writes past its own range of `out`.
template <typename U>
int64_t compact_chunk(const U* y, const uint8_t* mask, int64_t n, int64_t b0, int64_t b1, U* out) {
  int64_t missed = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const unsigned m = mask_byte(mask, b, n);
    const int64_t base = b * 8;
    const int count = static_cast<int>(std::min<int64_t>(8, n - base));
    U buf[8];
    int k = 0;
    for (int j = 0; j < count; ++j) {
      const U v = y[base + j];
      const unsigned keep = (m >> j) & 1u;
      buf[k] = v;
      k += keep;
      missed += (keep ^ 1u) & unsigned(v != 0);
    }
    if (k > 0) std::memcpy(out, buf, sizeof(U) * k);  // out may be null when nothing is kept at all
    out += k;
  }
  return missed;
}

// rank[m][j]: how many of the bits below bit j are set in byte m, i.e. which
// of a byte's kept values element j is.
struct Ranks {
  uint8_t rank[256][8];
  Ranks() {
    for (int m = 0; m < 256; ++m) {
      for (int j = 0; j < 8; ++j) rank[m][j] = static_cast<uint8_t>(__builtin_popcount(m & ((1u << j) - 1u)));
    }
  }
};
const Ranks kRanks;

// Each mask byte's values are copied into a local buffer first (8 at once
// while 8 remain), so that the element loop reads no value out of range.
template <typename U>
void expand_chunk(const U* values, int64_t total, const uint8_t* mask, int64_t n, int64_t b0, int64_t b1,
                  int64_t pos, U* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const unsigned m = mask_byte(mask, b, n);
    const int64_t base = b * 8;
    const int count = static_cast<int>(std::min<int64_t>(8, n - base));
    const int k = __builtin_popcount(m);
    U buf[8] = {};
    if (k > 0) std::memcpy(buf, values + pos, sizeof(U) * (pos + 8 <= total ? 8 : k));
    const uint8_t* rank = kRanks.rank[m];
    for (int j = 0; j < count; ++j) out[base + j] = ((m >> j) & 1u) ? buf[rank[j]] : U(0);
    pos += k;
  }
}

template <typename U>
void nonzero_chunk(const U* y, int64_t n, int64_t b0, int64_t b1, uint8_t* mask) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * 8;
    const int count = static_cast<int>(std::min<int64_t>(8, n - base));
    unsigned m = 0;
    for (int j = 0; j < count; ++j) m |= unsigned(y[base + j] != 0) << j;
    mask[b] = static_cast<uint8_t>(m);
  }
}

#ifdef RELU_EXT_X86

// Permute tables, by mask bits m: compress*[m] lists the lanes of the set
// bits of m in order (what compact keeps, packed to the front); expand*[m]
// gives lane j the rank of bit j among them (where expand finds element j),
// or, in expand16, 0x80 when bit j is clear, which pshufb turns into a zero
// byte (the others clear those lanes with keep*[m]). Indices are bytes: in
// *8 of 4-byte lanes, in *16 of bytes (two per 2-byte element), in *64 of
// 4-byte lanes (two per 8-byte element, 4 mask bits).
struct Tables {
  alignas(8) uint8_t compress8[256][8];
  alignas(16) uint8_t compress16[256][16];
  alignas(8) uint8_t compress64[16][8];
  alignas(16) uint8_t expand16[256][16];
  alignas(8) uint8_t expand8[256][8];
  alignas(8) uint8_t expand64[16][8];
  alignas(32) uint32_t keep32[256][8];  // lane j all ones where bit j of m is set
  alignas(32) uint64_t keep64[16][4];
  Tables() {
    std::memset(this, 0, sizeof(*this));
    for (int m = 0; m < 256; ++m) {
      int k = 0;
      for (int j = 0; j < 8; ++j) {
        expand16[m][2 * j] = expand16[m][2 * j + 1] = 0x80;
        if (!((m >> j) & 1)) continue;
        keep32[m][j] = ~0u;
        compress8[m][k] = uint8_t(j);
        compress16[m][2 * k] = uint8_t(2 * j);
        compress16[m][2 * k + 1] = uint8_t(2 * j + 1);
        expand8[m][j] = uint8_t(k);
        expand16[m][2 * j] = uint8_t(2 * k);
        expand16[m][2 * j + 1] = uint8_t(2 * k + 1);
        ++k;
      }
    }
    for (int m = 0; m < 16; ++m) {
      int k = 0;
      for (int j = 0; j < 4; ++j) {
        if (!((m >> j) & 1)) continue;
        keep64[m][j] = ~0ull;
        compress64[m][2 * k] = uint8_t(2 * j);
        compress64[m][2 * k + 1] = uint8_t(2 * j + 1);
        expand64[m][2 * j] = uint8_t(2 * k);
        expand64[m][2 * j + 1] = uint8_t(2 * k + 1);
        ++k;
      }
    }
  }
};
const Tables kTables;

// One step of S elements, covered by S mask bits: load, the bits of the
// nonzero elements, compress (kept elements to the front) and expand (the
// first elements to the set bits' places, zeros elsewhere).
template <typename U>
struct Step;

template <>
struct Step<uint16_t> {
  static constexpr int S = 8;
  using V = __m128i;
  RELU_EXT_AVX2 static V load(const uint16_t* p) { return _mm_loadu_si128(reinterpret_cast<const V*>(p)); }
  RELU_EXT_AVX2 static void store(uint16_t* p, V v) { _mm_storeu_si128(reinterpret_cast<V*>(p), v); }
  RELU_EXT_AVX2 static unsigned nonzero(V v) {
    const V zero = _mm_cmpeq_epi16(v, _mm_setzero_si128());
    return ~unsigned(_mm_movemask_epi8(_mm_packs_epi16(zero, zero))) & 0xFFu;
  }
  RELU_EXT_AVX2 static V compress(V v, unsigned m) {
    return _mm_shuffle_epi8(v, _mm_load_si128(reinterpret_cast<const V*>(kTables.compress16[m])));
  }
  RELU_EXT_AVX2 static V expand(V v, unsigned m) {
    return _mm_shuffle_epi8(v, _mm_load_si128(reinterpret_cast<const V*>(kTables.expand16[m])));
  }
};

// The 8 one-byte lane indices at `idx` as the 32-bit lane indices of vpermd.
RELU_EXT_AVX2 inline __m256i lanes(const uint8_t* idx) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(idx)));
}

template <>
struct Step<uint32_t> {
  static constexpr int S = 8;
  using V = __m256i;
  RELU_EXT_AVX2 static V load(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const V*>(p)); }
  RELU_EXT_AVX2 static void store(uint32_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<V*>(p), v); }
  RELU_EXT_AVX2 static unsigned nonzero(V v) {
    const V zero = _mm256_cmpeq_epi32(v, _mm256_setzero_si256());
    return ~unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(zero))) & 0xFFu;
  }
  RELU_EXT_AVX2 static V compress(V v, unsigned m) { return _mm256_permutevar8x32_epi32(v, lanes(kTables.compress8[m])); }
  RELU_EXT_AVX2 static V expand(V v, unsigned m) {
    const V keep = _mm256_load_si256(reinterpret_cast<const V*>(kTables.keep32[m]));
    return _mm256_and_si256(_mm256_permutevar8x32_epi32(v, lanes(kTables.expand8[m])), keep);
  }
};

template <>
struct Step<uint64_t> {
  static constexpr int S = 4;
  using V = __m256i;
  RELU_EXT_AVX2 static V load(const uint64_t* p) { return _mm256_loadu_si256(reinterpret_cast<const V*>(p)); }
  RELU_EXT_AVX2 static void store(uint64_t* p, V v) { _mm256_storeu_si256(reinterpret_cast<V*>(p), v); }
  RELU_EXT_AVX2 static unsigned nonzero(V v) {
    const V zero = _mm256_cmpeq_epi64(v, _mm256_setzero_si256());
    return ~unsigned(_mm256_movemask_pd(_mm256_castsi256_pd(zero))) & 0xFu;
  }
  RELU_EXT_AVX2 static V compress(V v, unsigned m) { return _mm256_permutevar8x32_epi32(v, lanes(kTables.compress64[m])); }
  RELU_EXT_AVX2 static V expand(V v, unsigned m) {
    const V keep = _mm256_load_si256(reinterpret_cast<const V*>(kTables.keep64[m]));
    return _mm256_and_si256(_mm256_permutevar8x32_epi32(v, lanes(kTables.expand64[m])), keep);
  }
};

// The whole mask bytes of [b0, b1) by steps, the tensor's partial last byte
// by the portable code. A step stores S elements where it keeps k <= S, so
// it may store straight into `out` only while S fit before the chunk's end
// (`out_end`: the next chunk's values, written by another thread, start
// there). The main loop takes two mask bytes (16 elements) at a time, as many
// as certainly fit (each pair keeps at most 16), without a check per step;
// the rest stores through a buffer where S do not fit.
template <typename U>
RELU_EXT_AVX2 int64_t compact_chunk_avx2(const U* y, const uint8_t* mask, int64_t n, int64_t b0, int64_t b1, U* out,
                                     const U* out_end) {
  using St = Step<U>;
  constexpr int S = St::S;
  int64_t missed = 0, b = b0;
  const int64_t full = std::min(b1, n / 8);
  for (int64_t pairs; (pairs = std::min((full - b) / 2, int64_t(out_end - out) / 16)) > 0;) {
    for (const int64_t end = b + 2 * pairs; b < end; b += 2) {
      const unsigned m = mask[b] | unsigned(mask[b + 1]) << 8;
      typename St::V v[16 / S];
      unsigned nonzero = 0;
      for (int h = 0; h < 16 / S; ++h) {
        v[h] = St::load(y + b * 8 + h * S);
        nonzero |= St::nonzero(v[h]) << (h * S);
      }
      missed += _mm_popcnt_u32(nonzero & ~m & 0xFFFFu);
      for (int h = 0; h < 16 / S; ++h) {
        const unsigned part = (m >> (h * S)) & ((1u << S) - 1u);
        St::store(out, St::compress(v[h], part));
        out += _mm_popcnt_u32(part);
      }
    }
  }
  for (; b < full; ++b) {
    for (int h = 0; h < 8; h += S) {
      const unsigned m = (mask[b] >> h) & ((1u << S) - 1u);
      const auto v = St::load(y + b * 8 + h);
      missed += _mm_popcnt_u32(St::nonzero(v) & ~m);
      const auto kept = St::compress(v, m);
      const int k = _mm_popcnt_u32(m);
      if (out_end - out >= S) {
        St::store(out, kept);
      } else if (k > 0) {
        U buf[S];
        St::store(buf, kept);
        std::memcpy(out, buf, sizeof(U) * k);
      }
      out += k;
    }
  }
  return missed + compact_chunk<U>(y, mask, n, std::max(b0, full), b1, out);
}

// A step loads S values where it needs k <= S: the main loop takes pairs of
// mask bytes while 16 values are left to read, the rest loads from a copy of
// what is left where S are not.
template <typename U>
RELU_EXT_AVX2 void expand_chunk_avx2(const U* values, int64_t total, const uint8_t* mask, int64_t n, int64_t b0,
                                 int64_t b1, int64_t pos, U* out) {
  using St = Step<U>;
  constexpr int S = St::S;
  const int64_t full = std::min(b1, n / 8);
  int64_t b = b0;
  for (int64_t pairs; (pairs = std::min((full - b) / 2, (total - pos) / 16)) > 0;) {
    for (const int64_t end = b + 2 * pairs; b < end; b += 2) {
      const unsigned m = mask[b] | unsigned(mask[b + 1]) << 8;
      for (int h = 0; h < 16 / S; ++h) {
        const unsigned part = (m >> (h * S)) & ((1u << S) - 1u);
        St::store(out + b * 8 + h * S, St::expand(St::load(values + pos), part));
        pos += _mm_popcnt_u32(part);
      }
    }
  }
  for (; b < full; ++b) {
    for (int h = 0; h < 8; h += S) {
      const unsigned m = (mask[b] >> h) & ((1u << S) - 1u);
      typename St::V v;
      if (total - pos >= S) {
        v = St::load(values + pos);
      } else {
        U buf[S] = {};
        if (total > pos) std::memcpy(buf, values + pos, sizeof(U) * (total - pos));
        v = St::load(buf);
      }
      St::store(out + b * 8 + h, St::expand(v, m));
      pos += _mm_popcnt_u32(m);
    }
  }
  expand_chunk<U>(values, total, mask, n, std::max(b0, full), b1, pos, out);
}

template <typename U>
RELU_EXT_AVX2 void nonzero_chunk_avx2(const U* y, int64_t n, int64_t b0, int64_t b1, uint8_t* mask) {
  using St = Step<U>;
  const int64_t full = std::min(b1, n / 8);
  for (int64_t b = b0; b < full; ++b) {
    unsigned m = 0;
    for (int h = 0; h < 8; h += St::S) m |= St::nonzero(St::load(y + b * 8 + h)) << h;
    mask[b] = static_cast<uint8_t>(m);
  }
  nonzero_chunk<U>(y, n, std::max(b0, full), b1, mask);
}

// AVX-512: S elements a step (a 64-byte vector), S mask bits; the k lanes
// of a mask are the mask bits themselves. Masked loads and stores neither
// fault nor write outside their lanes, so each step reads and writes exactly
// its elements and the partial last step needs no other code.
template <typename U>
struct Vec512;

template <>
struct Vec512<uint16_t> {
  static constexpr int S = 32;
  RELU_EXT_AVX512 static __m512i load(uint64_t k, const uint16_t* p) { return _mm512_maskz_loadu_epi16(__mmask32(k), p); }
  RELU_EXT_AVX512 static void store(uint16_t* p, uint64_t k, __m512i v) { _mm512_mask_storeu_epi16(p, __mmask32(k), v); }
  RELU_EXT_AVX512 static uint64_t nonzero(__m512i v) { return _mm512_test_epi16_mask(v, v); }
  RELU_EXT_AVX512 static __m512i compress(uint64_t k, __m512i v) { return _mm512_maskz_compress_epi16(__mmask32(k), v); }
  RELU_EXT_AVX512 static __m512i expand(uint64_t k, __m512i v) { return _mm512_maskz_expand_epi16(__mmask32(k), v); }
};

template <>
struct Vec512<uint32_t> {
  static constexpr int S = 16;
  RELU_EXT_AVX512 static __m512i load(uint64_t k, const uint32_t* p) { return _mm512_maskz_loadu_epi32(__mmask16(k), p); }
  RELU_EXT_AVX512 static void store(uint32_t* p, uint64_t k, __m512i v) { _mm512_mask_storeu_epi32(p, __mmask16(k), v); }
  RELU_EXT_AVX512 static uint64_t nonzero(__m512i v) { return _mm512_test_epi32_mask(v, v); }
  RELU_EXT_AVX512 static __m512i compress(uint64_t k, __m512i v) { return _mm512_maskz_compress_epi32(__mmask16(k), v); }
  RELU_EXT_AVX512 static __m512i expand(uint64_t k, __m512i v) { return _mm512_maskz_expand_epi32(__mmask16(k), v); }
};

template <>
struct Vec512<uint64_t> {
  static constexpr int S = 8;
  RELU_EXT_AVX512 static __m512i load(uint64_t k, const uint64_t* p) { return _mm512_maskz_loadu_epi64(__mmask8(k), p); }
  RELU_EXT_AVX512 static void store(uint64_t* p, uint64_t k, __m512i v) { _mm512_mask_storeu_epi64(p, __mmask8(k), v); }
  RELU_EXT_AVX512 static uint64_t nonzero(__m512i v) { return _mm512_test_epi64_mask(v, v); }
  RELU_EXT_AVX512 static __m512i compress(uint64_t k, __m512i v) { return _mm512_maskz_compress_epi64(__mmask8(k), v); }
  RELU_EXT_AVX512 static __m512i expand(uint64_t k, __m512i v) { return _mm512_maskz_expand_epi64(__mmask8(k), v); }
};

// The first `count` (0..64) lanes.
inline uint64_t first_lanes(int64_t count) { return count >= 64 ? ~0ull : (1ull << count) - 1; }

// The unsigned integer of S bits.
template <int S>
using StepBits = std::conditional_t<S == 32, uint32_t, std::conditional_t<S == 16, uint16_t, uint8_t>>;

// Mask bits [i, i + S) (i a multiple of 8) as the lanes of a step, reading
// only the bytes of elements before `end`. A full step loads them as one
// integer of S bits: a byte-wise copy into a wider one would cost a store
// forwarding stall per step.
template <int S>
inline uint64_t step_bits(const uint8_t* mask, int64_t i, int64_t end) {
  if (end - i >= S) {
    StepBits<S> bits;
    std::memcpy(&bits, mask + i / 8, sizeof(bits));
    return bits;
  }
  uint8_t bytes[8] = {};
  std::memcpy(bytes, mask + i / 8, (end - i + 7) / 8);
  uint64_t bits;
  std::memcpy(&bits, bytes, 8);
  return bits & first_lanes(end - i);
}

// One step: the kept values of y[0, S) (`lanes`: those inside the tensor) to
// `out`; returns how many, and counts in *missed the dropped values that are not +0.
template <typename U>
RELU_EXT_AVX512 inline int compact_step(const U* y, uint64_t m, uint64_t lanes, U* out, int64_t* missed) {
  using V = Vec512<U>;
  const __m512i v = V::load(lanes, y);
  *missed += _mm_popcnt_u64(V::nonzero(v) & ~m);
  const int k = static_cast<int>(_mm_popcnt_u64(m));
  V::store(out, first_lanes(k), V::compress(m, v));
  return k;
}

template <typename U>
RELU_EXT_AVX512 inline int expand_step(const U* values, uint64_t m, uint64_t lanes, U* out) {
  using V = Vec512<U>;
  const int k = static_cast<int>(_mm_popcnt_u64(m));
  V::store(out, lanes, V::expand(m, V::load(first_lanes(k), values)));
  return k;
}

template <typename U>
RELU_EXT_AVX512 int64_t compact_chunk_avx512(const U* y, const uint8_t* mask, int64_t n, int64_t b0, int64_t b1,
                                         U* out) {
  constexpr int S = Vec512<U>::S;
  const int64_t end = std::min(b1 * 8, n);
  int64_t missed = 0, i = b0 * 8;
  for (; i + S <= end; i += S) out += compact_step(y + i, step_bits<S>(mask, i, end), first_lanes(S), out, &missed);
  if (i < end) compact_step(y + i, step_bits<S>(mask, i, end), first_lanes(end - i), out, &missed);
  return missed;
}

template <typename U>
RELU_EXT_AVX512 void expand_chunk_avx512(const U* values, const uint8_t* mask, int64_t n, int64_t b0, int64_t b1,
                                     int64_t pos, U* out) {
  constexpr int S = Vec512<U>::S;
  const int64_t end = std::min(b1 * 8, n);
  int64_t i = b0 * 8;
  for (; i + S <= end; i += S) pos += expand_step(values + pos, step_bits<S>(mask, i, end), first_lanes(S), out + i);
  if (i < end) expand_step(values + pos, step_bits<S>(mask, i, end), first_lanes(end - i), out + i);
}

template <typename U>
RELU_EXT_AVX512 void nonzero_chunk_avx512(const U* y, int64_t n, int64_t b0, int64_t b1, uint8_t* mask) {
  using V = Vec512<U>;
  constexpr int S = V::S;
  const int64_t end = std::min(b1 * 8, n);
  int64_t i = b0 * 8;
  for (; i + S <= end; i += S) {
    const auto bits = static_cast<StepBits<S>>(V::nonzero(V::load(first_lanes(S), y + i)));
    std::memcpy(mask + i / 8, &bits, sizeof(bits));
  }
  if (i < end) {
    const uint64_t bits = V::nonzero(V::load(first_lanes(end - i), y + i));
    std::memcpy(mask + i / 8, &bits, (end - i + 7) / 8);
  }
}

#endif  // RELU_EXT_X86

}  // namespace

namespace {

// The kept elements of y into values, chunk c's from start[c]; the dropped ones that are not +0, counted.
int64_t compact_from(const at::Tensor& y, const uint8_t* mask, const std::vector<int64_t>& start, Isa set,
                     const at::Tensor& values) {
  const int64_t n = y.numel();
  std::vector<int64_t> missed(start.size(), 0);
  dispatch_width(y.element_size(), [&](auto u) {
    using U = decltype(u);
    const U* in = static_cast<const U*>(y.const_data_ptr());
    U* out = static_cast<U*>(values.data_ptr());
    for_each_chunk(n, [&](int64_t c, int64_t b0, int64_t b1) {
#ifdef RELU_EXT_X86
      if (set == kAvx512) {
        missed[c] = compact_chunk_avx512<U>(in, mask, n, b0, b1, out + start[c]);
        return;
      }
      if (set == kAvx2) {
        missed[c] = compact_chunk_avx2<U>(in, mask, n, b0, b1, out + start[c], out + start[c + 1]);
        return;
      }
#endif
      missed[c] = compact_chunk<U>(in, mask, n, b0, b1, out + start[c]);
    });
  });
  int64_t total = 0;
  for (const int64_t m : missed) total += m;
  return total;
}

}  // namespace

at::Tensor compact_cpu(const at::Tensor& y, const uint8_t* mask, int64_t* missed_total) {
  const Isa set = cpu_kernels();
  const std::vector<int64_t> start = chunk_starts(mask, y.numel(), set != kScalar);
  at::Tensor values = at::empty({start.back()}, y.options());
  *missed_total = compact_from(y, mask, start, set, values);
  return values;
}

std::tuple<at::Tensor, at::Tensor, bool> compact_now_cpu(const at::Tensor& y, const std::optional<at::Tensor>& mask) {
  int64_t missed = 0;
  if (mask.has_value()) {
    at::Tensor values = compact_cpu(y, mask->const_data_ptr<uint8_t>(), &missed);
    if (missed == 0) return {values, *mask, true};
  }
  at::Tensor own = new_mask(y);
  nonzero_mask_cpu(y, own.data_ptr<uint8_t>());
  return {compact_cpu(y, own.const_data_ptr<uint8_t>(), &missed), own, false};
}

int64_t kept_count_cpu(const uint8_t* mask, int64_t n) { return chunk_starts(mask, n, cpu_kernels() != kScalar).back(); }

int64_t compact_into_cpu(const at::Tensor& y, const uint8_t* mask, const at::Tensor& values) {
  const Isa set = cpu_kernels();
  const std::vector<int64_t> start = chunk_starts(mask, y.numel(), set != kScalar);
  if (start.back() != values.numel()) return 1;  // (as on CUDA: counted as missed, nothing written)
  return compact_from(y, mask, start, set, values);
}

void expand_cpu(const at::Tensor& values, const uint8_t* mask, const at::Tensor& out) {
  const int64_t n = out.numel(), total = values.numel();
  const Isa set = cpu_kernels();
  const std::vector<int64_t> start = chunk_starts(mask, n, set != kScalar);
  TORCH_CHECK(start.back() == total, "relu_ext::expand: the mask keeps ", start.back(), " elements but values has ",
              total);
  dispatch_width(out.element_size(), [&](auto u) {
    using U = decltype(u);
    const U* in = static_cast<const U*>(values.const_data_ptr());
    U* dst = static_cast<U*>(out.data_ptr());
    for_each_chunk(n, [&](int64_t c, int64_t b0, int64_t b1) {
#ifdef RELU_EXT_X86
      if (set == kAvx512) return expand_chunk_avx512<U>(in, mask, n, b0, b1, start[c], dst);
      if (set == kAvx2) return expand_chunk_avx2<U>(in, total, mask, n, b0, b1, start[c], dst);
#endif
      expand_chunk<U>(in, total, mask, n, b0, b1, start[c], dst);
    });
  });
}

bool same_bits_cpu(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu() && a.layout() == at::kStrided && b.layout() == at::kStrided,
              "relu_ext.same_bits: strided CPU tensors only, got ", a.device(), " ", a.layout(), " and ", b.device(),
              " ", b.layout());
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(), "relu_ext.same_bits: tensors of ",
              a.sizes(), " ", a.scalar_type(), " and ", b.sizes(), " ", b.scalar_type(), " differ in shape or dtype");
  const int64_t width = static_cast<int64_t>(a.element_size());
  std::atomic<bool> differ{false};
  at::TensorIterator iter = at::TensorIteratorConfig().add_const_input(a).add_const_input(b).build();
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t n) {
        if (differ.load(std::memory_order_relaxed)) return;
        if (strides[0] == width && strides[1] == width) {
          if (std::memcmp(data[0], data[1], static_cast<size_t>(n * width)) != 0) differ = true;
          return;
        }
        for (int64_t i = 0; i < n; ++i) {
          if (std::memcmp(data[0] + i * strides[0], data[1] + i * strides[1], static_cast<size_t>(width)) != 0) {
            differ = true;
            return;
          }
        }
      },
      kChunkBytes * 8);
  return !differ.load();
}

namespace {

// The sum of 64-bit words [begin, end) of `data`, modulo 2**64 (unsigned: it wraps).
uint64_t sum_words(const char* data, int64_t begin, int64_t end) {
  uint64_t sum = 0;
  for (int64_t i = begin; i < end; ++i) {
    uint64_t word;
    std::memcpy(&word, data + 8 * i, 8);
    sum += word;
  }
  return sum;
}

}  // namespace

int64_t bits_sum_cpu(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided && t.is_non_overlapping_and_dense(),
              "relu_ext.bits_sum: a dense strided CPU tensor only, got ", t.device(), " ", t.layout(), " of sizes ",
              t.sizes(), " and strides ", t.strides());
  const int64_t width = static_cast<int64_t>(t.element_size());
  TORCH_CHECK(8 % width == 0, "relu_ext.bits_sum: elements of 1, 2, 4 or 8 bytes, got ", width);
  // Dense: its elements fill the block of memory that starts at its data pointer (strides are never
  // negative). Its bytes are summed as 64-bit words from there (the last one zero-padded): an element
  // lies in one word (its width divides 8), so a change of its bits changes one word, and the sum.
  const char* data = static_cast<const char*>(t.const_data_ptr());
  const int64_t bytes = t.numel() * width, words = bytes / 8;
  uint64_t sum = at::parallel_reduce(
      int64_t{0}, words, at::internal::GRAIN_SIZE, uint64_t{0},
      [&](int64_t begin, int64_t end, uint64_t acc) { return acc + sum_words(data, begin, end); },
      [](uint64_t a, uint64_t b) { return a + b; });
  uint64_t last = 0;
  std::memcpy(&last, data + 8 * words, static_cast<size_t>(bytes - 8 * words));
  return static_cast<int64_t>(sum + last);
}

namespace {

// Two-valued tensors (binary_mask / binary_expand): one pass each. The
// portable code serves the scalar set and the tensor's partial last byte; the
// AVX-512 set runs the AVX2 code (these passes are bound by memory).
// binary_chunk: the nonzero bitmap of mask bytes [b0, b1), and whether every
// nonzero element there is v.
template <typename U>
bool binary_chunk(const U* y, int64_t n, int64_t b0, int64_t b1, U v, uint8_t* mask) {
  unsigned other = 0;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t base = b * 8;
    const int count = static_cast<int>(std::min<int64_t>(8, n - base));
    unsigned m = 0;
    for (int j = 0; j < count; ++j) {
      m |= unsigned(y[base + j] != 0) << j;
      other |= unsigned(y[base + j] != 0 && y[base + j] != v);
    }
    mask[b] = static_cast<uint8_t>(m);
  }
  return other == 0;
}

template <typename U>
void fill_chunk(const uint8_t* mask, int64_t n, int64_t b0, int64_t b1, U v, U* out) {
  for (int64_t b = b0; b < b1; ++b) {
    const unsigned m = mask_byte(mask, b, n);
    const int count = static_cast<int>(std::min<int64_t>(8, n - b * 8));
    for (int j = 0; j < count; ++j) out[b * 8 + j] = ((m >> j) & 1u) ? v : U(0);
  }
}

#ifdef RELU_EXT_X86
RELU_EXT_AVX2 inline __m128i splat(uint16_t v) { return _mm_set1_epi16(static_cast<short>(v)); }
RELU_EXT_AVX2 inline __m256i splat(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
RELU_EXT_AVX2 inline __m256i splat(uint64_t v) { return _mm256_set1_epi64x(static_cast<long long>(v)); }
RELU_EXT_AVX2 inline __m128i xor_of(__m128i a, __m128i b) { return _mm_xor_si128(a, b); }
RELU_EXT_AVX2 inline __m256i xor_of(__m256i a, __m256i b) { return _mm256_xor_si256(a, b); }
RELU_EXT_AVX2 inline __m128i and_of(__m128i a, __m128i b) { return _mm_and_si128(a, b); }
RELU_EXT_AVX2 inline __m256i and_of(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }

// All-ones lanes where bits of m (S of them, lane j <- bit j) are set.
RELU_EXT_AVX2 inline __m128i lanes_of(unsigned m, uint16_t) {
  const __m128i bit = _mm_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm_cmpeq_epi16(_mm_and_si128(_mm_set1_epi16(static_cast<short>(m)), bit), bit);
}
RELU_EXT_AVX2 inline __m256i lanes_of(unsigned m, uint32_t) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m)), bit), bit);
}
RELU_EXT_AVX2 inline __m256i lanes_of(unsigned m, uint64_t) {
  const __m256i bit = _mm256_setr_epi64x(1, 2, 4, 8);
  return _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_set1_epi64x(m), bit), bit);
}

template <typename U>
RELU_EXT_AVX2 bool binary_chunk_avx2(const U* y, int64_t n, int64_t b0, int64_t b1, U v, uint8_t* mask) {
  using St = Step<U>;
  const auto value = splat(v);
  unsigned other = 0;
  const int64_t full = std::min(b1, n / 8);
  for (int64_t b = b0; b < full; ++b) {
    unsigned m = 0, differ = 0;
    for (int h = 0; h < 8; h += St::S) {
      const auto x = St::load(y + b * 8 + h);
      m |= St::nonzero(x) << h;
      differ |= St::nonzero(xor_of(x, value)) << h;
    }
    mask[b] = static_cast<uint8_t>(m);
    other |= m & differ;
  }
  return binary_chunk<U>(y, n, std::max(b0, full), b1, v, mask) && other == 0;
}

template <typename U>
RELU_EXT_AVX2 void fill_chunk_avx2(const uint8_t* mask, int64_t n, int64_t b0, int64_t b1, U v, U* out) {
  using St = Step<U>;
  const auto value = splat(v);
  const int64_t full = std::min(b1, n / 8);
  for (int64_t b = b0; b < full; ++b) {
    for (int h = 0; h < 8; h += St::S) St::store(out + b * 8 + h, and_of(lanes_of(mask[b] >> h, U{}), value));
  }
  fill_chunk<U>(mask, n, std::max(b0, full), b1, v, out);
}
#endif

}  // namespace

void nonzero_mask_cpu(const at::Tensor& y, uint8_t* mask) {
  const int64_t n = y.numel();
  const Isa set = cpu_kernels();
  dispatch_width(y.element_size(), [&](auto u) {
    using U = decltype(u);
    const U* in = static_cast<const U*>(y.const_data_ptr());
    for_each_chunk(n, [&](int64_t, int64_t b0, int64_t b1) {
#ifdef RELU_EXT_X86
      if (set == kAvx512) return nonzero_chunk_avx512<U>(in, n, b0, b1, mask);
      if (set == kAvx2) return nonzero_chunk_avx2<U>(in, n, b0, b1, mask);
#endif
      nonzero_chunk<U>(in, n, b0, b1, mask);
    });
  });
}

bool binary_mask_cpu(const at::Tensor& y, uint8_t* mask, const at::Tensor& value) {
  const int64_t n = y.numel();
  const Isa set = cpu_kernels();
  std::atomic<bool> other{false};
  dispatch_width(y.element_size(), [&](auto u) {
    using U = decltype(u);
    const U* in = static_cast<const U*>(y.const_data_ptr());
    int64_t first = 0;
    while (first < n && in[first] == 0) ++first;
    const U v = first < n ? in[first] : U(0);
    std::memcpy(value.data_ptr(), &v, sizeof(U));
    for_each_chunk(n, [&](int64_t, int64_t b0, int64_t b1) {
      if (other.load(std::memory_order_relaxed)) return;  // (a tensor that is not two-valued stops early)
#ifdef RELU_EXT_X86
      const bool two = set != kScalar ? binary_chunk_avx2<U>(in, n, b0, b1, v, mask)
                                      : binary_chunk<U>(in, n, b0, b1, v, mask);
#else
      const bool two = binary_chunk<U>(in, n, b0, b1, v, mask);
#endif
      if (!two) other = true;
    });
  });
  return !other.load();
}

void binary_expand_cpu(const uint8_t* mask, const at::Tensor& value, const at::Tensor& out) {
  const int64_t n = out.numel();
  const Isa set = cpu_kernels();
  dispatch_width(out.element_size(), [&](auto u) {
    using U = decltype(u);
    U v;
    std::memcpy(&v, value.const_data_ptr(), sizeof(U));
    U* dst = static_cast<U*>(out.data_ptr());
    for_each_chunk(n, [&](int64_t, int64_t b0, int64_t b1) {
#ifdef RELU_EXT_X86
      if (set != kScalar) return fill_chunk_avx2<U>(mask, n, b0, b1, v, dst);
#endif
      fill_chunk<U>(mask, n, b0, b1, v, dst);
    });
  });
}

}  // namespace relu_ext
