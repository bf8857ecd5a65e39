// Autograd, in C++ at the Autograd key, written as PyTorch writes its own
// (VariableType and the generated backward nodes): when no gradient and no
// tangent is needed, straight to the mask-free kernel; otherwise the
// mask-writing forward, a ReluExtBackward0 node holding only the mask, and the
// tangent masked the same way (forward-mode AD). relu / relu_ pass a tensor
// relu_ext has no kernel for (sparse, quantized, nested, ...) to aten::relu.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <type_traits>

#include "compiled.h"
#include "ops.h"

namespace relu_ext {

namespace ag = torch::autograd;
using ag::variable_list;

namespace {

// keep ? grad : +0, through the dispatcher above autograd: differentiable
// again in grad, which is what double backward and forward-over-reverse need.
at::Tensor masked(const at::Tensor& grad, const at::Tensor& mask, c10::SymIntArrayRef sizes,
                  c10::SymIntArrayRef strides) {
  return relu_bwd_op().call(to_mask_layout(grad, sizes, strides), mask);
}

variable_list apply_functional(variable_list&& grads, std::array<bool, 1> needs_input_grad, const at::Tensor& mask,
                               const std::vector<c10::SymInt>& sizes, const std::vector<c10::SymInt>& strides) {
  variable_list grad_inputs(1);
  if (needs_input_grad[0] && grads[0].defined()) grad_inputs[0] = masked(grads[0], mask, sizes, strides);
  return grad_inputs;
}

// The same, with its arguments packed, for compiled autograd to call.
variable_list apply_functional_ivalue(const variable_list& grads, const ag::ivalue_list& args) {
  auto packed = torch::dynamo::autograd::PackedArgs(args);
  const auto needs_input_grad = packed.unpack<std::array<bool, 1>>();
  const auto mask = packed.unpack<at::Tensor>();
  const auto sizes = packed.unpack<std::vector<c10::SymInt>>();
  const auto strides = packed.unpack<std::vector<c10::SymInt>>();
  return apply_functional(variable_list(grads), needs_input_grad, mask, sizes, strides);
}

NodePtr make_backward(const at::Tensor& input, const at::Tensor& mask, c10::SymIntArrayRef sizes,
                      std::vector<c10::SymInt> strides) {
  NodePtr node = new_node<ReluExtBackward0>();
  auto* fn = static_cast<ReluExtBackward0*>(node.get());
  fn->set_next_edges(ag::collect_next_edges(input));
  if (mask.defined()) fn->mask_ = ag::SavedVariable(mask, /*is_output=*/false);
  fn->sizes_ = sizes.vec();
  fn->strides_ = std::move(strides);
  return node;
}

// The training forward out of place: y with a node and/or a masked tangent.
std::tuple<at::Tensor, at::Tensor> differentiable_fwd(const at::Tensor& x, bool grad, bool tangent) {
  at::Tensor y, mask;
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    std::tie(y, mask) = relu_fwd_op().call(x);
  }
  auto strides = mask_strides(x);
  if (tangent) y._set_fw_grad(masked(x._fw_grad(0), mask, x.sym_sizes(), strides), 0, /*is_inplace_op=*/false);
  if (grad) ag::set_history(y, make_backward(x, mask, x.sym_sizes(), std::move(strides)));
  return {y, mask};
}

// The same in place: the node's edges are collected before x changes, and
// rebase_history makes x (or, for a view, its base) point at it.
at::Tensor differentiable_fwd_(at::Tensor& x, bool grad, bool tangent) {
  auto strides = mask_strides(x);
  NodePtr node = grad ? make_backward(x, at::Tensor(), x.sym_sizes(), strides) : NodePtr();
  at::Tensor mask;
  {
    const at::AutoDispatchBelowAutograd below;  // ADInplaceOrView still bumps the version
    mask = relu_fwd_inplace_op().call(x);
  }
  if (node) {
    static_cast<ReluExtBackward0*>(node.get())->mask_ = ag::SavedVariable(mask, /*is_output=*/false);
    ag::rebase_history(x, node);
  }
  if (tangent) {
    at::Tensor t = x._fw_grad(0);
    t.copy_(masked(t, mask, x.sym_sizes(), strides));
  }
  return mask;
}

}  // namespace

at::Tensor relu_autograd(const at::Tensor& x) {
  if (!has_kernel_for(x)) return at::relu(x);  // PyTorch's own: values, gradients and errors
  const bool grad = ag::compute_requires_grad(x);
  const bool tangent = ag::isFwGradDefined(x);
  if (!grad && !tangent) {
    const at::AutoDispatchBelowADInplaceOrView below;
    return relu_op().call(x);
  }
  return std::get<0>(differentiable_fwd(x, grad, tangent));
}

void relu_autograd_(at::Tensor& x) {
  if (!has_kernel_for(x)) {
    at::relu_(x);
    return;
  }
  const bool grad = ag::compute_requires_grad(x);
  const bool tangent = ag::isFwGradDefined(x);
  ag::check_inplace(x, grad);  // PyTorch's errors for a leaf, or a view of one, that requires grad
  if (!grad && !tangent) {
    const at::AutoDispatchBelowAutograd below;
    return relu_inplace_op().call(x);
  }
  differentiable_fwd_(x, grad, tangent);
}

