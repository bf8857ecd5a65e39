// CUDA kernels: the launches (grid, stream, device, unroll and dtype choice)
// of the device code in relu_cuda_kernels.cuh.
#include "relu_cuda_kernels.cuh"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

namespace relu_ext {
namespace {

// Rows per warp and loop iteration when not set otherwise (set_cuda_unroll). 4:
// on an H100 (2026-11-25) bfloat16 forwards at 16M-256M ran at 86-92% of a copy
// with 4, 57-69% with 2 and 33-40% with 1; float32 at 92-97% with each.
constexpr int kDefaultUnroll = 4;
std::atomic<int> g_unroll{kDefaultUnroll};
// Grid cap in waves (set_cuda_waves): 0, no cap (every block needed, each
// warp one group of rows, as PyTorch launches); W, at most W waves of resident
// blocks that grid-stride. 0: on an H200 (2026-11-26) float32 forwards at 256M
// ran at 98% of a copy uncapped and 92% with one wave (time vs torch 1.02 and
// 1.09), the mask backward 0.71 and 0.74; bfloat16 tied or gained. ncu on an
// H100 had shown the one-wave grids' lower DRAM rate on the same bytes.
std::atomic<int> g_waves{0};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Blocks of kThreads for `threads_needed` threads, at most g_waves times as
// many as fit on the current device at once (asked of the CUDA runtime once
// per kernel and device: it depends on the kernel's registers); the
// grid-stride loops do the rest. With 0 waves, only CUDA's grid limit caps it.
template <typename Kernel>
unsigned int grid_for(Kernel kernel, int64_t threads_needed, int device) {
  constexpr int64_t kGridLimit = (int64_t(1) << 31) - 1;  // gridDim.x
  const int64_t blocks = std::max<int64_t>(1, (threads_needed + kThreads - 1) / kThreads);
  const int waves = g_waves.load(std::memory_order_relaxed);
  if (waves == 0) return static_cast<unsigned int>(std::min(blocks, kGridLimit));
  static std::mutex lock;
  static std::map<std::pair<const void*, int>, int64_t> fit;  // (kernel, device) -> blocks
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  int64_t most = 0;
  {
    const std::lock_guard<std::mutex> guard(lock);
    const auto it = fit.find(key);
    if (it != fit.end()) most = it->second;
  }
  if (most == 0) {
    int per_sm = 0, sms = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    most = int64_t(std::max(per_sm, 1)) * sms;
    const std::lock_guard<std::mutex> guard(lock);
    fit[key] = most;
  }
  return static_cast<unsigned int>(std::min(blocks, most * waves));
}

// Calls fn(std::integral_constant<int, K>{}) for the unroll in use.
template <typename Fn>
void with_unroll(Fn&& fn) {
  switch (g_unroll.load(std::memory_order_relaxed)) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    default: fn(std::integral_constant<int, 2>{}); break;
  }
}

template <typename Kernel, typename... Args>
void launch(Kernel kernel, int64_t threads_needed, int device, cudaStream_t stream, Args... args) {
  kernel<<<grid_for(kernel, threads_needed, device), kThreads, 0, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int I>
using Int = std::integral_constant<int, I>;

// An element-wise kernel over n elements of T: kernel_of(V, K) with V-element
// 16-byte vectors and K rows per warp and iteration when `vec` (every
// pointer it reads or writes is 16-byte aligned), else kernel_of(1, 1), one
// element at a time. K is set_cuda_unroll's choice where kTunable (ReLU's
// kernels are compiled for each), else the default.
template <typename T, bool kTunable, typename KernelOf, typename... Args>
void launch_elementwise(bool vec, int64_t n, int device, cudaStream_t stream, KernelOf kernel_of, Args... args) {
  constexpr int V = 16 / sizeof(T);
  if (!vec) return launch(kernel_of(Int<1>{}, Int<1>{}), n, device, stream, args...);
  const auto go = [&](auto unroll) {
    constexpr int K = decltype(unroll)::value;
    launch(kernel_of(Int<V>{}, unroll), (n + V * K - 1) / (V * K), device, stream, args...);
  };
  if constexpr (kTunable) {
    with_unroll(go);
  } else {
    go(Int<kDefaultUnroll>{});
  }
}

}  // namespace

template <>
void act_forward_cuda<Relu>(const at::Tensor& x, const at::Tensor& y, uint8_t* mask, const ActArgs&) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const bool vec = aligned16(x.const_data_ptr()) && aligned16(y.data_ptr());
  dispatch_bits(x.scalar_type(), [&](auto fmt) {
    using U = typename decltype(fmt)::U;
    launch_elementwise<U, true>(
        vec, n, x.get_device(), c10::cuda::getCurrentCUDAStream(),
        [](auto v, auto k) { return fwd_kernel<U, decltype(fmt)::kInf, decltype(v)::value, decltype(k)::value>; },
        static_cast<const U*>(x.const_data_ptr()), static_cast<U*>(y.data_ptr()), mask, n);
  });
}

