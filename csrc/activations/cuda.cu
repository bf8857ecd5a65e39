// The activations' CUDA launches (grid, unroll and dtype choice) of the device
// code in kernels.cuh, on raw pointers (cuda.h); their entry points on
// tensors are cuda_host.cpp's.
#include "activations/cuda.h"
#include "activations/kernels.cuh"
#include "core/cuda_launch.cuh"

#include <ATen/Dispatch.h>

namespace relu_ext {

template <>
void act_forward_launch<Relu>(c10::ScalarType dtype, bool vec, int64_t n, int device, cudaStream_t stream,
                              const void* x, void* y, uint8_t* mask, const ActArgs&) {
  dispatch_bits(dtype, [&](auto fmt) {
    using U = typename decltype(fmt)::U;
    launch_elementwise<U, true>(
        vec, n, device, stream,
        [](auto v, auto k) { return fwd_kernel<U, decltype(fmt)::kInf, decltype(v)::value, decltype(k)::value>; },
        static_cast<const U*>(x), static_cast<U*>(y), mask, n);
  });
}

void relu_int_launch(c10::ScalarType dtype, int64_t n, int device, cudaStream_t stream, const void* x, void* y) {
  AT_DISPATCH_INTEGRAL_TYPES(dtype, "relu_ext_int", [&] {
    launch(int_kernel<scalar_t>, n, device, stream, static_cast<const scalar_t*>(x), static_cast<scalar_t*>(y), n);
  });
}

template <>
void act_backward_launch<Relu>(c10::ScalarType dtype, bool vec, int64_t n, int device, cudaStream_t stream,
                               const void* grad, const uint8_t* mask, void* grad_in, const ActArgs&) {
  dispatch_bits(dtype, [&](auto fmt) {
    using U = typename decltype(fmt)::U;
    launch_elementwise<U, true>(
        vec, n, device, stream, [](auto v, auto k) { return bwd_kernel<U, decltype(v)::value, decltype(k)::value>; },
        static_cast<const U*>(grad), mask, static_cast<U*>(grad_in), n);
  });
}

// The family's kernels are compiled with the default unroll only (set_cuda_unroll
// tunes ReLU's): 4 activations x 4 dtypes x 3 unrolls x 7 GPU architectures
// would triple the CUDA build time.
template <typename Act>
void act_forward_launch(c10::ScalarType dtype, bool vec, int64_t n, int device, cudaStream_t stream, const void* x,
                        void* y, uint8_t* mask, const ActArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, Act::kName, [&] {
    launch_elementwise<scalar_t, false>(
        vec, n, device, stream,
        [](auto v, auto k) { return act_fwd_kernel<Act, scalar_t, decltype(v)::value, decltype(k)::value>; },
        static_cast<const scalar_t*>(x), static_cast<scalar_t*>(y), mask, n, Act::template params<scalar_t, true>(args));
  });
}

template <typename Act>
void act_backward_launch(c10::ScalarType dtype, bool vec, int64_t n, int device, cudaStream_t stream,
                         const void* grad, const uint8_t* mask, void* grad_in, const ActArgs& args) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, Act::kName, [&] {
    launch_elementwise<scalar_t, false>(
        vec, n, device, stream,
        [](auto v, auto k) { return act_bwd_kernel<Act, scalar_t, decltype(v)::value, decltype(k)::value>; },
        static_cast<const scalar_t*>(grad), mask, static_cast<scalar_t*>(grad_in), n,
        Act::template params<scalar_t, true>(args));
  });
}

#define RELU_EXT_INSTANTIATE(Act)                                                                                   \
  template void act_forward_launch<Act>(c10::ScalarType, bool, int64_t, int, cudaStream_t, const void*, void*,     \
                                        uint8_t*, const ActArgs&);                                                  \
  template void act_backward_launch<Act>(c10::ScalarType, bool, int64_t, int, cudaStream_t, const void*,           \
                                         const uint8_t*, void*, const ActArgs&);
RELU_EXT_FAMILY(RELU_EXT_INSTANTIATE)
#undef RELU_EXT_INSTANTIATE

}  // namespace relu_ext
