// The save_compact ops: compaction and the BatchNorm replay, schema and CPU /
// CUDA wrappers (their autograd kernels: autograd.cpp). (vmap rules are in
// Python, src/relu_ext/registrations.py: functorch's C++ headers need a JSON
// library that torch does not ship.)
#include "compact/compact.h"

#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/TensorUtils.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include "core/bits.h"
#include "core/checks.h"

namespace relu_ext {

// --- Compaction (save_compact) ---------------------------------------------------

void check_compactable(const at::Tensor& t, const char* op, const char* arg) {
  check_layout_and_device(t, op, arg);
  TORCH_CHECK(is_float(t.scalar_type()), op, ": ", arg, " has dtype ", t.scalar_type(),
              "; compaction takes float32, float64, float16 and bfloat16");
  TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": ", arg,
              " must be dense (its elements fill a block of memory once, in any dimension order)");
}

void check_compaction_mask(const at::Tensor& mask, const at::Tensor& t, const char* op) {
  TORCH_CHECK(mask.device() == t.device(), op, ": mask is on ", mask.device(), " but the tensor is on ", t.device());
  TORCH_CHECK(mask.scalar_type() == at::kByte, op, ": mask has dtype ", mask.scalar_type(), "; expected uint8");
  const int64_t need = (t.numel() + 7) / 8;
  TORCH_CHECK(mask.dim() == 1 && mask.numel() == need && mask.is_contiguous(), op, ": mask has shape ", mask.sizes(),
              " but the tensor has ", t.numel(), " elements, which need a contiguous 1-D mask of ", need, " bytes");
}

