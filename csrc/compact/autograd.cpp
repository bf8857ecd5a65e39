// The Autograd kernels of the save_compact ops (compaction and the BatchNorm
// replay): they store and rebuild saved tensors, so they are not
// differentiable, and say so for an input that requires grad. (The
// activations' autograd kernels and backward node are family.cpp's.)
#include <ATen/ATen.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include "compact/compact.h"
#include "core/checks.h"

namespace relu_ext {

namespace ag = torch::autograd;

namespace {

// The compaction ops store and restore saved tensors: not differentiable. The
// layout / device check comes first, so that a sparse tensor is named as such.
void check_not_differentiable(const at::Tensor& t, const char* op, const char* arg) {
  check_layout_and_device(t, op, arg);
  TORCH_CHECK(!ag::compute_requires_grad(t), op, ": ", arg,
              " requires grad, but compaction is not differentiable (it stores tensors saved for backward); "
              "pass a detached tensor");
}

std::tuple<at::Tensor, at::Tensor> compact_autograd(const at::Tensor& y, const at::Tensor& mask) {
  check_not_differentiable(y, "relu_ext::compact", "y");
  check_layout_and_device(mask, "relu_ext::compact", "mask");
  const at::AutoDispatchBelowADInplaceOrView below;
  return compact_op().call(y, mask);
}

at::Tensor compact_count_autograd(const at::Tensor& y, const at::Tensor& mask) {
  check_layout_and_device(y, "relu_ext::compact_count", "y");  // (reads only the mask's bits: a count)
  check_layout_and_device(mask, "relu_ext::compact_count", "mask");
  const at::AutoDispatchBelowADInplaceOrView below;
  return compact_count_op().call(y, mask);
}

at::Tensor compact_into_autograd(const at::Tensor& y, const at::Tensor& mask, const at::Tensor& ends,
                                 const at::Tensor& values) {
  check_not_differentiable(y, "relu_ext::compact_into", "y");
  check_not_differentiable(values, "relu_ext::compact_into", "values");
  check_layout_and_device(mask, "relu_ext::compact_into", "mask");
  check_layout_and_device(ends, "relu_ext::compact_into", "ends");
  at::Tensor missed;
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    missed = compact_into_op().call(y, mask, ends, values);
  }
  ag::increment_version(values);  // (written in place)
  return missed;
}

at::Tensor expand_autograd(const at::Tensor& values, const at::Tensor& mask, c10::SymIntArrayRef size,
                           c10::SymIntArrayRef stride, bool check) {
  check_not_differentiable(values, "relu_ext::expand", "values");
  check_layout_and_device(mask, "relu_ext::expand", "mask");
  const at::AutoDispatchBelowADInplaceOrView below;
  return expand_op().call(values, mask, size, stride, check);
}

at::Tensor nonzero_mask_autograd(const at::Tensor& y) {
  check_layout_and_device(y, "relu_ext::nonzero_mask", "y");
  const at::AutoDispatchBelowADInplaceOrView below;
  return nonzero_mask_op().call(y);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> binary_mask_autograd(const at::Tensor& y) {
  check_not_differentiable(y, "relu_ext::binary_mask", "y");
  const at::AutoDispatchBelowADInplaceOrView below;
  return binary_mask_op().call(y);
}

at::Tensor binary_expand_autograd(const at::Tensor& mask, const at::Tensor& value, c10::SymIntArrayRef size,
                                  c10::SymIntArrayRef stride) {
  check_not_differentiable(value, "relu_ext::binary_expand", "value");
  check_layout_and_device(mask, "relu_ext::binary_expand", "mask");
  const at::AutoDispatchBelowADInplaceOrView below;
  return binary_expand_op().call(mask, value, size, stride);
}

// The replay ops rebuild saved tensors: not differentiable either.
std::tuple<at::Tensor, at::Tensor> bn_terms_autograd(const std::optional<at::Tensor>& weight,
                                                     const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                                     const at::Tensor& var, bool training, double eps,
                                                     at::ScalarType dtype) {
  using Arg = std::pair<std::optional<at::Tensor>, const char*>;
  for (const auto& [t, arg] : {Arg{mean, "mean"}, Arg{var, "var"}, Arg{weight, "weight"}, Arg{bias, "bias"}}) {
    if (t) check_not_differentiable(*t, "relu_ext::bn_terms", arg);
  }
  const at::AutoDispatchBelowADInplaceOrView below;
  return bn_terms_op().call(weight, bias, mean, var, training, eps, dtype);
}

at::Tensor bn_act_verify_autograd(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                                  c10::string_view act, at::ArrayRef<double> args, const at::Tensor& y,
                                  const OptTensor& x2, const OptTensor& alpha2, const OptTensor& beta2) {
  using Arg = std::pair<const at::Tensor*, const char*>;
  for (const auto& [t, arg] : {Arg{&x, "x"}, Arg{&alpha, "alpha"}, Arg{&beta, "beta"}, Arg{&y, "y"},
                               Arg{x2 ? &*x2 : nullptr, "x2"}, Arg{alpha2 ? &*alpha2 : nullptr, "alpha2"},
                               Arg{beta2 ? &*beta2 : nullptr, "beta2"}}) {
    if (t) check_not_differentiable(*t, "relu_ext::bn_act_verify", arg);
  }
  const at::AutoDispatchBelowADInplaceOrView below;
  return bn_act_verify_op().call(x, alpha, beta, act, args, y, x2, alpha2, beta2);
}

at::Tensor bn_act_rebuild_autograd(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                                   c10::string_view act, at::ArrayRef<double> args, const OptTensor& x2,
                                   const OptTensor& alpha2, const OptTensor& beta2) {
  using Arg = std::pair<const at::Tensor*, const char*>;
  for (const auto& [t, arg] : {Arg{&x, "x"}, Arg{&alpha, "alpha"}, Arg{&beta, "beta"}, Arg{x2 ? &*x2 : nullptr, "x2"},
                               Arg{alpha2 ? &*alpha2 : nullptr, "alpha2"}, Arg{beta2 ? &*beta2 : nullptr, "beta2"}}) {
    if (t) check_not_differentiable(*t, "relu_ext::bn_act_rebuild", arg);
  }
  const at::AutoDispatchBelowADInplaceOrView below;
  return bn_act_rebuild_op().call(x, alpha, beta, act, args, x2, alpha2, beta2);
}

}  // namespace

TORCH_LIBRARY_IMPL(relu_ext, Autograd, m) {
  m.impl("compact", &compact_autograd);
  m.impl("compact_count", &compact_count_autograd);
  m.impl("compact_into", &compact_into_autograd);
  m.impl("expand", &expand_autograd);
  m.impl("nonzero_mask", &nonzero_mask_autograd);  // a mask is not differentiable
  m.impl("binary_mask", &binary_mask_autograd);
  m.impl("binary_expand", &binary_expand_autograd);
  m.impl("bn_terms", &bn_terms_autograd);
  m.impl("bn_act_verify", &bn_act_verify_autograd);
  m.impl("bn_act_rebuild", &bn_act_rebuild_autograd);
}

}  // namespace relu_ext