namespace {

// The training pieces are differentiable too, so that no op of the library
// silently drops a gradient; the mask itself is not differentiable.
std::tuple<at::Tensor, at::Tensor> relu_fwd_autograd(const at::Tensor& x) {
  check_layout_and_device(x, "relu_ext::relu_fwd", "x");
  const bool grad = ag::compute_requires_grad(x);
  const bool tangent = ag::isFwGradDefined(x);
  if (!grad && !tangent) {
    const at::AutoDispatchBelowADInplaceOrView below;
    return relu_fwd_op().call(x);
  }
  return differentiable_fwd(x, grad, tangent);
}

at::Tensor relu_fwd_autograd_(at::Tensor& x) {
  check_layout_and_device(x, "relu_ext::relu_fwd_", "x");
  const bool grad = ag::compute_requires_grad(x);
  const bool tangent = ag::isFwGradDefined(x);
  ag::check_inplace(x, grad);
  if (!grad && !tangent) {
    const at::AutoDispatchBelowAutograd below;
    return relu_fwd_inplace_op().call(x);
  }
  return differentiable_fwd_(x, grad, tangent);
}

// relu_bwd is linear in grad, with the same mask: its backward (and its
// tangent) is relu_bwd again. grad arrives in mask order, so its own strides
// are the ones to keep.
at::Tensor relu_bwd_autograd(const at::Tensor& grad, const at::Tensor& mask) {
  check_layout_and_device(grad, "relu_ext::relu_bwd", "grad");
  const bool needs = ag::compute_requires_grad(grad);
  const bool tangent = ag::isFwGradDefined(grad);
  at::Tensor out;
  {
    const at::AutoDispatchBelowADInplaceOrView below;
    out = relu_bwd_op().call(grad, mask);
  }
  if (!needs && !tangent) return out;
  auto strides = mask_strides(grad);
  if (tangent) out._set_fw_grad(masked(grad._fw_grad(0), mask, grad.sym_sizes(), strides), 0, false);
  if (needs) ag::set_history(out, make_backward(grad, mask, grad.sym_sizes(), std::move(strides)));
  return out;
}

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

at::Tensor expand_autograd(const at::Tensor& values, const at::Tensor& mask, c10::SymIntArrayRef size,
                           c10::SymIntArrayRef stride) {
  check_not_differentiable(values, "relu_ext::expand", "values");
  check_layout_and_device(mask, "relu_ext::expand", "mask");
  const at::AutoDispatchBelowADInplaceOrView below;
  return expand_op().call(values, mask, size, stride);
}

at::Tensor nonzero_mask_autograd(const at::Tensor& y) {
  check_layout_and_device(y, "relu_ext::nonzero_mask", "y");
  const at::AutoDispatchBelowADInplaceOrView below;
  return nonzero_mask_op().call(y);
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
                                  c10::string_view act, at::ArrayRef<double> args, const at::Tensor& y) {
  using Arg = std::pair<const at::Tensor&, const char*>;
  for (const auto& [t, arg] : {Arg{x, "x"}, Arg{alpha, "alpha"}, Arg{beta, "beta"}, Arg{y, "y"}}) {
    check_not_differentiable(t, "relu_ext::bn_act_verify", arg);
  }
  const at::AutoDispatchBelowADInplaceOrView below;
  return bn_act_verify_op().call(x, alpha, beta, act, args, y);
}

at::Tensor bn_act_rebuild_autograd(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                                   c10::string_view act, at::ArrayRef<double> args) {
  using Arg = std::pair<const at::Tensor&, const char*>;
  for (const auto& [t, arg] : {Arg{x, "x"}, Arg{alpha, "alpha"}, Arg{beta, "beta"}}) {
    check_not_differentiable(t, "relu_ext::bn_act_rebuild", arg);
  }
  const at::AutoDispatchBelowADInplaceOrView below;
  return bn_act_rebuild_op().call(x, alpha, beta, act, args);
}

}  // namespace

variable_list ReluExtBackward0::apply(variable_list&& grads) {
  const std::lock_guard<std::mutex> lock(mutex_);
  const at::Tensor mask = mask_.unpack();  // raises PyTorch's error after the mask was released
  return apply_functional(std::move(grads), {task_should_compute_output(0)}, mask, sizes_, strides_);
}

void ReluExtBackward0::release_variables() {
  const std::lock_guard<std::mutex> lock(mutex_);
  mask_.reset_data();
}

void ReluExtBackward0::compiled_args(ag::CompiledNodeArgs& args) const {
  args.collect(mask_, /*is_output=*/false);
  args.collect(sizes_);
  args.collect(strides_);
}

variable_list ReluExtBackward0::apply_with_saved(const variable_list& grads, ag::SwapSavedVariables& saved) {
  static bool bound = false;
  return record_apply(*this, grads, saved, bound, apply_functional_ivalue, std::array<bool, 1>{task_should_compute_output(0)},
                      mask_, sizes_, strides_);
}

TORCH_LIBRARY_IMPL(relu_ext, Autograd, m) {
  m.impl("compact", &compact_autograd);
  m.impl("expand", &expand_autograd);
  m.impl("nonzero_mask", &nonzero_mask_autograd);  // a mask is not differentiable
  m.impl("bn_terms", &bn_terms_autograd);
  m.impl("bn_act_verify", &bn_act_verify_autograd);
  m.impl("bn_act_rebuild", &bn_act_rebuild_autograd);
  m.impl("relu", &relu_autograd);
  m.impl("relu_", &relu_autograd_);
  m.impl("relu_fwd", &relu_fwd_autograd);
  m.impl("relu_fwd_", &relu_fwd_autograd_);
  m.impl("relu_bwd", &relu_bwd_autograd);
}

}  // namespace relu_ext
