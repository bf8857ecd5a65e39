// Operator schema, the device-independent op wrappers (checks, layout,
// allocation), their CPU / CUDA registrations, and the pybind11 module that
// reports how the extension was built. Autograd and fake (meta) kernels are
// registered from Python (relu_ext/ops.py).
#include <torch/extension.h>

#include <ATen/MemoryOverlap.h>

#include "relu.h"

#ifndef RELU_EXT_CUDA_ARCH
#define RELU_EXT_CUDA_ARCH ""
#endif

namespace relu_ext {
namespace {

#ifdef WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

void check_input(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, " has layout ", t.layout(),
              "; relu_ext supports strided (dense) tensors only");
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16, op, ": ", arg,
              " has dtype ", dt, "; relu_ext supports float32, float64, float16 and bfloat16");
}

// Kernels walk memory linearly: give them `t` itself when it is dense, else a
// dense copy laid out as empty_like(t) lays it out (what torch.relu returns).
at::Tensor dense(const at::Tensor& t) {
  return t.is_non_overlapping_and_dense() ? t : at::empty_like(t).copy_(t);
}

at::Tensor new_mask(const at::Tensor& x) {
  return at::empty({(x.numel() + 7) / 8}, x.options().dtype(at::kByte));
}

void run_forward(const at::Tensor& x, const at::Tensor& y, uint8_t* mask) {
#ifdef WITH_CUDA
  if (x.is_cuda()) return forward_cuda(x, y, mask);
#endif
  forward_cpu(x, y, mask);
}

void run_backward(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& grad_in) {
#ifdef WITH_CUDA
  if (grad.is_cuda()) return backward_cuda(grad, mask, grad_in);
#endif
  backward_cpu(grad, mask, grad_in);
}

at::Tensor forward_new(const at::Tensor& x, uint8_t* mask) {
  const at::Tensor xd = dense(x);
  at::Tensor y = at::empty_like(xd);
  run_forward(xd, y, mask);
  return y;
}

at::Tensor relu(const at::Tensor& x) {
  check_input(x, "relu_ext::relu", "x");
  return forward_new(x, nullptr);
}

std::tuple<at::Tensor, at::Tensor> relu_fwd(const at::Tensor& x) {
  check_input(x, "relu_ext::relu_fwd", "x");
  at::Tensor mask = new_mask(x);
  return {forward_new(x, mask.data_ptr<uint8_t>()), mask};
}

void forward_inplace(at::Tensor& x, uint8_t* mask) {
  at::assert_no_internal_overlap(x);  // same error as torch.relu_ on an expanded view
  if (x.is_non_overlapping_and_dense()) {
    run_forward(x, x, mask);
    // Custom ops get no ADInplaceOrView kernel, so nothing else tells autograd
    // that x changed; without this a tensor saved for backward and then
    // overwritten here would go unnoticed. (copy_ below bumps it itself.)
    x.unsafeGetTensorImpl()->bump_version();
    return;
  }
  at::Tensor xd = dense(x);
  run_forward(xd, xd, mask);
  x.copy_(xd);
}

void relu_(at::Tensor& x) {
  check_input(x, "relu_ext::relu_", "x");
  forward_inplace(x, nullptr);
}

at::Tensor relu_fwd_(at::Tensor& x) {
  check_input(x, "relu_ext::relu_fwd_", "x");
  at::Tensor mask = new_mask(x);
  forward_inplace(x, mask.data_ptr<uint8_t>());
  return mask;
}

