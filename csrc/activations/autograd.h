// What the activations' ops (family.cpp), install() (install.cpp) and the
// Python module share: the backward node, the public kernels, and install's
// entry points.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/function.h>

#include <functional>
#include <string>
#include <vector>

#include "activations/activations.h"
#include "activations/layout.h"
#include "core/checks.h"

namespace relu_ext {

// The checks of a mask-reading backward op (family.cpp).
void check_backward_mask(const at::Tensor& grad, const at::Tensor& mask, const char* op);

// relu_ext's kernels for PyTorch's aten ops (install.cpp): install(ops)
// registers them for the named ops ("relu" and the family's names, see
// install_targets()) with the dispatcher, uninstall(ops) removes them; both
// are idempotent, counting is the Python layer's. installed(): the ops now taken.
std::vector<std::string> install_targets();
void install(const std::vector<std::string>& ops);
void uninstall(const std::vector<std::string>& ops);
std::vector<std::string> installed();
// The Python layer's answer to "must this call, recording a node under
// saved-tensor hooks, run PyTorch's kernel for `op`?" (activation
// checkpointing, see install.cpp), for an installed kernel or relu_ext's own
// op (`installed` false: asked only under a __torch_dispatch__ mode).
// Called with the GIL not held.
void set_recompute_probe(std::function<bool(const std::string&, bool)> probe);
bool torch_kernel_wanted(const at::Tensor& x, const std::string& op, bool installed);

// The backward node of the activations (family.cpp), one type per
// activation, named by its trait's kNode (ReluExtBackward0 for relu):
// grad_in from the mask alone and the op's Scalar arguments.
//   sizes_ / strides_: the forward output's shape, and the strides its mask
//     follows (an incoming gradient in another order is copied into it);
//   self_strides_: those of the tensor PyTorch's backward reads (the input,
//     or relu's output), which with the incoming gradient's give grad_in
//     PyTorch's layout (layout.h);
//   inplace_error_: the in-place op's backward PyTorch refuses (leaky_relu_
//     with a negative slope), raised when the node runs, as PyTorch raises it.
// Under create_graph=True, grad_in records another such node, differentiable
// in the incoming gradient and, with a zero derivative, in the tensor
// PyTorch's backward reads, as PyTorch's gradient is; reads_ says which
// tensor that is.
enum class Reads : uint8_t {
  kNothing,  // none: a node of relu_ext's own backward op, which has no PyTorch twin
  kInput,    // the forward's input (next edge 0)
  kOutput,   // the forward's output (this node's output 0)
  kEdge1,    // a node recorded under create_graph=True: the one behind its
             // second edge, which gets zeros
};

template <typename Act>
struct MaskBackward : public torch::autograd::TraceableFunction {
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override;
  std::string name() const override { return Act::kNode; }
  void release_variables() override;
  void compiled_args(torch::autograd::CompiledNodeArgs& args) const override;
  torch::autograd::variable_list apply_with_saved(const torch::autograd::variable_list& grads,
                                                  torch::autograd::SwapSavedVariables& saved) override;

  torch::autograd::SavedVariable mask_;
  std::vector<c10::SymInt> sizes_;
  std::vector<c10::SymInt> strides_;
  std::vector<c10::SymInt> self_strides_;
  ActArgs args_;
  bool inplace_error_ = false;
  Reads reads_ = Reads::kNothing;

  // The edge to the tensor PyTorch's backward reads (none for kNothing).
  torch::autograd::Edge read_edge();
};

// The activations' public kernels, for install.cpp: forward (CPU / CUDA keys)
// and autograd, with the op's Scalar arguments in an ActArgs.
template <typename Act>
at::Tensor act_kernel(const at::Tensor& x, const ActArgs& a);
template <typename Act>
void act_kernel_(at::Tensor& x, const ActArgs& a);
template <typename Act>
at::Tensor act_autograd(const at::Tensor& x, const ActArgs& a);
template <typename Act>
void act_autograd_(at::Tensor& x, const ActArgs& a);
// The public op `name` (relu_ext::<name> or <name>_ with `inplace`,
// which returns x) through the dispatcher: relu_ext's functions in eager mode.
at::Tensor act_call(const std::string& name, const at::Tensor& x, bool inplace, const ActArgs& a);

}  // namespace relu_ext
