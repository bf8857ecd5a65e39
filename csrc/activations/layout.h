// Memory layouts: the one relu_ext's kernels walk (the mask's order) and the
// ones PyTorch gives its outputs, so that every tensor relu_ext returns has
// PyTorch's strides, not only its values. Over c10::SymInt: the autograd
// node also runs while torch.compile traces with symbolic shapes (a
// comparison of symbolic strides then guards, as PyTorch's meta functions do).
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <vector>

namespace relu_ext {

using SymStrides = std::vector<c10::SymInt>;

// The strides TensorIterator gives the output of an element-wise op whose
// inputs, in the op's operand order, have shape `sizes` and these strides
// (ATen's TensorIterator.cpp: fast_set_up for all-contiguous, all
// channels-last or all dense with the same strides; else reorder_dimensions,
// where the first input that orders two dimensions decides, and
// allocate_or_resize_outputs). Which operand leads differs between ops
// (hardtanh_backward takes grad_output first, threshold_backward self).
SymStrides iterator_strides(c10::SymIntArrayRef sizes, std::initializer_list<c10::SymIntArrayRef> inputs);

// The strides PyTorch's backward of activation Act gives grad_in: iterator_strides over grad and the
// tensor that backward reads (`self`), in Act's operand order (kGradLeads, activations.h).
template <typename Act>
SymStrides grad_in_strides(c10::SymIntArrayRef sizes, c10::SymIntArrayRef grad, c10::SymIntArrayRef self) {
  return Act::kGradLeads ? iterator_strides(sizes, {grad, self}) : iterator_strides(sizes, {self, grad});
}

// A unary op's output on x, laid out as TensorIterator lays it out
// (iterator_strides with x alone), or with `like_input` as empty_like(x)
// (hardtanh allocates its output so); and its strides (for the fake kernels).
// Both walk memory in x's order, or, for a non-dense x, in its dense copy's.
at::Tensor new_output(const at::Tensor& x, bool like_input);
SymStrides output_strides(const at::Tensor& x, bool like_input);

// Whether two dense layouts of `sizes` put the elements in the same memory
// order (they differ at most in the strides of dimensions of size 1).
bool same_order(c10::SymIntArrayRef sizes, c10::SymIntArrayRef a, c10::SymIntArrayRef b);

// The dense layout an op on `x` walks, hence the order of its mask bits: x's
// own strides when x is dense, else the ones empty_like(x) picks.
SymStrides mask_strides(const at::Tensor& x);

// `t` itself when it is dense, else a dense copy laid out as empty_like(t).
at::Tensor dense(const at::Tensor& t);

// `t` with these sizes and strides (a vmapped sample: in that memory order): itself, or a copy (which also
// broadcasts, so that a node called by hand with a scalar gradient works as
// PyTorch's nodes do). Differentiable.
at::Tensor to_layout(const at::Tensor& t, c10::SymIntArrayRef sizes, c10::SymIntArrayRef strides);

}  // namespace relu_ext