namespace {

// The CPU kernels are compact_cpu.cpp's, the CUDA ones cuda_host.cpp's.
std::tuple<at::Tensor, at::Tensor> compact(const at::Tensor& y, const at::Tensor& mask) {
  check_compactable(y, "relu_ext::compact", "y");
  check_compaction_mask(mask, y, "relu_ext::compact");
#ifdef WITH_CUDA
  if (y.is_cuda()) {
    at::Tensor missed;
    at::Tensor values = compact_cuda(y, mask.const_data_ptr<uint8_t>(), missed);
    return {values, missed};
  }
#endif
  int64_t missed = 0;
  at::Tensor values = compact_cpu(y, mask.const_data_ptr<uint8_t>(), &missed);
  return {values, at::scalar_tensor(missed, y.options().dtype(at::kLong))};
}

// The two steps of compact without a host sync between them (see compact.h).
at::Tensor compact_count(const at::Tensor& y, const at::Tensor& mask) {
  check_compactable(y, "relu_ext::compact_count", "y");
  check_compaction_mask(mask, y, "relu_ext::compact_count");
#ifdef WITH_CUDA
  if (y.is_cuda()) return compact_count_cuda(y, mask.const_data_ptr<uint8_t>());
#endif
  return at::full({1}, kept_count_cpu(mask.const_data_ptr<uint8_t>(), y.numel()), y.options().dtype(at::kLong));
}

at::Tensor compact_into(const at::Tensor& y, const at::Tensor& mask, const at::Tensor& ends, const at::Tensor& values) {
  const char* op = "relu_ext::compact_into";
  check_compactable(y, op, "y");
  check_compaction_mask(mask, y, op);
  TORCH_CHECK(values.device() == y.device() && values.scalar_type() == y.scalar_type(), op, ": values is ",
              values.scalar_type(), " on ", values.device(), " but y is ", y.scalar_type(), " on ", y.device());
  TORCH_CHECK(values.dim() == 1 && values.is_contiguous(), op, ": values must be 1-D and contiguous, got shape ",
              values.sizes(), " and stride ", values.strides());
  TORCH_CHECK(at::has_internal_overlap(values) == at::MemOverlap::No &&
                  at::get_overlap_status(values, y) == at::MemOverlapStatus::No,
              op, ": values must not overlap y");
  TORCH_CHECK(ends.device() == y.device() && ends.scalar_type() == at::kLong && ends.dim() == 1 && ends.is_contiguous(),
              op, ": ends must be compact_count's (1-D int64 on y's device), got ", ends.scalar_type(), " of shape ",
              ends.sizes(), " on ", ends.device());
#ifdef WITH_CUDA
  if (y.is_cuda()) return compact_into_cuda(y, mask.const_data_ptr<uint8_t>(), ends, values);
#endif
  TORCH_CHECK(ends.numel() == 1, op, ": ends has ", ends.numel(), " entries but compact_count gives 1 on the CPU");
  return at::scalar_tensor(compact_into_cpu(y, mask.const_data_ptr<uint8_t>(), values), y.options().dtype(at::kLong));
}

at::Tensor expand(const at::Tensor& values, const at::Tensor& mask, c10::SymIntArrayRef size,
                  c10::SymIntArrayRef stride, bool check) {
  check_compactable(values, "relu_ext::expand", "values");
  TORCH_CHECK(values.dim() == 1, "relu_ext::expand: values must be 1-D, got shape ", values.sizes());
  at::Tensor out = at::empty_strided_symint(size, stride, values.options());
  TORCH_CHECK(out.is_non_overlapping_and_dense(), "relu_ext::expand: size ", out.sizes(), " and stride ",
              out.strides(), " are not a dense layout");
  check_compaction_mask(mask, out, "relu_ext::expand");
#ifdef WITH_CUDA
  if (out.is_cuda()) {
    expand_cuda(values, mask.const_data_ptr<uint8_t>(), out, check);
    return out;
  }
#endif
  expand_cpu(values, mask.const_data_ptr<uint8_t>(), out);  // (checked always: the count is on the host)
  return out;
}

at::Tensor nonzero_mask(const at::Tensor& y) {
  check_compactable(y, "relu_ext::nonzero_mask", "y");
  at::Tensor mask = new_mask(y);
#ifdef WITH_CUDA
  if (y.is_cuda()) {
    nonzero_mask_cuda(y, mask.data_ptr<uint8_t>());
    return mask;
  }
#endif
  nonzero_mask_cpu(y, mask.data_ptr<uint8_t>());
  return mask;
}

// A tensor of +0 and one other bit pattern (save_compact's TwoValued). CPU
// kernels only so far: CUDA's dropout keeps a bool mask, not such a tensor.
void check_cpu_binary(const at::Tensor& t, const char* op, const char* arg) {
  check_compactable(t, op, arg);
  TORCH_CHECK(t.device().is_cpu(), op, ": ", arg, " is on ", t.device(),
              "; the two-valued packing has CPU kernels only so far");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> binary_mask(const at::Tensor& y) {
  check_cpu_binary(y, "relu_ext::binary_mask", "y");
  at::Tensor mask = new_mask(y), value = at::empty({}, y.options());
  const bool ok = binary_mask_cpu(y, mask.data_ptr<uint8_t>(), value);
  return {mask, value, at::scalar_tensor(ok, y.options().dtype(at::kBool))};
}

at::Tensor binary_expand(const at::Tensor& mask, const at::Tensor& value, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  check_cpu_binary(value, "relu_ext::binary_expand", "value");
  TORCH_CHECK(value.dim() == 0, "relu_ext::binary_expand: value must be a scalar (0-dim), got shape ", value.sizes());
  at::Tensor out = at::empty_strided_symint(size, stride, value.options());
  TORCH_CHECK(out.is_non_overlapping_and_dense(), "relu_ext::binary_expand: size ", out.sizes(), " and stride ",
              out.strides(), " are not a dense layout");
  check_compaction_mask(mask, out, "relu_ext::binary_expand");
  binary_expand_cpu(mask.const_data_ptr<uint8_t>(), value, out);
  return out;
}

// --- Replay (save_compact's recipes for activations after a BatchNorm) ----------

void check_replay_device(const at::Tensor& t, const char* op, const char* arg) {
  check_compactable(t, op, arg);
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), op, ": ", arg, " is on ", t.device(),
              "; the BatchNorm replay has CPU and CUDA kernels only");
#ifndef WITH_CUDA
  if (t.device().is_cuda()) no_cuda_kernels(op);
#endif
}

