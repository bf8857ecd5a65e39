// Runs the CUDA device code (csrc/*/kernels.cuh, csrc/core/cuda.cuh) on the CPU, so that
// its indexing, tails, grid-stride loops, unrolls and shuffled mask words
// are checked on machines without a GPU (tests/activations/test_cuda_emulation.py builds
// and runs this). A warp is 32 fibers (ucontext), one per lane; each runs
// until it reaches a warp collective (__ballot_sync, __shfl_xor_sync), which
// returns once all 32 lanes have reached it, from what they all brought to it
// (lanes at different collectives, or a lane that finishes while others
// wait, are reported: a diverged warp). Warps, then blocks, run one after
// another; atomics are plain adds (lanes run one at a time).
//
// Every kernel is compared with the element-wise contract of core/bits.h (the one
// the CPU kernels follow, and those are compared with torch.relu), the
// family's kernels with their traits (activations.h) applied element by
// element (the CPU kernels are those traits, compared with PyTorch), and the
// compaction kernels with a scalar compaction of the same data, on random
// bit patterns with every special value, with the outputs poisoned and guard
// elements around them: an element or mask byte written wrong, not written,
// or written out of bounds fails; inputs end where their data ends, so that
// built with -fsanitize=address a read past them is reported too (the test
// builds it so). Exit status 0 and "emulation: all passed".
//
// The family's cases are arguments, `label op a b` each (the test passes
// every family row of tests/cases.py): the op is found by name in
// RELU_EXT_FAMILY and its Params are the trait's own params<T, kCuda = true>
// from c10::Scalar arguments, as the CUDA launcher builds them, so that an
// activation added to the tables is checked here with no line of its own.
// An op that is no family trait fails before anything runs.
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

struct Dim3 {
  unsigned x = 0;
};
// The CUDA built-ins the kernels read, set by the emulator before each lane runs.
Dim3 threadIdx, blockIdx, gridDim;
uint32_t __ballot_sync(uint32_t mask, bool predicate);
template <typename T>
T __shfl_xor_sync(uint32_t mask, T value, int lane_mask);
inline int __popc(uint32_t x) { return __builtin_popcount(x); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p += v;
  return old;
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#include "activations/kernels.cuh"
#include "compact/kernels.cuh"

namespace {

using relu_ext::kThreads;
using relu_ext::kWarps;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "emulation: FAIL: %s\n", what);
  std::exit(1);
}

// --- one warp as 32 fibers -----------------------------------------------------

constexpr int kLanes = 32;
// Each lane's stack. AddressSanitizer clears the shadow of a whole stack at
// every swapcontext into it, so the run's time grows with this size; the
// kernels use about 2 KiB. The lowest kStackGuard bytes are painted once and
// checked at the end (stack_guards_intact): a lane that came near the end
// fails the run instead of writing past it unseen.
constexpr size_t kStack = 16 * 1024;
constexpr size_t kStackGuard = 4 * 1024;
constexpr char kPaint = char(0xCD);
ucontext_t scheduler;
ucontext_t lane_ctx[kLanes];
std::vector<char> stacks[kLanes];
bool finished[kLanes];
int current_lane;
// What each lane brought to the collective being collected (kind 0: not at
// one), and, once all 32 have, a copy that the lanes read when they resume
// (before any of them can bring something to the next one).
struct Arrival {
  int kind;
  int param;
  uint64_t value;
};
Arrival arrival[kLanes];
uint64_t brought[kLanes];
std::function<void()> warp_body;

void lane_main() {
  warp_body();
  finished[current_lane] = true;  // uc_link returns to the scheduler
}

enum Kind { kBallot = 1, kShflXor = 2 };

// Waits until all 32 lanes have reached a collective; they must be the same one.
void rendezvous(uint32_t mask, int kind, int param, uint64_t value) {
  if (mask != 0xFFFFFFFFu) fail("warp collective with a partial mask");
  const int me = current_lane;
  arrival[me] = {kind, param, value};
  swapcontext(&lane_ctx[me], &scheduler);
}

}  // namespace

uint32_t __ballot_sync(uint32_t mask, bool predicate) {
  rendezvous(mask, kBallot, 0, predicate ? 1 : 0);
  uint32_t votes = 0;
  for (int lane = 0; lane < kLanes; ++lane) votes |= uint32_t(brought[lane]) << lane;
  return votes;
}

