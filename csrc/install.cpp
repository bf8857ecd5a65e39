// relu_ext.install(): relu_ext's kernels for PyTorch's own aten::relu and
// aten::relu_, registered with the dispatcher at run time, and removed again
// by destroying the registrations (uninstall).
//
// Every way of calling a ReLU ends in these two ops (F.relu, torch.relu,
// Tensor.relu, nn.ReLU, TorchScript graphs, C++ callers, references to F.relu
// taken before install), so this reaches all of them without touching any
// Python function or any other op. Two keys per device:
//   - AutogradCPU / AutogradCUDA: relu_ext's autograd kernel (mask-saving
//     ReluExtBackward0 node, forward AD); what PyTorch computes below autograd
//     is not reached from here.
//   - CPU / CUDA: relu_ext's forward kernel, for calls that skip autograd
//     (inference mode, and aten ops called from inside __torch_dispatch__).
// A tensor relu_ext does not take goes to the kernel that was there before,
// looked up when installing, so it gets exactly what torch.relu gives it.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <vector>

#include "ops.h"

namespace relu_ext {
namespace {

// The tensors relu_ext takes over: those it has kernels for, of a dtype it
// supports, that are ordinary tensors. Tensors with a Python dispatch key are
// __torch_dispatch__ subclasses (FakeTensor and FunctionalTensor while
// torch.compile and torch.export trace, DTensor, jagged nested tensors, ...):
// they expect aten ops, so they keep PyTorch's kernel, and traced graphs stay
// the ones nn.ReLU gives. Zero tensors (forward AD's) keep PyTorch's handling too.
bool takes(const at::Tensor& x) {
  return has_kernel_for(x) && is_relu_dtype(x.scalar_type()) && !x.key_set().has(c10::DispatchKey::Python) &&
         !x._is_zerotensor();
}

// The kernel PyTorch has for an op and dispatch key (the generated autograd
// kernel, or the native CPU / CUDA one), kept while ours replaces it.
struct Original {
  c10::OperatorHandle op;
  c10::SafeKernelFunction kernel;

  Original(const char* name, c10::DispatchKey key)
      : op(c10::Dispatcher::singleton().findSchemaOrThrow(name, "")),
        kernel(op.getComputedKernelForDispatchKey(key)) {}

  // Boxed: the only call torch 2.11's SafeKernelFunction offers (it checks
  // that the kernel still exists). Only tensors relu_ext hands on take it.
  at::Tensor relu(c10::DispatchKeySet ks, const at::Tensor& x) const {
    torch::jit::Stack stack{x};
    kernel.callBoxed(op, ks, &stack);
    return std::move(stack.back()).toTensor();
  }
  at::Tensor& relu_(c10::DispatchKeySet ks, at::Tensor& x) const {
    torch::jit::Stack stack{x};
    kernel.callBoxed(op, ks, &stack);  // returns x itself (Tensor(a!))
    return x;
  }
};

// PyTorch warns, once per process, when a kernel replaces another one
// ("Overriding a previously registered kernel"). Here that is the point.
struct Silent : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// Our kernels at `key`: `autograd` picks relu_ext's autograd kernels, else its
// forward kernels.
std::unique_ptr<torch::Library> take_over(c10::DispatchKey key, bool autograd) {
  auto relu = std::make_shared<const Original>("aten::relu", key);
  auto relu_ = std::make_shared<const Original>("aten::relu_", key);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
  lib->impl("relu", [relu, autograd](c10::DispatchKeySet ks, const at::Tensor& x) -> at::Tensor {
    if (!takes(x)) return relu->relu(ks, x);
    return autograd ? relu_autograd(x) : relu_kernel(x);
  });
  lib->impl("relu_", [relu_, autograd](c10::DispatchKeySet ks, at::Tensor& x) -> at::Tensor& {
    if (!takes(x)) return relu_->relu_(ks, x);
    autograd ? relu_autograd_(x) : relu_kernel_(x);
    return x;
  });
  return lib;
}

std::mutex mutex;
std::vector<std::unique_ptr<torch::Library>> registrations;  // empty: not installed

}  // namespace

void install() {
  const std::lock_guard<std::mutex> lock(mutex);
  if (!registrations.empty()) return;
  Silent silent;
  const c10::WarningUtils::WarningHandlerGuard quiet(&silent);
  registrations.push_back(take_over(c10::DispatchKey::AutogradCPU, true));
  registrations.push_back(take_over(c10::DispatchKey::CPU, false));
#ifdef WITH_CUDA
  registrations.push_back(take_over(c10::DispatchKey::AutogradCUDA, true));
  registrations.push_back(take_over(c10::DispatchKey::CUDA, false));
#endif
}

void uninstall() {
  const std::lock_guard<std::mutex> lock(mutex);
  // Newest first, so each key gets back exactly the kernel it had.
  while (!registrations.empty()) registrations.pop_back();
}

bool installed() {
  const std::lock_guard<std::mutex> lock(mutex);
  return !registrations.empty();
}

}  // namespace relu_ext
