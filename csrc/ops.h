// What the op registration (ops.cpp), the autograd kernels (autograd.cpp) and
// the Python module (module.cpp) share: typed handles to call the ops through
// the dispatcher, the mask's memory order, and the backward node.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "activations.h"
#include "layout.h"

namespace relu_ext {

// The save_compact ops (schema in ops.cpp; the activations' ops have their
// handles in family.cpp).
using CompactFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&);
using ExpandFn = at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef);
using NonzeroMaskFn = at::Tensor(const at::Tensor&);
using BinaryMaskFn = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&);
using BnTermsFn = std::tuple<at::Tensor, at::Tensor>(const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                                     const at::Tensor&, const at::Tensor&, bool, double, at::ScalarType);
using OptTensor = std::optional<at::Tensor>;
using BnActVerifyFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                 at::ArrayRef<double>, const at::Tensor&, const OptTensor&, const OptTensor&,
                                 const OptTensor&);
using BnActRebuildFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, c10::string_view,
                                  at::ArrayRef<double>, const OptTensor&, const OptTensor&, const OptTensor&);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

#define RELU_EXT_OP_HANDLE(fn, name, Sig)                          \
  inline const c10::TypedOperatorHandle<Sig>& fn() {              \
    static const auto handle = find_op<Sig>("relu_ext::" name);   \
    return handle;                                                \
  }
RELU_EXT_OP_HANDLE(compact_op, "compact", CompactFn)
RELU_EXT_OP_HANDLE(expand_op, "expand", ExpandFn)
RELU_EXT_OP_HANDLE(nonzero_mask_op, "nonzero_mask", NonzeroMaskFn)
RELU_EXT_OP_HANDLE(binary_mask_op, "binary_mask", BinaryMaskFn)
RELU_EXT_OP_HANDLE(binary_expand_op, "binary_expand", ExpandFn)
RELU_EXT_OP_HANDLE(bn_terms_op, "bn_terms", BnTermsFn)
RELU_EXT_OP_HANDLE(bn_act_verify_op, "bn_act_verify", BnActVerifyFn)
RELU_EXT_OP_HANDLE(bn_act_rebuild_op, "bn_act_rebuild", BnActRebuildFn)
#undef RELU_EXT_OP_HANDLE

// Layout and device checks, made where every call passes (the autograd
// kernels), so that a sparse or XPU tensor gets an error that says what is
// wrong rather than the dispatcher's "could not run ... with arguments from
// the ... backend".
void check_layout_and_device(const at::Tensor& t, const char* op, const char* arg);

// Whether relu_ext has kernels for x's kind of tensor: strided, not quantized,
// not nested, on CPU, CUDA or meta. The public ops (relu_ext::relu, ...) hand
// any other tensor (sparse, mkldnn, quantized, nested, another device) to
// PyTorch's aten op, so that it gets exactly what torch.relu etc. give.
bool has_kernel_for(const at::Tensor& x);
// float32/64, float16, bfloat16 and the integer types relu / relu_ take.
bool is_relu_dtype(at::ScalarType t);
// float32/64, float16, bfloat16: the dtypes the mask-writing ops take.
bool is_float(at::ScalarType t);

// Shared by the activations' ops (family.cpp): a mask for x (ceil(n / 8)
// bytes); the checks of a mask-reading backward op; and the error for a
// CUDA tensor in a build without CUDA kernels (instead of the dispatcher's
// generic "could not run ... with arguments from the 'CUDA' backend").
at::Tensor new_mask(const at::Tensor& x);
void check_backward_mask(const at::Tensor& grad, const at::Tensor& mask, const char* op);
[[noreturn]] void no_cuda_kernels(const std::string& op);

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

// torch 2.14 holds nodes in c10::intrusive_ptr, torch 2.11 in std::shared_ptr.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T>
NodePtr new_node() {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>();
  } else {
    // deleteNode frees long chains of nodes without deep recursion (found by ADL).
    return std::shared_ptr<T>(new T(), [](T* node) { deleteNode(node); });
  }
}

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
