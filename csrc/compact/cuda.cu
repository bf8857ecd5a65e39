// save_compact's CUDA launchers: compaction and the BatchNorm replay, of the
// device code in kernels.cuh.
#include "compact/compact.h"
#include "compact/kernels.cuh"
#include "core/cuda_launch.cuh"

#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/Dispatch.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace relu_ext {

namespace {

// The inclusive sum of the kept elements of each tile of the mask (n > 0);
// compact and expand read where each tile's values start from it.
at::Tensor tile_ends(const uint8_t* mask, int64_t n, const at::Tensor& like, cudaStream_t stream) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  at::Tensor counts = at::empty({tiles}, like.options().dtype(at::kLong));
  launch(count_kernel, tiles * 32, like.get_device(), stream, mask, n, counts.data_ptr<int64_t>());
  return at::cumsum(counts, 0);
}

// The total of tile_ends, read on the host: a device-to-host sync (compact and
// a checked expand; save_compact's pack hook counts with compact_count and
// reads the total through its deferred result instead).
int64_t kept_total(const at::Tensor& ends) { return ends[ends.numel() - 1].item<int64_t>(); }

}  // namespace

at::Tensor compact_count_cuda(const at::Tensor& y, const uint8_t* mask) {
  const c10::cuda::CUDAGuard guard(y.device());
  if (y.numel() == 0) return at::zeros({1}, y.options().dtype(at::kLong));
  return tile_ends(mask, y.numel(), y, c10::cuda::getCurrentCUDAStream());
}

at::Tensor compact_into_cuda(const at::Tensor& y, const uint8_t* mask, const at::Tensor& ends, const at::Tensor& values) {
  const c10::cuda::CUDAGuard guard(y.device());
  const int64_t n = y.numel();
  const int64_t tiles = std::max<int64_t>(1, (n + kTile - 1) / kTile);
  TORCH_CHECK(ends.numel() == tiles, "relu_ext::compact_into: ends has ", ends.numel(),
              " entries but compact_count gives ", tiles, " for ", n, " elements");
  at::Tensor missed = at::full({}, n == 0 && values.numel() != 0 ? 1 : 0, y.options().dtype(at::kLong));
  if (n == 0) return missed;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = aligned16(y.const_data_ptr());
  dispatch_width(y, [&](auto u) {
    using U = decltype(u);
    const U* yp = static_cast<const U*>(y.const_data_ptr());
    U* vp = static_cast<U*>(values.data_ptr());  // null when nothing is kept: then never written
    auto* mp = reinterpret_cast<unsigned long long*>(missed.data_ptr<int64_t>());
    const auto kernel = vec ? compact_kernel<U, 16 / sizeof(U)> : compact_kernel<U, 1>;
    launch(kernel, (n + kTile - 1) / kTile * 32, y.get_device(), stream, yp, mask, ends.const_data_ptr<int64_t>(), n, vp,
           values.numel(), mp);
  });
  return missed;
}

at::Tensor compact_cuda(const at::Tensor& y, const uint8_t* mask, at::Tensor& missed) {
  const c10::cuda::CUDAGuard guard(y.device());
  if (y.numel() == 0) {
    missed = at::zeros({}, y.options().dtype(at::kLong));
    return at::empty({0}, y.options());
  }
  const at::Tensor ends = compact_count_cuda(y, mask);
  at::Tensor values = at::empty({kept_total(ends)}, y.options());
  missed = compact_into_cuda(y, mask, ends, values);
  return values;
}

void expand_cuda(const at::Tensor& values, const uint8_t* mask, const at::Tensor& out, bool check) {
  const int64_t n = out.numel(), total = values.numel();
  if (n == 0) {
    TORCH_CHECK(total == 0, "relu_ext::expand: the mask keeps 0 elements but values has ", total);
    return;
  }
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor ends = tile_ends(mask, n, out, stream);
  if (check) {
    const int64_t kept = kept_total(ends);
    TORCH_CHECK(kept == total, "relu_ext::expand: the mask keeps ", kept, " elements but values has ", total);
  }
  const bool vec = aligned16(out.data_ptr());
  dispatch_width(out, [&](auto u) {
    using U = decltype(u);
    const U* vp = static_cast<const U*>(values.const_data_ptr());
    U* op = static_cast<U*>(out.data_ptr());
    const auto kernel = vec ? expand_kernel<U, 16 / sizeof(U)> : expand_kernel<U, 1>;
    launch(kernel, (n + kTile - 1) / kTile * 32, out.get_device(), stream, vp, total, mask, ends.const_data_ptr<int64_t>(),
           n, op);
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
        launch(bn_act_kernel<Act, T, I>, n, x.get_device(), stream, input(x, alpha, beta), input(x2, alpha2, beta2), I(inner),
               I(channels), I(n), p, yp, dp);
      };
      n < (int64_t(1) << 31) ? go(uint32_t{}) : go(int64_t{});
    });
  });
}

}  // namespace relu_ext