std::tuple<at::Tensor, at::Tensor> bn_terms(const std::optional<at::Tensor>& weight,
                                            const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                            const at::Tensor& var, bool training, double eps, at::ScalarType dtype) {
  const char* op = "relu_ext::bn_terms";
  TORCH_CHECK(is_float(dtype), op, ": dtype ", dtype, " is not a float dtype");
  const int64_t channels = mean.numel();
  using Arg = std::pair<std::optional<at::Tensor>, const char*>;
  for (const auto& [t, arg] : {Arg{mean, "mean"}, Arg{var, "var"}, Arg{weight, "weight"}, Arg{bias, "bias"}}) {
    if (!t) continue;
    TORCH_CHECK(t->dim() == 1 && t->numel() == channels, op, ": ", arg, " has shape ", t->sizes(),
                "; expected [", channels, "] (one value per channel, as mean)");
    check_replay_device(*t, op, arg);
    TORCH_CHECK(t->device() == mean.device(), op, ": ", arg, " is on ", t->device(), " but mean is on ",
                mean.device());
  }
  const auto opmath = dtype == at::kDouble ? at::kDouble : at::kFloat;
  if (mean.is_cuda()) {
    // PyTorch's CUDA terms: the parameters in opmath (exact), invstd = rsqrt(running_var + eps) in eval
    // (batch_norm_calc_invstd); device ops, no host sync.
    const auto m = [&](const at::Tensor& t) { return t.to(opmath); };
    const at::Tensor w = weight ? m(*weight) : at::ones({channels}, mean.options().dtype(opmath));
    const at::Tensor b = bias ? m(*bias) : at::zeros({channels}, mean.options().dtype(opmath));
    const at::Tensor invstd = training ? m(var) : at::rsqrt(m(var) + eps);
    return {at::stack({w, invstd}), at::stack({m(mean), b})};
  }
  at::Tensor alpha = at::empty({channels}, mean.options().dtype(opmath));
  at::Tensor beta = at::empty({channels}, mean.options().dtype(opmath));
  bn_terms_cpu(weight, bias, mean, var, training, eps, alpha, beta);
  return {alpha, beta};
}

