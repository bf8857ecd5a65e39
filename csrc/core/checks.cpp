// The checks both subsystems' ops make (checks.h).
#include "core/checks.h"

#include <ATen/core/Tensor.h>

namespace relu_ext {

void check_layout_and_device(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, " has layout ", t.layout(),
              "; relu_ext supports strided (dense) tensors only");
  const auto dev = t.device().type();
  TORCH_CHECK(dev == at::kCPU || dev == at::kCUDA || dev == at::kMeta, op, ": ", arg, " is on ", t.device(),
              "; relu_ext has kernels for CPU and CUDA tensors only");
}

bool has_kernel_for(const at::Tensor& x) {
  const auto dev = x.device().type();
  return x.layout() == at::kStrided && !x.is_quantized() && !x.is_nested() &&
         (dev == at::kCPU || dev == at::kCUDA || dev == at::kMeta);
}

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

bool is_relu_dtype(at::ScalarType t) {
  return is_float(t) || t == at::kByte || t == at::kChar || t == at::kShort || t == at::kInt || t == at::kLong;
}

void no_cuda_kernels(const std::string& op) {
  TORCH_CHECK(false, op,
              ": input is on CUDA, but this relu_ext build has CPU kernels only (torch without CUDA, no nvcc "
              "at build time, or RELU_EXT_FORCE_CPU=1); rebuild relu_ext where nvcc is available");
}

at::Tensor new_mask(const at::Tensor& x) {
  return at::empty({(x.numel() + 7) / 8}, x.options().dtype(at::kByte));
}

}  // namespace relu_ext
