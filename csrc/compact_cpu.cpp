// Compaction of a dense tensor by a bitmap, on the CPU (save_compact): the
// kept elements in memory order (compact), their inverse (expand: dropped
// elements become +0), and the bitmap of nonzero elements. Elements move as
// the unsigned integers of their width, so every bit pattern (NaN payloads,
// -0.0, denormals) survives. Bitmaps follow the mask layout of relu.h.
//
// Work is split into chunks of kChunkBytes mask bytes: a first pass counts
// each chunk's kept elements (popcounts of the mask alone), an exclusive sum
// gives where each chunk's values start, and the chunks then run in parallel
// on disjoint ranges of both arrays.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "relu.h"

namespace relu_ext {
namespace {

constexpr int64_t kChunkBytes = 4096;  // 32768 elements, ATen's grain size

// Mask byte b with the bits past element n cleared (the last byte may be partial).
inline unsigned mask_byte(const uint8_t* mask, int64_t b, int64_t n) {
  const int64_t left = n - b * 8;
  return left >= 8 ? mask[b] : mask[b] & ((1u << left) - 1u);
}

int64_t popcount(const uint8_t* mask, int64_t b0, int64_t b1, int64_t n) {
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

int64_t chunks_of(int64_t n) { return ((n + 7) / 8 + kChunkBytes - 1) / kChunkBytes; }

// Where each chunk's values start; the last entry is the total.
std::vector<int64_t> chunk_starts(const uint8_t* mask, int64_t n) {
  const int64_t chunks = chunks_of(n), bytes = (n + 7) / 8;
  std::vector<int64_t> start(chunks + 1, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      start[c + 1] = popcount(mask, c * kChunkBytes, std::min(bytes, (c + 1) * kChunkBytes), n);
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

// Calls fn(U{}) with the unsigned integer of `t`'s element width.
template <typename Fn>
void dispatch_width(const at::Tensor& t, Fn&& fn) {
  switch (t.element_size()) {
    case 2: fn(uint16_t{}); break;
    case 4: fn(uint32_t{}); break;
    case 8: fn(uint64_t{}); break;
    default: TORCH_CHECK(false, "relu_ext: no compaction for elements of ", t.element_size(), " bytes");
  }
}

}  // namespace

at::Tensor compact_cpu(const at::Tensor& y, const uint8_t* mask, int64_t* missed_total) {
  const int64_t n = y.numel();
  const std::vector<int64_t> start = chunk_starts(mask, n);
  at::Tensor values = at::empty({start.back()}, y.options());
  std::vector<int64_t> missed(start.size(), 0);
  dispatch_width(y, [&](auto u) {
    using U = decltype(u);
    const U* in = static_cast<const U*>(y.const_data_ptr());
    U* out = static_cast<U*>(values.data_ptr());
    for_each_chunk(n, [&](int64_t c, int64_t b0, int64_t b1) {
      missed[c] = compact_chunk<U>(in, mask, n, b0, b1, out + start[c]);
    });
  });
  *missed_total = 0;
  for (const int64_t m : missed) *missed_total += m;
  return values;
}

void expand_cpu(const at::Tensor& values, const uint8_t* mask, const at::Tensor& out) {
  const int64_t n = out.numel(), total = values.numel();
  const std::vector<int64_t> start = chunk_starts(mask, n);
  TORCH_CHECK(start.back() == total, "relu_ext::expand: the mask keeps ", start.back(), " elements but values has ",
              total);
  dispatch_width(out, [&](auto u) {
    using U = decltype(u);
    const U* in = static_cast<const U*>(values.const_data_ptr());
    U* dst = static_cast<U*>(out.data_ptr());
    for_each_chunk(n, [&](int64_t c, int64_t b0, int64_t b1) {
      expand_chunk<U>(in, total, mask, n, b0, b1, start[c], dst);
    });
  });
}

void nonzero_mask_cpu(const at::Tensor& y, uint8_t* mask) {
  const int64_t n = y.numel();
  dispatch_width(y, [&](auto u) {
    using U = decltype(u);
    const U* in = static_cast<const U*>(y.const_data_ptr());
    for_each_chunk(n, [&](int64_t, int64_t b0, int64_t b1) { nonzero_chunk<U>(in, n, b0, b1, mask); });
  });
}

}  // namespace relu_ext