void check_replay(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const char* op) {
  check_replay_device(x, op, "x");
  TORCH_CHECK(x.dim() >= 2, op, ": x has shape ", x.sizes(), "; expected (N, C, ...) with channels in dimension 1");
  const auto opmath = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // The terms' shape: CPU (alpha, beta) = (invstd * w, b - mean * alpha), C each; CUDA alpha = [w; invstd],
  // beta = [mean; b], 2 x C (each BatchNorm computes with its own; replay_cpu.cpp, kernels.cuh).
  const auto shape = x.is_cuda() ? std::vector<int64_t>{2, x.size(1)} : std::vector<int64_t>{x.size(1)};
  using Arg = std::pair<const at::Tensor&, const char*>;
  for (const auto& [t, arg] : {Arg{alpha, "alpha"}, Arg{beta, "beta"}}) {
    TORCH_CHECK(t.device() == x.device() && t.scalar_type() == opmath && t.sizes() == at::IntArrayRef(shape) &&
                    t.is_contiguous(),
                op, ": ", arg, " must be a contiguous ", opmath, " tensor of shape ", at::IntArrayRef(shape), " on ",
                x.device(), " (x's channels in its opmath type, as bn_terms makes them there); got ",
                t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
  }
}

// The residual add's second input: x2 with its terms, laid out as x; none, or all three.
void check_second(const at::Tensor& x, const std::optional<at::Tensor>& x2, const std::optional<at::Tensor>& alpha2,
                  const std::optional<at::Tensor>& beta2, const char* op) {
  if (!x2) {
    TORCH_CHECK(!alpha2 && !beta2, op, ": alpha2 and beta2 are x2's terms; got them without x2");
    return;
  }
  TORCH_CHECK(alpha2 && beta2, op, ": x2 needs its terms alpha2 and beta2");
  TORCH_CHECK(x2->device() == x.device() && x2->scalar_type() == x.scalar_type() && x2->sizes() == x.sizes() &&
                  x2->strides() == x.strides(),
              op, ": x2 must have x's dtype, device, shape and strides; got ", x2->scalar_type(), " ", x2->sizes(),
              " strides ", x2->strides(), " on ", x2->device(), " for x's ", x.scalar_type(), " ", x.sizes(),
              " strides ", x.strides(), " on ", x.device());
  check_replay(*x2, *alpha2, *beta2, op);
}

// Rebuilds into y, or with `verify` compares with y: a bool scalar on x's device, true where equal.
at::Tensor bn_act(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, c10::string_view act,
                  at::ArrayRef<double> args, const at::Tensor& y, const std::optional<at::Tensor>& x2,
                  const std::optional<at::Tensor>& alpha2, const std::optional<at::Tensor>& beta2, bool verify) {
#ifdef WITH_CUDA
  if (x.is_cuda()) {
    at::Tensor differ = verify ? at::zeros({}, x.options().dtype(at::kInt)) : at::Tensor();
    bn_act_cuda(x, alpha, beta, x2.value_or(at::Tensor()), alpha2.value_or(at::Tensor()), beta2.value_or(at::Tensor()),
                std::string(act), args, y, differ);
    return verify ? differ.eq(0) : at::Tensor();
  }
#endif
  const bool equal = bn_act_cpu(x, alpha, beta, x2.value_or(at::Tensor()), alpha2.value_or(at::Tensor()),
                                beta2.value_or(at::Tensor()), std::string(act), args, y, verify);
  return verify ? at::scalar_tensor(equal, x.options().dtype(at::kBool)) : at::Tensor();
}

at::Tensor bn_act_verify(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                         c10::string_view act, at::ArrayRef<double> args, const at::Tensor& y,
                         const std::optional<at::Tensor>& x2, const std::optional<at::Tensor>& alpha2,
                         const std::optional<at::Tensor>& beta2) {
  const char* op = "relu_ext::bn_act_verify";
  check_replay(x, alpha, beta, op);
  check_second(x, x2, alpha2, beta2, op);
  TORCH_CHECK(y.device() == x.device() && y.scalar_type() == x.scalar_type() && y.sizes() == x.sizes() &&
                  y.strides() == x.strides(),
              op, ": y must have x's dtype, device, shape and strides; got ", y.scalar_type(), " ", y.sizes(),
              " strides ", y.strides(), " on ", y.device(), " for x's ", x.scalar_type(), " ", x.sizes(),
              " strides ", x.strides(), " on ", x.device());
  return bn_act(x, alpha, beta, act, args, y, x2, alpha2, beta2, /*verify=*/true);
}

at::Tensor bn_act_rebuild(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta,
                          c10::string_view act, at::ArrayRef<double> args, const std::optional<at::Tensor>& x2,
                          const std::optional<at::Tensor>& alpha2, const std::optional<at::Tensor>& beta2) {
  const char* op = "relu_ext::bn_act_rebuild";
  check_replay(x, alpha, beta, op);
  check_second(x, x2, alpha2, beta2, op);
  at::Tensor y = at::empty_strided(x.sizes(), x.strides(), x.options());
  bn_act(x, alpha, beta, act, args, y, x2, alpha2, beta2, /*verify=*/false);
  return y;
}

#ifndef WITH_CUDA
std::tuple<at::Tensor, at::Tensor> compact_no_cuda(const at::Tensor&, const at::Tensor&) {
  no_cuda_kernels("relu_ext::compact");
}
at::Tensor compact_count_no_cuda(const at::Tensor&, const at::Tensor&) { no_cuda_kernels("relu_ext::compact_count"); }
at::Tensor compact_into_no_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  no_cuda_kernels("relu_ext::compact_into");
}
at::Tensor expand_no_cuda(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef, c10::SymIntArrayRef, bool) {
  no_cuda_kernels("relu_ext::expand");
}
at::Tensor nonzero_mask_no_cuda(const at::Tensor&) { no_cuda_kernels("relu_ext::nonzero_mask"); }
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(relu_ext, m) {
  // save_compact: a dense tensor as the elements its bitmap keeps (compact;
  // `missed` counts dropped elements that are not +0), back (expand), and the
  // bitmap of its nonzero elements. Not differentiable: they act on saved data.
  m.def("compact(Tensor y, Tensor mask) -> (Tensor values, Tensor missed)");
  // compact in two steps with no host sync between them: the count (`ends`,
  // the device's tiling; its last entry the total), then the kept elements
  // into `values` sized by that total (`missed` as compact's, and nonzero where
  // values' size is not the total). expand without `check` trusts values' size
  // (no sync on CUDA; never a read past values).
  m.def("compact_count(Tensor y, Tensor mask) -> Tensor ends");
  m.def("compact_into(Tensor y, Tensor mask, Tensor ends, Tensor(a!) values) -> Tensor missed");
  m.def("expand(Tensor values, Tensor mask, SymInt[] size, SymInt[] stride, bool check=True) -> Tensor");
  m.def("nonzero_mask(Tensor y) -> Tensor");
  // A dense tensor of +0 and at most one other bit pattern (CPU dropout's
  // noise) as its nonzero_mask and that pattern (a scalar), `ok` false when y
  // has a second nonzero pattern (the mask is then unfinished); and back.
  m.def("binary_mask(Tensor y) -> (Tensor mask, Tensor value, Tensor ok)");
  m.def("binary_expand(Tensor mask, Tensor value, SymInt[] size, SymInt[] stride) -> Tensor");
  // save_compact's recipes: an activation output after a BatchNorm rebuilt from
  // the BatchNorm's input and per-channel terms, as PyTorch's kernels on that
  // device computed it (replay_cpu.cpp, kernels.cuh): the terms, a
  // bit-for-bit check against the real output (a bool scalar on x's device),
  // and the rebuild. With x2: the activation of BN(x) + BN2(x2), a residual
  // add (x2's terms from weight None, bias -0.0, mean 0 and invstd 1, training,
  // add it as it is). Not differentiable.
  m.def("bn_terms(Tensor? weight, Tensor? bias, Tensor mean, Tensor var, bool training, float eps, "
        "ScalarType dtype) -> (Tensor alpha, Tensor beta)");
  m.def("bn_act_verify(Tensor x, Tensor alpha, Tensor beta, str act, float[] args, Tensor y, Tensor? x2=None, "
        "Tensor? alpha2=None, Tensor? beta2=None) -> Tensor");
  m.def("bn_act_rebuild(Tensor x, Tensor alpha, Tensor beta, str act, float[] args, Tensor? x2=None, "
        "Tensor? alpha2=None, Tensor? beta2=None) -> Tensor");
}

