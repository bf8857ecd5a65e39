// relu_ext.install(): relu_ext's kernels for PyTorch's own aten::relu /
// relu_ and the family's aten ops (hardtanh / hardtanh_, leaky_relu /
// leaky_relu_, threshold / threshold_, hardsigmoid / hardsigmoid_),
// registered with the dispatcher at run time, per op, and removed again by
// destroying the registrations (uninstall).
//
// Every way of calling these activations ends in these ops (F.relu,
// torch.relu, Tensor.relu, nn.ReLU, F.relu6 and nn.ReLU6 through hardtanh,
// TorchScript graphs, C++ callers, references to F.relu taken before
// install), so this reaches all of them without touching any Python function
// or any other op. Two keys per device:
//   - AutogradCPU / AutogradCUDA: relu_ext's autograd kernel (mask-saving
//     node such as ReluExtBackward0, forward AD); what PyTorch computes below autograd
//     is not reached from here.
//   - CPU / CUDA: relu_ext's forward kernel, for calls that skip autograd
//     (inference mode, and aten ops called from inside __torch_dispatch__).
// A tensor relu_ext does not take goes to the kernel that was there before,
// looked up when installing, so it gets exactly what torch.relu gives it.
#include <ATen/core/Tensor.h>
#include <ATen/SavedTensorHooks.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <string>
#include <mutex>
#include <vector>

#include "activations/autograd.h"

namespace relu_ext {
namespace {

// The tensors relu_ext takes over: those it has kernels for, of a dtype it
// supports, that are ordinary tensors. Tensors with a Python dispatch key are
// __torch_dispatch__ subclasses (FakeTensor and FunctionalTensor while
// torch.compile and torch.export trace, DTensor, jagged nested tensors, ...):
// they expect aten ops, so they keep PyTorch's kernel, and traced graphs stay
// the ones PyTorch's modules give. Zero tensors (forward AD's) keep PyTorch's
// handling too. relu takes integer tensors too; the rest of the table takes
// float tensors only (their integer forward is PyTorch's own).
template <typename Act>
bool takes(const at::Tensor& x) {
  return has_kernel_for(x) && !x.key_set().has(c10::DispatchKey::Python) && !x._is_zerotensor() &&
         (Act::kInts ? is_relu_dtype(x.scalar_type()) : is_float(x.scalar_type()));
}

// PyTorch's non-reentrant checkpoint compares what its recomputation saves
// with what the forward saved (shape, dtype), and relu_ext's node saves a mask
// where PyTorch's keeps a tensor: a recomputation must run the kernel the
// forward ran. Whenever one of our autograd kernels is about to record a node
// under saved-tensor hooks, the Python layer (relu_ext.dispatch) looks at the
// hook on top: under a checkpoint's forward it notes the op on the checkpoint
// and makes its recomputation hold an installation of it; under a
// recomputation it answers true for an op the forward did not run through
// relu_ext, which then gets PyTorch's kernel. Under selective checkpointing
// (a __torch_dispatch__ mode whose policy names aten ops) it answers true for
// every call, installed or not (torch_kernel_wanted).
std::function<bool(const std::string&, bool)> recompute_with_torch;

}  // namespace

bool torch_kernel_wanted(const at::Tensor& x, const std::string& op, bool installed) {
  return recompute_with_torch && x.requires_grad() && at::GradMode::is_enabled() &&
         !at::SavedTensorDefaultHooks::get_tls_state().stack.empty() &&
         (installed || c10::impl::TorchDispatchModeTLS::stack_len() > 0) && recompute_with_torch(op, installed);
}

namespace {

template <size_t>
using ScalarArg = const c10::Scalar&;

// The kernel PyTorch has for an op and dispatch key (the generated autograd
// kernel, or the native CPU / CUDA one), kept while ours replaces it.
struct Original {
  c10::OperatorHandle op;
  c10::SafeKernelFunction kernel;

  Original(const std::string& name, c10::DispatchKey key)
      : op(c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "")),
        kernel(op.getComputedKernelForDispatchKey(key)) {}

