#include "activations/layout.h"

#include <algorithm>

#include <ATen/core/Tensor.h>
#include <ATen/ExpandUtils.h>

#include <numeric>
#include <utility>

namespace relu_ext {
namespace {

// c10's contiguity rules (Contiguity.h), over SymInt.
bool contiguous(c10::SymIntArrayRef sizes, c10::SymIntArrayRef strides) {
  c10::SymInt expected = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    if (sizes[d] == 0) return true;
  }
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

bool channels_last(c10::SymIntArrayRef sizes, c10::SymIntArrayRef strides) {
  if (sizes.size() != 4) return false;
  c10::SymInt expected = 1;
  for (const int d : {1, 3, 2, 0}) {
    if (sizes[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

bool non_overlapping_and_dense(c10::SymIntArrayRef sizes, c10::SymIntArrayRef strides) {
  if (contiguous(sizes, strides) || channels_last(sizes, strides)) return true;
  std::vector<size_t> perm(sizes.size());
  std::iota(perm.begin(), perm.end(), 0);
  // Dimensions of size 0 or 1 last, the rest by stride.
  std::sort(perm.begin(), perm.end(), [&](size_t a, size_t b) {
    if (sizes[a] < 2) return false;
    if (sizes[b] < 2) return true;
    return strides[a] < strides[b];
  });
  c10::SymInt expected = 1;
  for (const size_t d : perm) {
    if (sizes[d] < 2) return true;
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

SymStrides contiguous_strides(c10::SymIntArrayRef sizes) {
  SymStrides s(sizes.size());
  c10::SymInt next = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    s[d] = next;
    next *= sizes[d] > 1 ? sizes[d] : c10::SymInt(1);
  }
  return s;
}

SymStrides channels_last_strides(c10::SymIntArrayRef sizes) {
  SymStrides s(4);
  s[1] = 1;
  s[3] = sizes[1];
  s[2] = s[3] * sizes[3];
  s[0] = s[2] * sizes[2];
  return s;
}

}  // namespace

SymStrides iterator_strides(c10::SymIntArrayRef sizes, std::initializer_list<c10::SymIntArrayRef> inputs) {
  // fast_set_up
  bool all_contiguous = true, all_channels_last = true, all_dense_alike = true;
  for (const auto& s : inputs) {
    all_contiguous = all_contiguous && contiguous(sizes, s);
    all_channels_last = all_channels_last && channels_last(sizes, s);
    all_dense_alike = all_dense_alike && non_overlapping_and_dense(sizes, s) && s == *inputs.begin();
  }
  if (all_contiguous) return contiguous_strides(sizes);
  if (all_channels_last) return channels_last_strides(sizes);
  if (all_dense_alike) return inputs.begin()->vec();

  // reorder_dimensions: perm[0] is the fastest-moving dimension.
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  if (ndim <= 1) return contiguous_strides(sizes);
  std::vector<int64_t> perm(ndim);
  std::iota(perm.rbegin(), perm.rend(), 0);
  // 1: dim0 goes after dim1, -1: before, 0: no input says.
  auto should_swap = [&](int64_t dim0, int64_t dim1) {
    for (const auto& s : inputs) {
      const c10::SymInt& s0 = s[dim0];
      const c10::SymInt& s1 = s[dim1];
      if (s0 == 0 || s1 == 0) continue;  // a broadcast dimension orders nothing
      if (s0 < s1) return -1;
      if (s1 < s0) return 1;
      if (sizes[dim1] < sizes[dim0]) return 1;  // equal strides: the smaller size first
    }
    return 0;
  };
  for (int64_t i = 1; i < ndim; ++i) {  // insertion sort that allows ambiguous pairs
    int64_t dim1 = i;
    for (int64_t dim0 = i - 1; dim0 >= 0; --dim0) {
      const int comparison = should_swap(perm[dim0], perm[dim1]);
      if (comparison > 0) {
        std::swap(perm[dim0], perm[dim1]);
        dim1 = dim0;
      } else if (comparison < 0) {
        break;
      }
    }
  }
  bool inverted = true;  // the plain order: a contiguous output
  for (int64_t j = 0; j < ndim; ++j) inverted = inverted && perm[j] == ndim - j - 1;
  if (inverted) return contiguous_strides(sizes);
  // allocate_or_resize_outputs: dense in the order found.
  SymStrides out(ndim);
  c10::SymInt next = 1;
  for (const int64_t d : perm) {
    out[d] = next;
    next *= sizes[d];
  }
  return out;
}

at::Tensor new_output(const at::Tensor& x, bool like_input) {
  if (!like_input && x.is_contiguous()) return at::empty_symint(x.sym_sizes(), x.options());
  if (!like_input && x.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return at::empty_symint(x.sym_sizes(), x.options().memory_format(at::MemoryFormat::ChannelsLast));
  }
  return at::empty_like(x);  // x's strides when dense, else its order, as TensorIterator's
}

SymStrides output_strides(const at::Tensor& x, bool like_input) {
  if (!like_input && x.is_contiguous()) return contiguous_strides(x.sym_sizes());
  if (!like_input && x.is_contiguous(at::MemoryFormat::ChannelsLast)) return channels_last_strides(x.sym_sizes());
  return mask_strides(x);  // a non-dense x: TensorIterator orders its dimensions as empty_like does
}

bool same_order(c10::SymIntArrayRef sizes, c10::SymIntArrayRef a, c10::SymIntArrayRef b) {
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return true;
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] != 1 && a[d] != b[d]) return false;
  }
  return true;
}

SymStrides mask_strides(const at::Tensor& x) {
  if (x.is_non_overlapping_and_dense()) return x.sym_strides().vec();
  if (!x.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    const auto s = at::infer_dense_strides(x.sizes(), x.strides());  // what empty_like(x) uses
    return {s.begin(), s.end()};
  }
  return at::empty_like(x).sym_strides().vec();  // symbolic shapes: a fake tensor, nothing allocated
}

at::Tensor dense(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() ? t : at::empty_like(t).copy_(t);
}

at::Tensor to_layout(const at::Tensor& t, c10::SymIntArrayRef sizes, c10::SymIntArrayRef strides) {
  if (t.sym_sizes() == sizes && t.sym_strides() == strides) return t;
  // Under vmap a sample's strides are its view into the batch (not dense where the batch dimension is
  // not the first): kept where they walk memory in the order asked for, and the vmap rule lays out the
  // batch as PyTorch's batch rule does (registrations.py), as it would not from a batch-first copy.
  if (t.sym_sizes() == sizes && t.key_set().has(c10::DispatchKey::FuncTorchBatched) &&
      same_order(sizes, mask_strides(t), strides)) {
    return t;
  }
  return t.new_empty_strided_symint(sizes, strides).copy_(t);
}

}  // namespace relu_ext
