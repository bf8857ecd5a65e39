// Runs the CUDA device code (csrc/relu_cuda_kernels.cuh) on the CPU, so that
// its indexing, tails, grid-stride loops, unrolls and warp-ballot mask words
// are checked on machines without a GPU (tests/test_cuda_emulation.py builds
// and runs this). A warp is 32 fibers (ucontext), one per lane; each runs
// until it reaches __ballot_sync, and the ballot returns once all 32 lanes
// have reached it (a lane that finishes while others wait is reported: a
// diverged ballot). Warps, then blocks, run one after another.
//
// Every kernel is compared with the element-wise contract of relu.h (the one
// the CPU kernels follow, and those are compared with torch.relu), on random
// bit patterns with every special value, with the outputs poisoned and guard
// elements around them: an element or mask byte written wrong, not written,
// or written out of bounds fails; inputs end where their data ends, so that
// built with -fsanitize=address a read past them is reported too (the test
// builds it so). Exit status 0 and "emulation: all passed".
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <random>
#include <vector>

struct Dim3 {
  unsigned x = 0;
};
// The CUDA built-ins the kernels read, set by the emulator before each lane runs.
Dim3 threadIdx, blockIdx, gridDim;
uint32_t __ballot_sync(uint32_t mask, bool predicate);

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#include "../csrc/relu_cuda_kernels.cuh"

namespace {

using relu_ext::kThreads;
using relu_ext::kWarps;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "emulation: FAIL: %s\n", what);
  std::exit(1);
}

// --- one warp as 32 fibers -----------------------------------------------------

constexpr int kLanes = 32;
ucontext_t scheduler;
ucontext_t lane_ctx[kLanes];
std::vector<char> stacks[kLanes];
bool at_ballot[kLanes];
bool finished[kLanes];
int current_lane;
uint32_t votes;   // of the ballot being collected
uint32_t result;  // of the last completed ballot
std::function<void()> warp_body;

void lane_main() {
  warp_body();
  finished[current_lane] = true;  // uc_link returns to the scheduler
}

}  // namespace

uint32_t __ballot_sync(uint32_t mask, bool predicate) {
  if (mask != 0xFFFFFFFFu) fail("__ballot_sync with a partial mask");
  const int me = current_lane;
  if (predicate) votes |= 1u << me;
  at_ballot[me] = true;
  swapcontext(&lane_ctx[me], &scheduler);
  return result;
}

namespace {

void run_warp(unsigned block, unsigned warp) {
  for (int lane = 0; lane < kLanes; ++lane) {
    stacks[lane].resize(256 * 1024);
    getcontext(&lane_ctx[lane]);
    lane_ctx[lane].uc_stack.ss_sp = stacks[lane].data();
    lane_ctx[lane].uc_stack.ss_size = stacks[lane].size();
    lane_ctx[lane].uc_link = &scheduler;
    makecontext(&lane_ctx[lane], lane_main, 0);
    finished[lane] = false;
  }
  blockIdx.x = block;
  for (;;) {
    votes = 0;
    for (int lane = 0; lane < kLanes; ++lane) {
      if (finished[lane]) continue;
      current_lane = lane;
      threadIdx.x = warp * kLanes + lane;
      at_ballot[lane] = false;
      swapcontext(&scheduler, &lane_ctx[lane]);
    }
    int done = 0, waiting = 0;
    for (int lane = 0; lane < kLanes; ++lane) {
      done += finished[lane];
      waiting += !finished[lane] && at_ballot[lane];
    }
    if (done == kLanes) return;
    if (waiting != kLanes) fail("diverged ballot: some lanes wait at __ballot_sync while others have finished");
    result = votes;
  }
}

// kernel<<<grid, kThreads>>>(args...), one warp at a time.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, unsigned grid, Args... args) {
  gridDim.x = grid;
  warp_body = [&] { kernel(args...); };
  for (unsigned b = 0; b < grid; ++b) {
    for (unsigned w = 0; w < unsigned(kWarps); ++w) run_warp(b, w);
  }
}

// --- data and checks -------------------------------------------------------------

std::mt19937_64 rng(12345);
long checks = 0;

// Random bit patterns, a third of them replaced by special values.
template <typename U, U kInf>
std::vector<U> adversarial(int64_t n) {
  constexpr U sign = relu_ext::Bits<U>::kSign;
  const U specials[] = {U(0), sign, kInf, U(kInf | sign), U(kInf + 1), U(kInf | (kInf >> 1)), U(~U(0)),
                        U(sign | 1), U(1), U(kInf - 1), U(sign | U(kInf - 1))};
  std::vector<U> v(n);
  for (auto& e : v) {
    const uint64_t r = rng();
    e = (r % 3 == 0) ? specials[(r >> 8) % (sizeof(specials) / sizeof(U))] : U(rng());
  }
  return v;
}

