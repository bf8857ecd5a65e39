// What both subsystems share: typed handles to call ops through the
// dispatcher, the checks every op makes, and a new autograd node in the
// pointer this torch holds nodes in.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>

#include <string>
#include <type_traits>

namespace relu_ext {

template <typename Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// A function `fn` returning the typed handle of op relu_ext::<name>, found once.
#define RELU_EXT_OP_HANDLE(fn, name, Sig)                          \
  inline const c10::TypedOperatorHandle<Sig>& fn() {              \
    static const auto handle = find_op<Sig>("relu_ext::" name);   \
    return handle;                                                \
  }
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

// A mask for x: ceil(n / 8) bytes, one bit per element (core/bits.h).
at::Tensor new_mask(const at::Tensor& x);

// The error for a CUDA tensor in a build without CUDA kernels (instead of the
// dispatcher's generic "could not run ... with arguments from the 'CUDA' backend").
[[noreturn]] void no_cuda_kernels(const std::string& op);

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

}  // namespace relu_ext