// The wrappers pick the kernel from the tensor's device, so both keys share them.
TORCH_LIBRARY_IMPL(relu_ext, CPU, m) {
  m.impl("compact", &compact);
  m.impl("compact_count", &compact_count);
  m.impl("compact_into", &compact_into);
  m.impl("expand", &expand);
  m.impl("nonzero_mask", &nonzero_mask);
  m.impl("binary_mask", &binary_mask);
  m.impl("binary_expand", &binary_expand);
  m.impl("bn_terms", &bn_terms);
  m.impl("bn_act_verify", &bn_act_verify);
  m.impl("bn_act_rebuild", &bn_act_rebuild);
}

TORCH_LIBRARY_IMPL(relu_ext, CUDA, m) {
  // Two-valued packing: CPU kernels only; a CUDA tensor gets the wrappers' device check.
  m.impl("binary_mask", &binary_mask);
  m.impl("binary_expand", &binary_expand);
  m.impl("bn_terms", &bn_terms);
  m.impl("bn_act_verify", &bn_act_verify);
  m.impl("bn_act_rebuild", &bn_act_rebuild);
#ifdef WITH_CUDA
  m.impl("compact", &compact);
  m.impl("compact_count", &compact_count);
  m.impl("compact_into", &compact_into);
  m.impl("expand", &expand);
  m.impl("nonzero_mask", &nonzero_mask);
#else
  m.impl("compact", &compact_no_cuda);
  m.impl("compact_count", &compact_count_no_cuda);
  m.impl("compact_into", &compact_into_no_cuda);
  m.impl("expand", &expand_no_cuda);
  m.impl("nonzero_mask", &nonzero_mask_no_cuda);
#endif
}

}  // namespace relu_ext
