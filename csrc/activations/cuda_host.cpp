// The activations' CUDA entry points on tensors (activations.h): device
// guard, current stream and alignment, then cuda.cu's launches.
#ifdef WITH_CUDA
#include "activations/cuda.h"
#include "core/cuda_launch.h"

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace relu_ext {

void forward_int_cuda(const at::Tensor& x, const at::Tensor& y) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  relu_int_launch(x.scalar_type(), n, x.get_device(), c10::cuda::getCurrentCUDAStream(), x.const_data_ptr(),
                  y.data_ptr());
}

template <typename Act>
void act_forward_cuda(const at::Tensor& x, const at::Tensor& y, uint8_t* mask, const ActArgs& args) {
  const int64_t n = x.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const bool vec = aligned16(x.const_data_ptr()) && aligned16(y.data_ptr());
  act_forward_launch<Act>(x.scalar_type(), vec, n, x.get_device(), c10::cuda::getCurrentCUDAStream(),
                          x.const_data_ptr(), y.data_ptr(), mask, args);
}

template <typename Act>
void act_backward_cuda(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in, const ActArgs& args) {
  const int64_t n = grad.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  const bool vec = aligned16(grad.const_data_ptr()) && aligned16(grad_in.data_ptr());
  act_backward_launch<Act>(grad.scalar_type(), vec, n, grad.get_device(), c10::cuda::getCurrentCUDAStream(),
                           grad.const_data_ptr(), mask, grad_in.data_ptr(), args);
}

#define RELU_EXT_INSTANTIATE(Act)                                                                          \
  template void act_forward_cuda<Act>(const at::Tensor&, const at::Tensor&, uint8_t*, const ActArgs&);   \
  template void act_backward_cuda<Act>(const at::Tensor&, const uint8_t*, const at::Tensor&, const ActArgs&);
RELU_EXT_ACTIVATIONS(RELU_EXT_INSTANTIATE)
#undef RELU_EXT_INSTANTIATE

}  // namespace relu_ext
#endif
