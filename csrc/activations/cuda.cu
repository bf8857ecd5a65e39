// The activations' CUDA launchers (grid, stream, device, unroll and dtype
// choice) of the device code in kernels.cuh.
#include "activations/kernels.cuh"
#include "core/cuda_launch.cuh"

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace relu_ext {

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

}  // namespace relu_ext
