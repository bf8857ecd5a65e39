// save_compact's CUDA entry points on tensors (compact.h): device guard,
// current stream, alignment and the host's steps between kernels, then
// cuda.cu's launches.
#ifdef WITH_CUDA
#include "compact/compact.h"
#include "compact/cuda.h"
#include "core/cuda_launch.h"

#include <algorithm>

#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace relu_ext {

namespace {

// The inclusive sum of the kept elements of each tile of the mask (n > 0);
// compact and expand read where each tile's values start from it.
at::Tensor tile_ends(const uint8_t* mask, int64_t n, const at::Tensor& like, cudaStream_t stream) {
  const int64_t tiles = compact_tiles(n);
  at::Tensor counts = at::empty({tiles}, like.options().dtype(at::kLong));
  count_launch(n, like.get_device(), stream, mask, counts.data_ptr<int64_t>());
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
  const int64_t tiles = std::max<int64_t>(1, compact_tiles(n));
  TORCH_CHECK(ends.numel() == tiles, "relu_ext::compact_into: ends has ", ends.numel(),
              " entries but compact_count gives ", tiles, " for ", n, " elements");
  at::Tensor missed = at::full({}, n == 0 && values.numel() != 0 ? 1 : 0, y.options().dtype(at::kLong));
  if (n == 0) return missed;
  // values: null when nothing is kept, and then never written.
  compact_launch(y.element_size(), aligned16(y.const_data_ptr()), n, y.get_device(), c10::cuda::getCurrentCUDAStream(),
                 y.const_data_ptr(), mask, ends.const_data_ptr<int64_t>(), values.data_ptr(), values.numel(),
                 reinterpret_cast<unsigned long long*>(missed.data_ptr<int64_t>()));
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
  expand_launch(out.element_size(), aligned16(out.data_ptr()), n, out.get_device(), stream, values.const_data_ptr(),
                total, mask, ends.const_data_ptr<int64_t>(), out.data_ptr());
}

void nonzero_mask_cuda(const at::Tensor& y, uint8_t* mask) {
  const int64_t n = y.numel();
  if (n == 0) return;
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(mask) % 4 == 0, "nonzero_mask_cuda stores 32-bit mask words");
  const c10::cuda::CUDAGuard guard(y.device());
  nonzero_mask_launch(y.element_size(), aligned16(y.const_data_ptr()), n, y.get_device(),
                      c10::cuda::getCurrentCUDAStream(), y.const_data_ptr(), mask);
}

void bn_act_cuda(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const at::Tensor& x2,
                 const at::Tensor& alpha2, const at::Tensor& beta2, const std::string& act, c10::ArrayRef<double> args,
                 const at::Tensor& y, const at::Tensor& differ) {
  const int64_t n = x.numel(), channels = x.size(1);
  if (n == 0) return;
  const int64_t inner = channels == 1 ? n : x.stride(1);
  const c10::cuda::CUDAGuard guard(x.device());
  const auto data = [](const at::Tensor& t, const at::Tensor& a, const at::Tensor& b) {
    return t.defined() ? BnData{t.const_data_ptr(), a.const_data_ptr(), b.const_data_ptr()}
                       : BnData{nullptr, nullptr, nullptr};
  };
  // The check only reads y; the kernel's pointer is non-const for the rebuild.
  bn_act_launch(act, args, x.scalar_type(), data(x, alpha, beta), data(x2, alpha2, beta2), inner, channels, n,
                x.get_device(), c10::cuda::getCurrentCUDAStream(), const_cast<void*>(y.const_data_ptr()),
                differ.defined() ? differ.data_ptr<int>() : nullptr);
}

}  // namespace relu_ext
#endif