void expect(bool ok, const char* what, const char* kernel, int64_t n, int64_t at) {
  ++checks;
  if (!ok) {
    char msg[256];
    std::snprintf(msg, sizeof msg, "%s: %s wrong at %lld (n=%lld)", kernel, what, (long long)at, (long long)n);
    fail(msg);
  }
}

// Blocks for `threads` threads, at most `cap` (the device's resident limit in
// relu_cuda.cu; small here so that the grid-stride loops take several passes).
unsigned grid_for(int64_t threads, unsigned cap) {
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  return unsigned(std::max<int64_t>(1, std::min<int64_t>(blocks, cap)));
}

constexpr int kGuard = 16;  // poisoned elements / bytes on each side of every output

// `size` elements from a 16-byte boundary, each `fill`, and nothing past them
// (so that under AddressSanitizer a read past an input's end is reported).
template <typename U>
struct Buffer {
  Buffer(int64_t size, U fill) : data(static_cast<U*>(::operator new(size * sizeof(U), std::align_val_t(16)))) {
    std::fill(data, data + size, fill);
  }
  ~Buffer() { ::operator delete(data, std::align_val_t(16)); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  U* data;
};

// Forward (with a mask, without one, in place) and backward of one format,
// vector width V (data at `offset` elements from a 16-byte boundary) and unroll K.
template <typename U, U kInf, int V, int K>
void check(int64_t n, unsigned cap, int offset, const char* name) {
  using relu_ext::relu_keep;
  using relu_ext::relu_value;
  const U poison = U(0xA5A5A5A5A5A5A5A5ull);
  const std::vector<U> x0 = adversarial<U, kInf>(n), g0 = adversarial<U, kInf>(n);
  std::vector<uint8_t> want_mask((n + 7) / 8, 0);
  std::vector<U> want_y(n), want_g(n);
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = relu_keep<U, kInf>(x0[i]);
    want_y[i] = relu_value(x0[i], keep);
    want_g[i] = keep ? g0[i] : U(0);
    if (keep) want_mask[i / 8] |= uint8_t(1u << (i % 8));
  }
  // Data at lead = kGuard + offset elements from a 16-byte boundary, after
  // poison; an output also has kGuard poisoned elements after it, an input none.
  const int64_t lead = kGuard + offset;
  auto input = [&](const std::vector<U>& init) {
    auto b = std::make_unique<Buffer<U>>(lead + n, poison);
    std::copy(init.begin(), init.end(), b->data + lead);
    return b;
  };
  auto output = [&] { return std::make_unique<Buffer<U>>(lead + n + kGuard, poison); };
  const unsigned grid = grid_for((n + V * K - 1) / (V * K), cap);
  auto check_guards = [&](const U* base, const char* what) {
    for (int64_t i = 0; i < lead; ++i) expect(base[i] == poison, what, name, n, i - lead);
    for (int64_t i = 0; i < kGuard; ++i) expect(base[lead + n + i] == poison, what, name, n, n + i);
  };