  // Boxed: the only call torch 2.11's SafeKernelFunction offers (it checks
  // that the kernel still exists). Only tensors relu_ext hands on take it.
  template <typename... S>
  at::Tensor call(c10::DispatchKeySet ks, const at::Tensor& x, const S&... s) const {
    torch::jit::Stack stack{x, s...};
    kernel.callBoxed(op, ks, &stack);
    return std::move(stack.back()).toTensor();
  }
  template <typename... S>
  at::Tensor& call_(c10::DispatchKeySet ks, at::Tensor& x, const S&... s) const {
    torch::jit::Stack stack{x, s...};
    kernel.callBoxed(op, ks, &stack);  // returns x itself (Tensor(a!))
    return x;
  }
};

// PyTorch warns, once per process, when a kernel replaces another one
// ("Overriding a previously registered kernel"). Here that is the point.
struct Silent : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

using Libraries = std::vector<std::unique_ptr<torch::Library>>;

std::unique_ptr<torch::Library> library(c10::DispatchKey key) {
  return std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
}

// Our kernels for aten::<name> / <name>_ (with the activation's Scalar
// arguments) at `key`: `autograd` picks relu_ext's autograd kernels, else its
// forward kernels.
template <typename Act, size_t... I>
std::unique_ptr<torch::Library> take_over_act(c10::DispatchKey key, bool autograd, std::index_sequence<I...>) {
  const std::string name = Act::kName;
  auto fn = std::make_shared<const Original>("aten::" + name, key);
  auto fn_ = std::make_shared<const Original>("aten::" + name + "_", key);
  auto lib = library(key);
  lib->impl(name.c_str(), [fn, autograd, name](c10::DispatchKeySet ks, const at::Tensor& x, ScalarArg<I>... s) -> at::Tensor {
    if (!takes<Act>(x) || (autograd && torch_kernel_wanted(x, name, true))) return fn->call(ks, x, s...);
    ActArgs a;
    ((a[I] = s), ...);
    return autograd ? act_autograd<Act>(x, a) : act_kernel<Act>(x, a);
  });
  lib->impl((name + "_").c_str(), [fn_, autograd, name](c10::DispatchKeySet ks, at::Tensor& x, ScalarArg<I>... s) -> at::Tensor& {
    if (!takes<Act>(x) || (autograd && torch_kernel_wanted(x, name, true))) return fn_->call_(ks, x, s...);
    ActArgs a;
    ((a[I] = s), ...);
    autograd ? act_autograd_<Act>(x, a) : act_kernel_<Act>(x, a);
    return x;
  });
  return lib;
}

// Autograd and forward kernels for each device relu_ext has kernels for.
template <typename TakeOver>
Libraries take_over_keys(TakeOver&& take_over) {
  Libraries libs;
  libs.push_back(take_over(c10::DispatchKey::AutogradCPU, true));
  libs.push_back(take_over(c10::DispatchKey::CPU, false));
#ifdef WITH_CUDA
  libs.push_back(take_over(c10::DispatchKey::AutogradCUDA, true));
  libs.push_back(take_over(c10::DispatchKey::CUDA, false));
#endif
  return libs;
}

Libraries take_over_op(const std::string& op) {
#define X(Act)                                                                                       \
  if (op == Act::kName) {                                                                            \
    return take_over_keys([](c10::DispatchKey key, bool autograd) {                                  \
      return take_over_act<Act>(key, autograd, std::make_index_sequence<Act::kArgs>());              \
    });                                                                                              \
  }
  RELU_EXT_ACTIVATIONS(X)
#undef X
  TORCH_CHECK_VALUE(false, "relu_ext.install: unknown op '", op, "'; choose from ", c10::Join(", ", install_targets()));
}

std::mutex mutex;
std::map<std::string, Libraries> registrations;  // op -> its kernels, while installed

}  // namespace

void set_recompute_probe(std::function<bool(const std::string&, bool)> probe) { recompute_with_torch = std::move(probe); }

std::vector<std::string> install_targets() {
  std::vector<std::string> ops;
#define X(Act) ops.push_back(Act::kName);
  RELU_EXT_ACTIVATIONS(X)
#undef X
  return ops;
}

void install(const std::vector<std::string>& ops) {
  const std::lock_guard<std::mutex> lock(mutex);
  Silent silent;
  const c10::WarningUtils::WarningHandlerGuard quiet(&silent);
  for (const auto& op : ops) {
    if (registrations.count(op) == 0) registrations.emplace(op, take_over_op(op));
  }
}

void uninstall(const std::vector<std::string>& ops) {
  const std::lock_guard<std::mutex> lock(mutex);
  for (const auto& op : ops) {
    auto it = registrations.find(op);
    if (it == registrations.end()) continue;
    // Newest first, so each key gets back exactly the kernel it had.
    while (!it->second.empty()) it->second.pop_back();
    registrations.erase(it);
  }
}

std::vector<std::string> installed() {
  const std::lock_guard<std::mutex> lock(mutex);
  std::vector<std::string> ops;
  for (const auto& entry : registrations) ops.push_back(entry.first);
  return ops;
}

}  // namespace relu_ext