void forward_int_cuda(const at::Tensor& x, const at::Tensor& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_INTEGRAL_TYPES(x.scalar_type(), "relu_ext_int", [&] {
    launch(int_kernel<scalar_t>, n, x.get_device(), c10::cuda::getCurrentCUDAStream(), x.const_data_ptr<scalar_t>(),
           y.data_ptr<scalar_t>(), n);
  });
}

template <>
void act_backward_cuda<Relu>(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in,
                             const ActArgs&) {
  const int64_t n = grad.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  const bool vec = aligned16(grad.const_data_ptr()) && aligned16(grad_in.data_ptr());
  dispatch_bits(grad.scalar_type(), [&](auto fmt) {
    using U = typename decltype(fmt)::U;
    launch_elementwise<U, true>(
        vec, n, grad.get_device(), c10::cuda::getCurrentCUDAStream(),
        [](auto v, auto k) { return bwd_kernel<U, decltype(v)::value, decltype(k)::value>; },
        static_cast<const U*>(grad.const_data_ptr()), mask, static_cast<U*>(grad_in.data_ptr()), n);
  });
}

// The family's kernels are compiled with the default unroll only (set_cuda_unroll
// tunes ReLU's): 4 activations x 4 dtypes x 3 unrolls x 7 GPU architectures
// would triple the CUDA build time.
template <typename Act>
void act_forward_cuda(const at::Tensor& x, const at::Tensor& y, uint8_t* mask, const ActArgs& args) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const bool vec = aligned16(x.const_data_ptr()) && aligned16(y.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), Act::kName, [&] {
    launch_elementwise<scalar_t, false>(
        vec, n, x.get_device(), c10::cuda::getCurrentCUDAStream(),
        [](auto v, auto k) { return act_fwd_kernel<Act, scalar_t, decltype(v)::value, decltype(k)::value>; },
        x.const_data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), mask, n, Act::template params<scalar_t, true>(args));
  });
}

template <typename Act>
void act_backward_cuda(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in, const ActArgs& args) {
  const int64_t n = grad.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  const bool vec = aligned16(grad.const_data_ptr()) && aligned16(grad_in.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), Act::kName, [&] {
    launch_elementwise<scalar_t, false>(
        vec, n, grad.get_device(), c10::cuda::getCurrentCUDAStream(),
        [](auto v, auto k) { return act_bwd_kernel<Act, scalar_t, decltype(v)::value, decltype(k)::value>; },
        grad.const_data_ptr<scalar_t>(), mask, grad_in.data_ptr<scalar_t>(), n,
        Act::template params<scalar_t, true>(args));
  });
}

#define RELU_EXT_INSTANTIATE(Act)                                                                          \
  template void act_forward_cuda<Act>(const at::Tensor&, const at::Tensor&, uint8_t*, const ActArgs&);   \
  template void act_backward_cuda<Act>(const at::Tensor&, const uint8_t*, const at::Tensor&, const ActArgs&);
RELU_EXT_FAMILY(RELU_EXT_INSTANTIATE)
#undef RELU_EXT_INSTANTIATE

namespace {

// The inclusive sum of the kept elements of each tile of the mask (n > 0);
// compact and expand read where each tile's values start from it.
at::Tensor tile_ends(const uint8_t* mask, int64_t n, const at::Tensor& like, cudaStream_t stream) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  at::Tensor counts = at::empty({tiles}, like.options().dtype(at::kLong));
  launch(count_kernel, tiles * 32, like.get_device(), stream, mask, n, counts.data_ptr<int64_t>());
  return at::cumsum(counts, 0);
}

// The total of tile_ends: the one device-to-host sync, to size (or check) values.
int64_t kept_total(const at::Tensor& ends) { return ends[ends.numel() - 1].item<int64_t>(); }

}  // namespace