  for (int with_mask = 0; with_mask < 2; ++with_mask) {
    const auto xs = input(x0), ys = output();
    std::vector<uint8_t> mask(kGuard + want_mask.size() + kGuard, 0xA5);  // operator new: 16-byte aligned
    uint8_t* m = mask.data() + kGuard;
    const U* x = xs->data;
    U* y = ys->data;
    launch(relu_ext::fwd_kernel<U, kInf, V, K>, grid, x + lead, y + lead, with_mask ? m : nullptr, n);
    for (int64_t i = 0; i < n; ++i) expect(y[lead + i] == want_y[i], "forward value", name, n, i);
    check_guards(y, "forward: write outside the output");
    for (int64_t i = 0; i < n; ++i) expect(x[lead + i] == x0[i], "forward: input changed", name, n, i);
    for (size_t i = 0; i < want_mask.size(); ++i) {
      expect(m[i] == (with_mask ? want_mask[i] : 0xA5), "mask byte", name, n, int64_t(i));
    }
    for (int i = 1; i <= kGuard; ++i) {
      expect(m[-i] == 0xA5, "mask: write before the mask", name, n, -i);
      expect(m[want_mask.size() - 1 + i] == 0xA5, "mask: write past the mask", name, n, want_mask.size() - 1 + i);
    }
  }
  {  // in place, writing the mask
    const auto xs = output();
    std::copy(x0.begin(), x0.end(), xs->data + lead);
    std::vector<uint8_t> mask(want_mask.size(), 0xA5);
    U* x = xs->data;
    launch(relu_ext::fwd_kernel<U, kInf, V, K>, grid, static_cast<const U*>(x + lead), x + lead, mask.data(), n);
    for (int64_t i = 0; i < n; ++i) expect(x[lead + i] == want_y[i], "in-place value", name, n, i);
    check_guards(x, "in place: write outside the tensor");
    for (size_t i = 0; i < want_mask.size(); ++i) expect(mask[i] == want_mask[i], "in-place mask byte", name, n, int64_t(i));
  }
  {  // backward from the mask (exactly ceil(n / 8) bytes)
    const auto gs = input(g0), outs = output();
    U* out = outs->data;
    launch(relu_ext::bwd_kernel<U, V, K>, grid, static_cast<const U*>(gs->data + lead),
           static_cast<const uint8_t*>(want_mask.data()), out + lead, n);
    for (int64_t i = 0; i < n; ++i) expect(out[lead + i] == want_g[i], "backward value", name, n, i);
    check_guards(out, "backward: write outside the output");
  }
}

template <typename T>
void check_int(int64_t n, unsigned cap) {
  std::vector<T> x(n), y(n + kGuard, T(99));
  for (auto& e : x) e = T(rng());
  launch(relu_ext::int_kernel<T>, grid_for(n, cap), static_cast<const T*>(x.data()), y.data(), n);
  for (int64_t i = 0; i < n; ++i) expect(y[i] == (x[i] > T(0) ? x[i] : T(0)), "integer value", "int_kernel", n, i);
  for (int64_t i = n; i < n + kGuard; ++i) expect(y[i] == T(99), "integer: write past the end", "int_kernel", n, i);
}

// Sizes around every edge: rows of 32 * V, groups of 32 * V * K, mask words of
// 32, and past several passes of a grid of `cap` blocks.
std::vector<int64_t> sizes_for(int v, int k, unsigned cap) {
  std::vector<int64_t> s = {1, 2, 7, 8, 9, 16, 24, 31, 32, 33, 40, 48, 56, 63, 64, 65};
  for (int64_t edge : {int64_t(32) * v, int64_t(32) * v * k, int64_t(64) * v * k}) {
    for (int64_t d : {-1, 0, 1}) s.push_back(edge + d);
  }
  const int64_t pass = int64_t(cap) * kThreads * v * k;
  s.push_back(2 * pass + 77);
  return s;
}

template <typename U, U kInf, int V, int K>
void check_sizes(const char* name) {
  for (unsigned cap : {1u, 3u}) {
    for (int64_t n : sizes_for(V, K, cap)) {
      check<U, kInf, V, K>(n, cap, 0, name);
    }
  }
}

template <typename U, U kInf>
void check_format(const char* dtype) {
  constexpr int V = 16 / sizeof(U);
  char name[3][64];
  for (int k = 0; k < 3; ++k) std::snprintf(name[k], sizeof name[k], "%s V=%d K=%d", dtype, V, 1 << k);
  check_sizes<U, kInf, V, 1>(name[0]);
  check_sizes<U, kInf, V, 2>(name[1]);
  check_sizes<U, kInf, V, 4>(name[2]);
  // The scalar kernel on data one element past a 16-byte boundary (x[1:]).
  char scalar[64];
  std::snprintf(scalar, sizeof scalar, "%s V=1 K=1 (unaligned)", dtype);
  for (unsigned cap : {1u, 3u}) {
    for (int64_t n : sizes_for(1, 1, cap)) check<U, kInf, 1, 1>(n, cap, 1, scalar);
  }
}

}  // namespace

int main() {
  check_format<uint32_t, relu_ext::kInfF32>("float32");
  check_format<uint64_t, relu_ext::kInfF64>("float64");
  check_format<uint16_t, relu_ext::kInfF16>("float16");
  check_format<uint16_t, relu_ext::kInfBF16>("bfloat16");
  for (unsigned cap : {1u, 3u}) {
    for (int64_t n : {1, 255, 256, 257, 3 * 256 * 3 + 5}) {
      check_int<int8_t>(n, cap);
      check_int<uint8_t>(n, cap);
      check_int<int64_t>(n, cap);
    }
  }
  std::printf("emulation: all passed (%ld checks)\n", checks);
  return 0;
}
