// save_compact's CUDA launches (compaction and the BatchNorm replay) of the
// device code in kernels.cuh, on raw pointers (cuda.h); their entry points on
// tensors are cuda_host.cpp's.
#include "compact/cuda.h"
#include "compact/kernels.cuh"
#include "core/cuda_launch.cuh"

#include <ATen/Dispatch.h>

namespace relu_ext {

int64_t compact_tiles(int64_t n) { return (n + kTile - 1) / kTile; }

void count_launch(int64_t n, int device, cudaStream_t stream, const uint8_t* mask, int64_t* counts) {
  launch(count_kernel, compact_tiles(n) * 32, device, stream, mask, n, counts);
}

void compact_launch(int64_t width, bool vec, int64_t n, int device, cudaStream_t stream, const void* y,
                    const uint8_t* mask, const int64_t* ends, void* values, int64_t total, unsigned long long* missed) {
  dispatch_width(width, [&](auto u) {
    using U = decltype(u);
    const auto kernel = vec ? compact_kernel<U, 16 / sizeof(U)> : compact_kernel<U, 1>;
    launch(kernel, compact_tiles(n) * 32, device, stream, static_cast<const U*>(y), mask, ends, n,
           static_cast<U*>(values), total, missed);
  });
}

void expand_launch(int64_t width, bool vec, int64_t n, int device, cudaStream_t stream, const void* values,
                   int64_t total, const uint8_t* mask, const int64_t* ends, void* out) {
  dispatch_width(width, [&](auto u) {
    using U = decltype(u);
    const auto kernel = vec ? expand_kernel<U, 16 / sizeof(U)> : expand_kernel<U, 1>;
    launch(kernel, compact_tiles(n) * 32, device, stream, static_cast<const U*>(values), total, mask, ends, n,
           static_cast<U*>(out));
  });
}

void nonzero_mask_launch(int64_t width, bool vec, int64_t n, int device, cudaStream_t stream, const void* y,
                         uint8_t* mask) {
  dispatch_width(width, [&](auto u) {
    using U = decltype(u);
    launch_elementwise<U, true>(
        vec, n, device, stream, [](auto v, auto k) { return nonzero_kernel<U, decltype(v)::value, decltype(k)::value>; },
        static_cast<const U*>(y), mask, n);
  });
}

void bn_act_launch(const std::string& act, c10::ArrayRef<double> args, c10::ScalarType dtype, BnData in, BnData in2,
                   int64_t inner, int64_t channels, int64_t n, int device, cudaStream_t stream, void* y, int* differ) {
  with_act(act, [&](auto tag) {
    using Act = decltype(tag);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "bn_act_cuda", [&] {
      using T = scalar_t;
      using M = OpMath<T>;
      const auto input = [](const BnData& d) {  // (null pointers stay null: no second input)
        return BnInput<T>{static_cast<const T*>(d.x), static_cast<const M*>(d.alpha), static_cast<const M*>(d.beta)};
      };
      const auto p = Act::template params<T, true>(act_args<Act>(act, args));
      const auto go = [&](auto index) {
        using I = decltype(index);
        launch(bn_act_kernel<Act, T, I>, n, device, stream, input(in), input(in2), I(inner), I(channels), I(n), p,
               static_cast<T*>(y), differ);
      };
      n < (int64_t(1) << 31) ? go(uint32_t{}) : go(int64_t{});
    });
  });
}

}  // namespace relu_ext