at::Tensor compact_cuda(const at::Tensor& y, const uint8_t* mask, at::Tensor& missed) {
  const c10::cuda::CUDAGuard guard(y.device());
  missed = at::zeros({}, y.options().dtype(at::kLong));
  const int64_t n = y.numel();
  if (n == 0) return at::empty({0}, y.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ends = tile_ends(mask, n, y, stream);
  at::Tensor values = at::empty({kept_total(ends)}, y.options());
  const bool vec = aligned16(y.const_data_ptr());
  dispatch_width(y, [&](auto u) {
    using U = decltype(u);
    const U* yp = static_cast<const U*>(y.const_data_ptr());
    U* vp = static_cast<U*>(values.data_ptr());  // null when nothing is kept: then never written
    auto* mp = reinterpret_cast<unsigned long long*>(missed.data_ptr<int64_t>());
    const auto kernel = vec ? compact_kernel<U, 16 / sizeof(U)> : compact_kernel<U, 1>;
    launch(kernel, (n + kTile - 1) / kTile * 32, y.get_device(), stream, yp, mask, ends.const_data_ptr<int64_t>(), n, vp, mp);
  });
  return values;
}

void expand_cuda(const at::Tensor& values, const uint8_t* mask, const at::Tensor& out) {
  const int64_t n = out.numel(), total = values.numel();
  if (n == 0) {
    TORCH_CHECK(total == 0, "relu_ext::expand: the mask keeps 0 elements but values has ", total);
    return;
  }
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ends = tile_ends(mask, n, out, stream);
  const int64_t kept = kept_total(ends);
  TORCH_CHECK(kept == total, "relu_ext::expand: the mask keeps ", kept, " elements but values has ", total);
  const bool vec = aligned16(out.data_ptr());
  dispatch_width(out, [&](auto u) {
    using U = decltype(u);
    const U* vp = static_cast<const U*>(values.const_data_ptr());
    U* op = static_cast<U*>(out.data_ptr());
    const auto kernel = vec ? expand_kernel<U, 16 / sizeof(U)> : expand_kernel<U, 1>;
    launch(kernel, (n + kTile - 1) / kTile * 32, out.get_device(), stream, vp, mask, ends.const_data_ptr<int64_t>(), n, op);
  });
}

void nonzero_mask_cuda(const at::Tensor& y, uint8_t* mask) {
  const int64_t n = y.numel();
  if (n == 0) return;
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(mask) % 4 == 0, "nonzero_mask_cuda stores 32-bit mask words");
  const c10::cuda::CUDAGuard guard(y.device());
  const bool vec = aligned16(y.const_data_ptr());
  dispatch_width(y, [&](auto u) {
    using U = decltype(u);
    launch_elementwise<U, true>(
        vec, n, y.get_device(), c10::cuda::getCurrentCUDAStream(),
        [](auto v, auto k) { return nonzero_kernel<U, decltype(v)::value, decltype(k)::value>; },
        static_cast<const U*>(y.const_data_ptr()), mask, n);
  });
}

void bn_act_cuda(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const at::Tensor& x2,
                 const at::Tensor& alpha2, const at::Tensor& beta2, const std::string& act, c10::ArrayRef<double> args,
                 const at::Tensor& y, const at::Tensor& differ) {
  const int64_t n = x.numel(), channels = x.size(1);
  if (n == 0) return;
  const int64_t inner = channels == 1 ? n : x.stride(1);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  with_act(act, [&](auto tag) {
    using Act = decltype(tag);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bn_act_cuda", [&] {
      using T = scalar_t;
      using M = OpMath<T>;
      const auto input = [](const at::Tensor& t, const at::Tensor& a, const at::Tensor& b) {
        return t.defined() ? BnInput<T>{t.const_data_ptr<T>(), a.const_data_ptr<M>(), b.const_data_ptr<M>()}
                           : BnInput<T>{nullptr, nullptr, nullptr};
      };
      const auto p = Act::template params<T, true>(act_args<Act>(act, args));
      // The check only reads y; the kernel's pointer is non-const for the rebuild.
      T* yp = const_cast<T*>(y.const_data_ptr<T>());
      int* dp = differ.defined() ? differ.data_ptr<int>() : nullptr;
      const auto go = [&](auto index) {
        using I = decltype(index);
        const auto kernel = dp != nullptr ? bn_act_kernel<Act, T, true, I> : bn_act_kernel<Act, T, false, I>;
        launch(kernel, n, x.get_device(), stream, input(x, alpha, beta), input(x2, alpha2, beta2), I(inner),
               I(channels), I(n), p, yp, dp);
      };
      n < (int64_t(1) << 31) ? go(uint32_t{}) : go(int64_t{});
    });
  });
}

int cuda_unroll() { return g_unroll.load(std::memory_order_relaxed); }

void set_cuda_unroll(int64_t rows) {
  TORCH_CHECK_VALUE(rows == 1 || rows == 2 || rows == 4, "relu_ext: set_cuda_unroll takes 1, 2 or 4 rows per warp, not ",
              rows);
  g_unroll.store(static_cast<int>(rows), std::memory_order_relaxed);
}

int cuda_waves() { return g_waves.load(std::memory_order_relaxed); }

void set_cuda_waves(int64_t waves) {
  TORCH_CHECK_VALUE(waves >= 0 && waves <= 64, "relu_ext: set_cuda_waves takes 0 (no cap) to 64 waves, not ", waves);
  g_waves.store(static_cast<int>(waves), std::memory_order_relaxed);
}

}  // namespace relu_ext