at::Tensor relu_bwd(const at::Tensor& grad, const at::Tensor& mask) {
  check_input(grad, "relu_ext::relu_bwd", "grad");
  TORCH_CHECK(mask.device() == grad.device(), "relu_ext::relu_bwd: grad is on ", grad.device(),
              " but mask is on ", mask.device(), "; both must be on the same device");
  TORCH_CHECK(mask.scalar_type() == at::kByte, "relu_ext::relu_bwd: mask has dtype ", mask.scalar_type(),
              "; expected uint8 (the mask returned by relu_fwd)");
  const int64_t need = (grad.numel() + 7) / 8;
  TORCH_CHECK(mask.dim() == 1 && mask.numel() == need, "relu_ext::relu_bwd: mask has shape ", mask.sizes(),
              " but grad has ", grad.numel(), " elements, which need a 1-D mask of ", need, " bytes");
  TORCH_CHECK(mask.is_contiguous(), "relu_ext::relu_bwd: mask must be contiguous");
  const at::Tensor gd = dense(grad);
  at::Tensor grad_in = at::empty_like(gd);
  run_backward(gd, mask.const_data_ptr<uint8_t>(), grad_in);
  return grad_in;
}

// Autograd-key kernels of the mask-free inference ops: they have no backward
// (relu_ext.relu() routes training to relu_fwd), so refuse a gradient clearly
// instead of letting it be silently dropped; otherwise pass straight through,
// in C++, so inference pays no Python autograd overhead.
void refuse_grad(const at::Tensor& x, const char* op) {
  TORCH_CHECK(!(at::GradMode::is_enabled() && x.requires_grad()), op,
              " writes no mask and has no backward; for training use relu_ext.relu(), "
              "which calls relu_fwd / relu_fwd_");
}

at::Tensor relu_autograd(const at::Tensor& x) {
  refuse_grad(x, "relu_ext::relu");
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("relu_ext::relu", "").typed<decltype(relu)>();
  const at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x);
}

void relu_autograd_(at::Tensor& x) {
  refuse_grad(x, "relu_ext::relu_");
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("relu_ext::relu_", "").typed<decltype(relu_)>();
  const at::AutoDispatchBelowADInplaceOrView below;
  op.call(x);
}

}  // namespace

// Mask layout: see relu.h. relu / relu_ are the inference ops (no mask);
// relu_fwd / relu_fwd_ also return the mask for relu_bwd.
TORCH_LIBRARY(relu_ext, m) {
  m.def("relu(Tensor x) -> Tensor");
  m.def("relu_(Tensor(a!) x) -> ()");
  m.def("relu_fwd(Tensor x) -> (Tensor, Tensor)");
  m.def("relu_fwd_(Tensor(a!) x) -> Tensor");
  m.def("relu_bwd(Tensor grad, Tensor mask) -> Tensor");
}

// The wrappers pick the kernel from the tensor's device, so both keys share them.
#define RELU_EXT_IMPLS(m)             \
  m.impl("relu", &relu);              \
  m.impl("relu_", &relu_);            \
  m.impl("relu_fwd", &relu_fwd);      \
  m.impl("relu_fwd_", &relu_fwd_);    \
  m.impl("relu_bwd", &relu_bwd)

TORCH_LIBRARY_IMPL(relu_ext, CPU, m) { RELU_EXT_IMPLS(m); }

#ifdef WITH_CUDA
TORCH_LIBRARY_IMPL(relu_ext, CUDA, m) { RELU_EXT_IMPLS(m); }
#endif

TORCH_LIBRARY_IMPL(relu_ext, Autograd, m) {
  m.impl("relu", &relu_autograd);
  m.impl("relu_", &relu_autograd_);
}

}  // namespace relu_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "relu_ext native kernels; the ops live under torch.ops.relu_ext";
  m.attr("with_cuda") = relu_ext::kWithCuda;
  m.attr("cuda_arch_list") = RELU_EXT_CUDA_ARCH;
  m.def("cpu_isa", &relu_ext::cpu_isa, "CPU kernel set in use: 'avx2' or 'scalar'.");
  m.def("set_cpu_isa", &relu_ext::set_cpu_isa, pybind11::arg("name"),
        "Choose the CPU kernel set: 'auto' (best this CPU has), 'avx2' or 'scalar'.");
}