template <typename T>
T __shfl_xor_sync(uint32_t mask, T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_integral_v<T>, "integers only");
  if (lane_mask < 0 || lane_mask >= kLanes) fail("__shfl_xor_sync: lane mask out of range");
  rendezvous(mask, kShflXor, lane_mask, uint64_t(value));
  return T(brought[current_lane ^ lane_mask]);
}

namespace {

bool stack_guards_intact() {
  for (const auto& st : stacks) {
    if (!st.empty() && std::any_of(st.begin(), st.begin() + kStackGuard, [](char c) { return c != kPaint; })) return false;
  }
  return true;
}

void run_warp(unsigned block, unsigned warp) {
  for (int lane = 0; lane < kLanes; ++lane) {
    if (stacks[lane].empty()) stacks[lane].assign(kStack, kPaint);
    getcontext(&lane_ctx[lane]);
    lane_ctx[lane].uc_stack.ss_sp = stacks[lane].data();
    lane_ctx[lane].uc_stack.ss_size = stacks[lane].size();
    lane_ctx[lane].uc_link = &scheduler;
    makecontext(&lane_ctx[lane], lane_main, 0);
    finished[lane] = false;
  }
  blockIdx.x = block;
  for (;;) {
    for (int lane = 0; lane < kLanes; ++lane) {
      if (finished[lane]) continue;
      current_lane = lane;
      threadIdx.x = warp * kLanes + lane;
      arrival[lane].kind = 0;
      swapcontext(&scheduler, &lane_ctx[lane]);
    }
    int done = 0, waiting = 0;
    for (int lane = 0; lane < kLanes; ++lane) {
      done += finished[lane];
      waiting += !finished[lane] && arrival[lane].kind != 0;
    }
    if (done == kLanes) return;
    if (waiting != kLanes) fail("diverged warp: some lanes wait at a collective while others have finished");
    for (int lane = 0; lane < kLanes; ++lane) {
      if (arrival[lane].kind != arrival[0].kind || arrival[lane].param != arrival[0].param) {
        fail("diverged warp: lanes at different collectives");
      }
      brought[lane] = arrival[lane].value;
    }
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
// cuda_launch.cuh; small here so that the grid-stride loops take several passes).
// kNoCap: every block it needs, one group per warp (set_cuda_waves(0)).
constexpr unsigned kNoCap = ~0u;
constexpr unsigned kCaps[] = {1u, 3u, kNoCap};
// The cap that sizes are made for: kNoCap takes the sizes of cap 3.
unsigned sized(unsigned cap) { return cap == kNoCap ? 3u : cap; }
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
  for (unsigned cap : kCaps) {
    for (int64_t n : sizes_for(V, K, sized(cap))) {
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
  for (unsigned cap : kCaps) {
    for (int64_t n : sizes_for(1, 1, sized(cap))) check<U, kInf, 1, 1>(n, cap, 1, scalar);
  }
}

// --- the family (activations.h) ----------------------------------------------------

template <typename U, typename T>
U bits_of(T v) {
  U u;
  std::memcpy(&u, &v, sizeof(U));
  return u;
}

// act_fwd_kernel (with a mask, without one, in place) and act_bwd_kernel for
// one activation, storage type T (bits U, infinity kInf), V and K, against
// the trait applied element by element; outputs compared bit for bit. The
// kernels get the Params the CUDA launcher builds, the trait's own
// params<T, kCuda = true> (threshold's rounded to T) from the op's Scalars
// (Scalar::to is why the harness links c10).
template <typename Act, typename T, typename U, U kInf, int V, int K>
void check_family(int64_t n, unsigned cap, int offset, const relu_ext::ActArgs& args, const char* name) {
  const auto p = Act::template params<T, /*kCuda=*/true>(args);
  const U poison = U(0xA5A5A5A5A5A5A5A5ull);
  const std::vector<U> xb = adversarial<U, kInf>(n), gb = adversarial<U, kInf>(n);
  std::vector<T> x0(n), g0(n);
  std::memcpy(x0.data(), xb.data(), n * sizeof(U));
  std::memcpy(g0.data(), gb.data(), n * sizeof(U));
  std::vector<uint8_t> want_mask((n + 7) / 8, 0);
  std::vector<U> want_y(n), want_g(n);
  for (int64_t i = 0; i < n; ++i) {
    const bool keep = Act::keep(x0[i], p);
    want_y[i] = bits_of<U>(Act::template forward<true>(x0[i], p));
    want_g[i] = bits_of<U>(Act::grad(g0[i], keep, p));
    if (keep) want_mask[i / 8] |= uint8_t(1u << (i % 8));
  }
  const int64_t lead = kGuard + offset;
  const unsigned grid = grid_for((n + V * K - 1) / (V * K), cap);
  auto check_guards = [&](const U* base, const char* what) {
    for (int64_t i = 0; i < lead; ++i) expect(base[i] == poison, what, name, n, i - lead);
    for (int64_t i = 0; i < kGuard; ++i) expect(base[lead + n + i] == poison, what, name, n, n + i);
  };
  for (int mode = 0; mode < 3; ++mode) {  // 0: no mask, 1: mask, 2: in place with the mask
    Buffer<U> xs(lead + n + kGuard, poison), ys(lead + n + kGuard, poison);
    std::memcpy(xs.data + lead, xb.data(), n * sizeof(U));
    std::vector<uint8_t> mask(kGuard + want_mask.size() + kGuard, 0xA5);
    uint8_t* m = mask.data() + kGuard;
    U* out = mode == 2 ? xs.data : ys.data;
    launch(relu_ext::act_fwd_kernel<Act, T, V, K>, grid, reinterpret_cast<const T*>(xs.data + lead),
           reinterpret_cast<T*>(out + lead), mode == 0 ? nullptr : m, n, p);
    for (int64_t i = 0; i < n; ++i) expect(out[lead + i] == want_y[i], "family forward value", name, n, i);
    check_guards(out, "family forward: write outside the output");
    for (size_t i = 0; i < want_mask.size(); ++i) {
      expect(m[i] == (mode == 0 ? 0xA5 : want_mask[i]), "family mask byte", name, n, int64_t(i));
    }
    for (int i = 1; i <= kGuard; ++i) {
      expect(m[-i] == 0xA5, "family mask: write before the mask", name, n, -i);
      expect(m[want_mask.size() - 1 + i] == 0xA5, "family mask: write past the mask", name, n, int64_t(i));
    }
  }
  Buffer<U> gs(lead + n, poison), outs(lead + n + kGuard, poison);
  std::memcpy(gs.data + lead, gb.data(), n * sizeof(U));
  launch(relu_ext::act_bwd_kernel<Act, T, V, K>, grid, reinterpret_cast<const T*>(gs.data + lead),
         static_cast<const uint8_t*>(want_mask.data()), reinterpret_cast<T*>(outs.data + lead), n, p);
  for (int64_t i = 0; i < n; ++i) expect(outs.data[lead + i] == want_g[i], "family backward value", name, n, i);
  check_guards(outs.data, "family backward: write outside the output");
}

// Every activation with the launcher's vector kernel (V, the default unroll
// K = 2) and its unaligned one (V = 1, K = 1), at every edge.
template <typename Act, typename T, typename U, U kInf>
void check_family_format(const char* act, const char* dtype, const relu_ext::ActArgs& args) {
  constexpr int V = 16 / sizeof(T);
  char name[2][96];
  std::snprintf(name[0], sizeof name[0], "%s %s V=%d K=2", act, dtype, V);
  std::snprintf(name[1], sizeof name[1], "%s %s V=1 K=1 (unaligned)", act, dtype);
  for (unsigned cap : kCaps) {
    for (int64_t n : sizes_for(V, 2, sized(cap))) check_family<Act, T, U, kInf, V, 2>(n, cap, 0, args, name[0]);
    for (int64_t n : sizes_for(1, 1, sized(cap))) check_family<Act, T, U, kInf, 1, 1>(n, cap, 1, args, name[1]);
  }
}

template <typename Act>
void check_family_dtypes(const char* act, const relu_ext::ActArgs& args) {
  check_family_format<Act, float, uint32_t, relu_ext::kInfF32>(act, "float32", args);
  check_family_format<Act, double, uint64_t, relu_ext::kInfF64>(act, "float64", args);
  check_family_format<Act, c10::Half, uint16_t, relu_ext::kInfF16>(act, "float16", args);
  check_family_format<Act, c10::BFloat16, uint16_t, relu_ext::kInfBF16>(act, "bfloat16", args);
}

// One case of the test table: a label, a family op by name and its two
// Scalar arguments (unused ones 0), as tests/activations/test_cuda_emulation.py
// passes them from tests/cases.py.
struct FamilyCase {
  std::string label, op;
  relu_ext::ActArgs args;
};

// fn(Trait{}) for the family trait named `op`; false when there is none
// (relu included: its kernels are its own, checked by check_format).
template <typename Fn>
bool with_family_act(const std::string& op, Fn&& fn) {
#define EMULATION_ACT(Act)          \
  if (op == relu_ext::Act::kName) { \
    fn(relu_ext::Act{});            \
    return true;                    \
  }
  RELU_EXT_FAMILY(EMULATION_ACT)
#undef EMULATION_ACT
  return false;
}

double parse_double(const char* text, const char* label) {
  char* end = nullptr;
  const double v = std::strtod(text, &end);  // "nan", "inf" and hex floats included
  if (end == text || *end != '\0') {
    char msg[256];
    std::snprintf(msg, sizeof msg, "case %s: '%s' is not a number", label, text);
    fail(msg);
  }
  return v;
}

// argv: `label op a b` quadruples; every op checked to be a family trait
// before any case runs.
std::vector<FamilyCase> parse_cases(int argc, char** argv) {
  if ((argc - 1) % 4 != 0) fail("usage: cuda_emulation [label op a b]... (family cases, quadruples)");
  std::vector<FamilyCase> cases;
  for (int i = 1; i < argc; i += 4) {
    FamilyCase c{argv[i], argv[i + 1],
                 {c10::Scalar(parse_double(argv[i + 2], argv[i])), c10::Scalar(parse_double(argv[i + 3], argv[i]))}};
    if (!with_family_act(c.op, [](auto) {})) {
      char msg[256];
      std::snprintf(msg, sizeof msg, "case %s: no family activation '%s' in RELU_EXT_FAMILY", c.label.c_str(),
                    c.op.c_str());
      fail(msg);
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

// --- compaction -----------------------------------------------------------------

enum MaskKind { kRandomMask, kAllOnes, kAllZeros, kSparse, kMaskKinds };
const char* const kMaskNames[] = {"random mask", "all-ones mask", "all-zero mask", "sparse mask"};

// ceil(n / 8) bytes, with garbage in the bits past n that the kernels must ignore.
std::vector<uint8_t> make_mask(int64_t n, int kind) {
  std::vector<uint8_t> m((n + 7) / 8);
  for (auto& b : m) {
    const uint64_t r = rng();
    b = kind == kRandomMask ? uint8_t(r) : kind == kAllOnes ? 0xFF : kind == kSparse && r % 8 == 0 ? uint8_t(1u << (r >> 8) % 8) : 0;
  }
  if (n % 8 != 0) m.back() |= uint8_t(kind == kRandomMask ? rng() : 0xFF) & uint8_t(0xFF << (n % 8));
  return m;
}

// count_kernel, compact_kernel and expand_kernel with the host's steps
// between them (the inclusive sum of the counts), and nonzero_kernel, for
// elements of U's width, against a scalar reference. V: the vector width the
// host picks for data `offset` elements from a 16-byte boundary.
template <typename U, U kInf, int V>
void check_compaction(int64_t n, unsigned cap, int offset, int mask_kind, const char* name) {
  using relu_ext::kTile;
  const U poison = U(0xA5A5A5A5A5A5A5A5ull);
  const std::vector<uint8_t> mask0 = make_mask(n, mask_kind);
  std::vector<U> y0 = adversarial<U, kInf>(n);
  auto keep = [&](int64_t i) { return (mask0[i / 8] >> (i % 8)) & 1; };
  if (mask_kind == kRandomMask) {  // most dropped elements +0, as after a ReLU
    for (int64_t i = 0; i < n; ++i) {
      if (!keep(i) && rng() % 4 != 0) y0[i] = 0;
    }
  }
  const int64_t tiles = (n + kTile - 1) / kTile, bytes = (n + 7) / 8;
  std::vector<U> want_values;
  std::vector<int64_t> want_counts(tiles, 0);
  std::vector<uint8_t> want_nonzero(bytes, 0);
  unsigned long long want_missed = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (keep(i)) {
      want_values.push_back(y0[i]);
      ++want_counts[i / kTile];
    }
    want_missed += !keep(i) && y0[i] != 0;
    if (y0[i] != 0) want_nonzero[i / 8] |= uint8_t(1u << (i % 8));
  }
  const int64_t total = int64_t(want_values.size());
  const int64_t lead = kGuard + offset;

  // The mask at an odd address (the kernels read it by bytes), ending where its data ends.
  Buffer<uint8_t> mask_buf(1 + bytes, 0);
  const uint8_t* mask = mask_buf.data + 1;
  std::copy(mask0.begin(), mask0.end(), mask_buf.data + 1);
  Buffer<U> y_buf(lead + n, poison);
  std::copy(y0.begin(), y0.end(), y_buf.data + lead);
  const U* y = y_buf.data + lead;
  const unsigned grid = grid_for(tiles * 32, cap);

  // Counts per tile.
  const int64_t count_poison = int64_t(0xA5A5A5A5A5A5A5A5ull);
  Buffer<int64_t> counts(kGuard + tiles + kGuard, count_poison);
  launch(relu_ext::count_kernel, grid, mask, n, counts.data + kGuard);
  for (int64_t t = 0; t < tiles; ++t) expect(counts.data[kGuard + t] == want_counts[t], "tile count", name, n, t);
  for (int64_t i = 0; i < kGuard; ++i) {
    expect(counts.data[i] == count_poison, "count: write before the counts", name, n, i - kGuard);
    expect(counts.data[kGuard + tiles + i] == count_poison, "count: write past the counts", name, n, tiles + i);
  }
  Buffer<int64_t> ends_buf(tiles, 0);  // what at::cumsum makes of them
  for (int64_t t = 0; t < tiles; ++t) ends_buf.data[t] = counts.data[kGuard + t] + (t ? ends_buf.data[t - 1] : 0);
  const int64_t* ends = ends_buf.data;
  expect(ends[tiles - 1] == total, "kept total", name, n, tiles - 1);

  {  // compact: values sized exactly by the total, missed a counter between guards
    Buffer<U> values(kGuard + total + kGuard, poison);
    unsigned long long missed[3] = {0xA5A5A5A5ull, 0, 0xA5A5A5A5ull};
    launch(relu_ext::compact_kernel<U, V>, grid, y, mask, ends, n, values.data + kGuard, total, &missed[1]);
    for (int64_t i = 0; i < total; ++i) expect(values.data[kGuard + i] == want_values[i], "compact value", name, n, i);
    for (int64_t i = 0; i < kGuard; ++i) {
      expect(values.data[i] == poison, "compact: write before the values", name, n, i - kGuard);
      expect(values.data[kGuard + total + i] == poison, "compact: write past the values", name, n, total + i);
    }
    expect(missed[1] == want_missed, "compact: missed count", name, n, 0);
    expect(missed[0] == 0xA5A5A5A5ull && missed[2] == 0xA5A5A5A5ull, "compact: write beside missed", name, n, 0);
    for (int64_t i = 0; i < n; ++i) expect(y[i] == y0[i], "compact: input changed", name, n, i);
  }
  // values of another size than the count (a count the host did not wait for, gone wrong): one
  // element short, nothing is written past them; either way, missed counts it.
  for (const int64_t size : {total - 1, total + 1}) {
    if (size < 0) continue;
    Buffer<U> values(kGuard + size + kGuard, poison);
    unsigned long long missed[3] = {0xA5A5A5A5ull, 0, 0xA5A5A5A5ull};
    launch(relu_ext::compact_kernel<U, V>, grid, y, mask, ends, n, values.data + kGuard, size, &missed[1]);
    for (int64_t i = 0; i < kGuard; ++i) {
      expect(values.data[i] == poison, "compact into a wrong size: write before the values", name, n, i - kGuard);
      expect(values.data[kGuard + size + i] == poison, "compact into a wrong size: write past the values", name, n,
             size + i);
    }
    expect(missed[1] >= want_missed + 1, "compact into a wrong size: missed", name, n, size);
  }
  {  // expand: values exactly the kept elements (a read past them is reported by ASan)
    Buffer<U> values(total, poison);
    std::copy(want_values.begin(), want_values.end(), values.data);
    Buffer<U> out(lead + n + kGuard, poison);
    launch(relu_ext::expand_kernel<U, V>, grid, static_cast<const U*>(values.data), total, mask, ends, n, out.data + lead);
    int64_t rank = 0;
    for (int64_t i = 0; i < n; ++i) {
      const U want = keep(i) ? want_values[rank++] : U(0);
      expect(out.data[lead + i] == want, "expand value", name, n, i);
    }
    for (int64_t i = 0; i < lead; ++i) expect(out.data[i] == poison, "expand: write before the output", name, n, i - lead);
    for (int64_t i = 0; i < kGuard; ++i) {
      expect(out.data[lead + n + i] == poison, "expand: write past the output", name, n, n + i);
    }
  }
  if (total > 1) {  // values one short (an expand without the host's check): no read past them (ASan)
    Buffer<U> values(total - 1, poison);
    std::copy(want_values.begin(), want_values.end() - 1, values.data);
    Buffer<U> out(lead + n, poison);
    launch(relu_ext::expand_kernel<U, V>, grid, static_cast<const U*>(values.data), total - 1, mask, ends, n,
           out.data + lead);
    int64_t rank = 0;
    for (int64_t i = 0; i < n; ++i) {
      const U want = keep(i) && rank < total - 1 ? want_values[rank] : U(0);
      rank += keep(i);
      expect(out.data[lead + i] == want, "expand of values one short", name, n, i);
    }
  }
  if (mask_kind == kRandomMask) {  // nonzero_mask needs no mask: once per size, every unroll
    auto run = [&](auto kernel, unsigned g) {
      Buffer<uint8_t> out(kGuard + bytes + kGuard, 0xA5);  // the mask at a 16-byte boundary, as from at::empty
      launch(kernel, g, y, out.data + kGuard, n);
      for (int64_t i = 0; i < bytes; ++i) expect(out.data[kGuard + i] == want_nonzero[i], "nonzero mask byte", name, n, i);
      for (int64_t i = 0; i < kGuard; ++i) {
        expect(out.data[i] == 0xA5, "nonzero: write before the mask", name, n, i - kGuard);
        expect(out.data[kGuard + bytes + i] == 0xA5, "nonzero: write past the mask", name, n, bytes + i);
      }
    };
    if constexpr (V == 1) {
      run(relu_ext::nonzero_kernel<U, 1, 1>, grid_for(n, cap));
    } else {
      run(relu_ext::nonzero_kernel<U, V, 1>, grid_for((n + V - 1) / V, cap));
      run(relu_ext::nonzero_kernel<U, V, 2>, grid_for((n + 2 * V - 1) / (2 * V), cap));
      run(relu_ext::nonzero_kernel<U, V, 4>, grid_for((n + 4 * V - 1) / (4 * V), cap));
    }
  }
}

// Sizes around bytes, mask words, rows of 32 * V, groups of kRowsInFlight
// rows, tiles, and past several grid-stride passes of a grid of `cap` blocks
// (for the tiles and for nonzero_kernel's groups of 32 * V * 4).
std::vector<int64_t> compaction_sizes(int v, unsigned cap) {
  using relu_ext::kTile;
  std::vector<int64_t> s = {1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65};
  for (int64_t edge : {int64_t(32) * v, int64_t(32) * v * relu_ext::kRowsInFlight, kTile, 2 * kTile}) {
    for (int64_t d : {-1, 0, 1}) s.push_back(edge + d);
  }
  s.push_back(3 * kTile + 77);
  s.push_back((2 * int64_t(cap) * kWarps + 1) * kTile + 77);
  return s;
}

template <typename U, U kInf>
void check_compaction_width(const char* dtype) {
  constexpr int V = 16 / sizeof(U);
  char vec[64], scalar[64], name[128];
  std::snprintf(vec, sizeof vec, "%s V=%d", dtype, V);
  std::snprintf(scalar, sizeof scalar, "%s V=1 (unaligned)", dtype);
  for (unsigned cap : kCaps) {
    for (int kind = 0; kind < kMaskKinds; ++kind) {
      for (int64_t n : compaction_sizes(V, sized(cap))) {
        std::snprintf(name, sizeof name, "compaction %s, %s", vec, kMaskNames[kind]);
        check_compaction<U, kInf, V>(n, cap, 0, kind, name);
      }
      for (int64_t n : compaction_sizes(1, sized(cap))) {
        std::snprintf(name, sizeof name, "compaction %s, %s", scalar, kMaskNames[kind]);
        check_compaction<U, kInf, 1>(n, cap, 1, kind, name);
      }
    }
  }
}

// --- BatchNorm replay -------------------------------------------------------------

// bn_act_kernel (rebuild and check, with and without a residual input) for one
// activation and storage type, an N x C x S tensor contiguous or channels
// last (the kernel sees only memory offsets and stride(1)), against the
// formula written out here per (n, c, s), in the kernel's fma forms: a
// GPU's NaNs are canonical, but here a NaN's payload (of two, which one)
// depends on the form of each operation.
template <typename Act, typename T, typename U, U kInf>
void check_bn(int64_t N, int64_t C, int64_t S, bool channels_last, bool wide, unsigned cap, const char* name) {
  using M = relu_ext::OpMath<T>;
  const int64_t n = N * C * S;
  const relu_ext::ActArgs args{c10::Scalar(0.0), c10::Scalar(6.0)};  // relu6 = hardtanh(0, 6); relu ignores them
  const auto p = Act::template params<T, /*kCuda=*/true>(args);
  const U poison = U(0xA5A5A5A5A5A5A5A5ull);
  const std::vector<U> xb = adversarial<U, kInf>(n), x2b = adversarial<U, kInf>(n);
  std::vector<M> alpha(2 * C), beta(2 * C), alpha2(2 * C), beta2(2 * C);  // [w; invstd], [mean; b]
  std::normal_distribution<double> normal;
  for (auto* terms : {&alpha, &beta, &alpha2, &beta2}) {
    for (auto& v : *terms) v = M(normal(rng));
  }
  const auto bn = [&](const std::vector<U>& xs, const std::vector<M>& a, const std::vector<M>& b, int64_t o, int64_t c) {
    T x;
    std::memcpy(&x, &xs[o], sizeof(T));
    return relu_ext::from_m<T>(std::fma(std::fma(a[c], std::fma(relu_ext::to_m(x), M(1), -b[c]), M(-0.0)),
                                        a[C + c], b[C + c]));
  };
  for (int residual = 0; residual < 2; ++residual) {
    std::vector<U> want(n);
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t c = 0; c < C; ++c) {
        for (int64_t k = 0; k < S; ++k) {
          const int64_t o = channels_last ? (i * S + k) * C + c : (i * C + c) * S + k;
          T v = bn(xb, alpha, beta, o, c);
          if (residual) v = relu_ext::from_m<T>(std::fma(relu_ext::to_m(v), M(1), relu_ext::to_m(bn(x2b, alpha2, beta2, o, c))));
          want[o] = bits_of<U>(Act::template forward<true>(v, p));
        }
      }
    }
    const relu_ext::BnInput<T> in{reinterpret_cast<const T*>(xb.data()), alpha.data(), beta.data()};
    const relu_ext::BnInput<T> in2 = residual ? relu_ext::BnInput<T>{reinterpret_cast<const T*>(x2b.data()),
                                                                     alpha2.data(), beta2.data()}
                                              : relu_ext::BnInput<T>{nullptr, nullptr, nullptr};
    const int64_t inner = C == 1 ? n : channels_last ? 1 : S;
    const unsigned grid = grid_for(n, cap);
    Buffer<U> ys(kGuard + n + kGuard, poison);
    T* y = reinterpret_cast<T*>(ys.data + kGuard);
    if (wide) {  // (the launcher's choice from 2^31 elements up)
      launch(relu_ext::bn_act_kernel<Act, T, int64_t>, grid, in, in2, inner, C, n, p, y, static_cast<int*>(nullptr));
    } else {
      launch(relu_ext::bn_act_kernel<Act, T, uint32_t>, grid, in, in2, uint32_t(inner), uint32_t(C),
             uint32_t(n), p, y, static_cast<int*>(nullptr));
    }
    for (int64_t o = 0; o < n; ++o) expect(ys.data[kGuard + o] == want[o], "replay value", name, n, o);
    for (int64_t i = 0; i < kGuard; ++i) {
      expect(ys.data[i] == poison && ys.data[kGuard + n + i] == poison, "replay: write outside the output", name, n, i);
    }
    for (int64_t flip : {int64_t(-1), int64_t(0), n / 2, n - 1}) {  // -1: the real output itself
      std::vector<U> real = want;
      if (flip >= 0) real[flip] ^= U(1);
      int differ = 0;
      T* y_real = reinterpret_cast<T*>(real.data());
      if (wide) {
        launch(relu_ext::bn_act_kernel<Act, T, int64_t>, grid, in, in2, inner, C, n, p, y_real, &differ);
      } else {
        launch(relu_ext::bn_act_kernel<Act, T, uint32_t>, grid, in, in2, uint32_t(inner), uint32_t(C),
               uint32_t(n), p, y_real, &differ);
      }
      expect(differ == (flip >= 0 ? 1 : 0), "replay check", name, n, flip);
      expect(real == want || flip >= 0, "replay check: wrote its input", name, n, flip);
    }
  }
}

template <typename T, typename U, U kInf>
void check_bn_dtype(const char* dtype) {
  char name[96];
  for (unsigned cap : kCaps) {
    for (bool cl : {false, true}) {
      for (bool wide : {false, true}) {
        const char* layout = cl ? "channels_last" : "contiguous";
        const char* index = wide ? "int64" : "uint32";
        for (const auto& [N, C, S] : {std::array<int64_t, 3>{2, 3, 7}, {3, 5, 67}, {1, 1, 300}, {2, 16, 1}}) {
          std::snprintf(name, sizeof name, "bn_act relu %s %s %s", dtype, layout, index);
          check_bn<relu_ext::Relu, T, U, kInf>(N, C, S, cl, wide, cap, name);
          std::snprintf(name, sizeof name, "bn_act relu6 %s %s %s", dtype, layout, index);
          check_bn<relu_ext::Hardtanh, T, U, kInf>(N, C, S, cl, wide, cap, name);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) try {
  const std::vector<FamilyCase> cases = parse_cases(argc, argv);
  check_format<uint32_t, relu_ext::kInfF32>("float32");
  check_format<uint64_t, relu_ext::kInfF64>("float64");
  check_format<uint16_t, relu_ext::kInfF16>("float16");
  check_format<uint16_t, relu_ext::kInfBF16>("bfloat16");
  for (unsigned cap : kCaps) {
    for (int64_t n : {1, 255, 256, 257, 3 * 256 * 3 + 5}) {
      check_int<int8_t>(n, cap);
      check_int<uint8_t>(n, cap);
      check_int<int64_t>(n, cap);
    }
  }
  for (const FamilyCase& c : cases) {
    with_family_act(c.op, [&](auto act) { check_family_dtypes<decltype(act)>(c.label.c_str(), c.args); });
    std::printf("emulation: checked family case %s (%s)\n", c.label.c_str(), c.op.c_str());
  }
  check_compaction_width<uint16_t, relu_ext::kInfF16>("2-byte");
  check_compaction_width<uint32_t, relu_ext::kInfF32>("4-byte");
  check_compaction_width<uint64_t, relu_ext::kInfF64>("8-byte");
  check_bn_dtype<float, uint32_t, relu_ext::kInfF32>("float32");
  check_bn_dtype<double, uint64_t, relu_ext::kInfF64>("float64");
  check_bn_dtype<c10::Half, uint16_t, relu_ext::kInfF16>("float16");
  check_bn_dtype<c10::BFloat16, uint16_t, relu_ext::kInfBF16>("bfloat16");
  if (!stack_guards_intact()) fail("a lane's stack came within kStackGuard bytes of its end: raise kStack");
  std::printf("emulation: all passed (%ld checks)\n", checks);
  return 0;
} catch (const std::exception& e) {  // c10::Error: an argument Scalar::to<T> cannot convert (as PyTorch raises)
  fail(e.what());
}
