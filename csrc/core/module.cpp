// The Python module relu_ext._C: how the extension was built, the CPU kernel
// choice, the CUDA kernels' unroll, the eager entry points of relu_ext's
// functions, install / uninstall (install.cpp), and the Python types of the
// backward nodes (so that grad_fn prints as ReluExtBackward0 etc. and exposes
// its saved mask, like PyTorch's own nodes).
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/python.h>

#include "activations/autograd.h"
#include "compact/compact.h"
#include "core/cuda_launch.h"
#include "core/isa.h"

namespace relu_ext {
namespace {

#ifdef WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

// relu_ext's functions in eager mode for plain tensors: the op `name` (or
// `name`_, which returns `input` itself) with its Scalar arguments (schema
// order; the unused ones ignored) through the C++ dispatcher, without the
// Python op-call machinery (torch.ops), and the GIL released as torch's own
// bindings do.
PyObject* act_entry(const std::string& name, PyObject* input, bool inplace, const ActArgs& args) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(THPVariable_Check(input), "relu_ext.", name, ": expected a Tensor, got ", Py_TYPE(input)->tp_name);
  const at::Tensor& x = THPVariable_Unpack(input);
  at::Tensor y;
  {
    const pybind11::gil_scoped_release no_gil;
    y = act_call(name, x, inplace, args);
  }
  if (inplace) {
    Py_INCREF(input);
    return input;
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

// A Python bool, int or float as torch.ops converts it for a Scalar argument
// (torch's pybind11 caster does not load Scalars; relu_ext's Python layer
// sends nothing else this way).
c10::Scalar to_scalar(pybind11::handle h) {
  PyObject* o = h.ptr();
  if (PyBool_Check(o)) return c10::Scalar(o == Py_True);
  if (PyLong_Check(o)) {
    const long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
    return c10::Scalar(static_cast<int64_t>(v));
  }
  TORCH_CHECK_TYPE(PyFloat_Check(o), "relu_ext: expected a number, got ", Py_TYPE(o)->tp_name);
  return c10::Scalar(PyFloat_AS_DOUBLE(o));
}

template <typename Act>
PyObject* saved_mask(PyObject* self, void* /*unused*/) {
  HANDLE_TH_ERRORS
  const auto& node =
      *static_cast<MaskBackward<Act>*>(reinterpret_cast<torch::autograd::THPCppFunction*>(self)->cdata.get());
  return THPVariable_Wrap(node.mask_.unpack());
  END_HANDLE_TH_ERRORS
}

// The activation's Scalar arguments (a tuple of floats, schema order; 0 past
// the op's own): what save_compact reads to tell whether outputs are mostly zeros.
template <typename Act>
PyObject* saved_args(PyObject* self, void* /*unused*/) {
  HANDLE_TH_ERRORS
  const auto& node =
      *static_cast<MaskBackward<Act>*>(reinterpret_cast<torch::autograd::THPCppFunction*>(self)->cdata.get());
  return Py_BuildValue("(dd)", node.args_[0].toDouble(), node.args_[1].toDouble());
  END_HANDLE_TH_ERRORS
}

using namespace torch::autograd;  // the THP_FUNCTION_DEFAULT_* macros name its functions unqualified

// The Python type of an activation's backward node: PyTorch's default
// properties plus `_saved_mask` and `_saved_args`. Types and property tables
// live as long as the module.
template <typename Act>
void register_node(pybind11::module_& m) {
  static PyGetSetDef properties[] = {
      THP_FUNCTION_DEFAULT_PROPERTIES,
      {(char*)"_saved_mask", (getter)saved_mask<Act>, nullptr, nullptr, nullptr},
      {(char*)"_saved_args", (getter)saved_args<Act>, nullptr, nullptr, nullptr},
      {nullptr}};
  static PyTypeObject type;
  torch::autograd::_initFunctionPyTypeObject(type, Act::kNode, properties, /*methods: the default ones*/ nullptr);
  Py_INCREF(&type);
  m.attr(Act::kNode) = pybind11::handle(reinterpret_cast<PyObject*>(&type));
  torch::autograd::registerCppFunction(typeid(MaskBackward<Act>), &type);
}

// The names of relu_ext::<op>'s arguments after the input, as registered (from the trait's kSchemaArgs).
std::vector<std::string> scalar_names(const std::string& op) {
  const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(("relu_ext::" + op).c_str(), "");
  const auto& args = handle.schema().arguments();
  std::vector<std::string> names;
  for (size_t i = 1; i < args.size(); ++i) names.push_back(args[i].name());
  return names;
}

}  // namespace

void register_native_packer(pybind11::module_& m);  // (csrc/compact/hooks.cpp)

}  // namespace relu_ext

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace relu_ext;
  m.doc() = "relu_ext native kernels; the ops live under torch.ops.relu_ext";
  m.attr("with_cuda") = kWithCuda;
  m.def("cpu_isa", &cpu_isa, "CPU kernel set in use: 'avx512', 'avx2' or 'scalar'.");
  m.def("set_cpu_isa", &set_cpu_isa, pybind11::arg("name"),
        "Choose the CPU kernel set: 'auto' (best this CPU has), 'avx512', 'avx2' or 'scalar'.");
  // Declared in every build (the type stub lists them); without CUDA kernels they say so.
  m.def(
      "cuda_unroll",
      []() -> int {
#ifdef WITH_CUDA
        return cuda_unroll();
#else
        TORCH_CHECK(false, "relu_ext: cuda_unroll: this build has no CUDA kernels");
        return 0;
#endif
      },
      "Rows per warp and loop iteration of the CUDA vector kernels.");
  m.def(
      "set_cuda_unroll",
      [](int64_t rows) {
#ifdef WITH_CUDA
        set_cuda_unroll(rows);
#else
        TORCH_CHECK(false, "relu_ext: set_cuda_unroll(", rows, "): this build has no CUDA kernels");
#endif
      },
      pybind11::arg("rows"),
      "Choose the CUDA kernels' unroll: 1, 2 or 4 rows of 32 16-byte vectors per warp and iteration "
      "(each thread then has that many 16-byte loads in flight). For tests and tuning.");
  m.def(
      "cuda_waves",
      []() -> int {
#ifdef WITH_CUDA
        return cuda_waves();
#else
        TORCH_CHECK(false, "relu_ext: cuda_waves: this build has no CUDA kernels");
        return 0;
#endif
      },
      "Grid cap of the CUDA kernels, in waves of resident blocks (0: no cap).");
  m.def(
      "set_cuda_waves",
      [](int64_t waves) {
#ifdef WITH_CUDA
        set_cuda_waves(waves);
#else
        TORCH_CHECK(false, "relu_ext: set_cuda_waves(", waves, "): this build has no CUDA kernels");
#endif
      },
      pybind11::arg("waves"),
      "Cap the CUDA kernels' grids at `waves` times the blocks that fit on the device at once "
      "(0 to 64; 0: no cap, one group of rows per warp). For tests and tuning.");
  m.def(
      "relu",
      [](pybind11::handle input, bool inplace) {
        PyObject* out = act_entry("relu", input.ptr(), inplace, ActArgs{});
        if (out == nullptr) throw pybind11::error_already_set();
        return pybind11::reinterpret_steal<pybind11::object>(out);
      },
      pybind11::arg("input"), pybind11::arg("inplace") = false,
      "relu_ext.relu for plain tensors in eager mode (the relu_ext::relu / relu_ op).");

  m.def(
      "act",
      [](const std::string& name, pybind11::handle input, bool inplace, pybind11::handle a0, pybind11::handle a1) {
        PyObject* out = act_entry(name, input.ptr(), inplace, ActArgs{to_scalar(a0), to_scalar(a1)});
        if (out == nullptr) throw pybind11::error_already_set();
        return pybind11::reinterpret_steal<pybind11::object>(out);
      },
      pybind11::arg("name"), pybind11::arg("input"), pybind11::arg("inplace"), pybind11::arg("a0"),
      pybind11::arg("a1"),
      "relu_ext's other functions for plain tensors in eager mode (the relu_ext::<name> / <name>_ op).");

  m.def("same_bits", &same_bits_cpu, pybind11::arg("a"), pybind11::arg("b"),
        "Whether two CPU tensors of the same sizes and dtype hold the same bits, whatever their strides.");
  // save_compact's pack and unpack hooks call these once per saved tensor: the
  // ops through the C++ dispatcher (every key they have, checks included),
  // without Python's op-call machinery, which costs more than the kernels at
  // small sizes.
  m.def(
      "compact_now",
      [](const at::Tensor& y, const std::optional<at::Tensor>& mask) {
        TORCH_CHECK_VALUE(y.device().is_cpu(), "relu_ext._C.compact_now: y is on ", y.device(),
                          "; it reads compact's count of missed elements on the host, so it takes CPU tensors only");
        check_compactable(y, "relu_ext._C.compact_now", "y");
        if (mask.has_value()) check_compaction_mask(*mask, y, "relu_ext._C.compact_now");
        const pybind11::gil_scoped_release no_gil;
        return compact_now_cpu(y, mask);
      },
      pybind11::arg("y"), pybind11::arg("mask"),
      "relu_ext::compact of CPU y by `mask` where that restores y (no other element is nonzero), else by "
      "relu_ext::nonzero_mask(y): (values, the mask used, whether it is `mask`).");
  m.def(
      "expand",
      [](const at::Tensor& values, const at::Tensor& mask, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
        const pybind11::gil_scoped_release no_gil;
        // Below autograd: what it makes is never differentiated (a saved tensor, rebuilt for backward).
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        return expand_op().call(values, mask, size, stride, false);
      },
      pybind11::arg("values"), pybind11::arg("mask"), pybind11::arg("size"), pybind11::arg("stride"),
      "relu_ext::expand(values, mask, size, stride, False): the tensor values and mask were compacted from.");
  // The replay's ops, called once per replayed tensor when saved (bn_terms, bn_act_verify) and in
  // backward (bn_act_rebuild): as expand, below autograd (their inputs are detached).
  m.def(
      "bn_terms",
      [](const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& mean,
         const at::Tensor& var, bool training, double eps, pybind11::handle dtype) {
        TORCH_CHECK_TYPE(THPDtype_Check(dtype.ptr()), "relu_ext._C.bn_terms: dtype must be a torch.dtype, got ",
                         Py_TYPE(dtype.ptr())->tp_name);
        const at::ScalarType scalar_type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
        const pybind11::gil_scoped_release no_gil;
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        return bn_terms_op().call(weight, bias, mean, var, training, eps, scalar_type);
      },
      pybind11::arg("weight"), pybind11::arg("bias"), pybind11::arg("mean"), pybind11::arg("var"),
      pybind11::arg("training"), pybind11::arg("eps"), pybind11::arg("dtype"),
      "relu_ext::bn_terms through the C++ dispatcher: a BatchNorm's per-channel (alpha, beta).");
  m.def(
      "bn_act_verify",
      [](const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const std::string& act,
         const std::vector<double>& args, const at::Tensor& y, const std::optional<at::Tensor>& x2,
         const std::optional<at::Tensor>& alpha2, const std::optional<at::Tensor>& beta2) {
        const pybind11::gil_scoped_release no_gil;
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        return bn_act_verify_op().call(x, alpha, beta, act, args, y, x2, alpha2, beta2);
      },
      pybind11::arg("x"), pybind11::arg("alpha"), pybind11::arg("beta"), pybind11::arg("act"), pybind11::arg("args"),
      pybind11::arg("y"), pybind11::arg("x2") = pybind11::none(), pybind11::arg("alpha2") = pybind11::none(),
      pybind11::arg("beta2") = pybind11::none(),
      "relu_ext::bn_act_verify through the C++ dispatcher: the flag that the replay differs from y.");
  m.def(
      "bn_act_rebuild",
      [](const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, const std::string& act,
         const std::vector<double>& args, const std::optional<at::Tensor>& x2, const std::optional<at::Tensor>& alpha2,
         const std::optional<at::Tensor>& beta2) {
        const pybind11::gil_scoped_release no_gil;
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        return bn_act_rebuild_op().call(x, alpha, beta, act, args, x2, alpha2, beta2);
      },
      pybind11::arg("x"), pybind11::arg("alpha"), pybind11::arg("beta"), pybind11::arg("act"), pybind11::arg("args"),
      pybind11::arg("x2") = pybind11::none(), pybind11::arg("alpha2") = pybind11::none(),
      pybind11::arg("beta2") = pybind11::none(),
      "relu_ext::bn_act_rebuild through the C++ dispatcher: the activation output the replay rebuilds.");
  m.def(
      "dense_at_least",
      [](const at::Tensor& t, int64_t numel) {
        return t.layout() == at::kStrided && !t.is_nested() && (t.is_cpu() || t.is_cuda()) && t.numel() >= numel &&
               t.is_non_overlapping_and_dense();
      },
      pybind11::arg("t"), pybind11::arg("numel"),
      "Whether t is a strided (not nested) CPU or CUDA tensor of at least `numel` elements that fills a block of "
      "memory exactly once, in any order of dimensions.");
  // A tensor's version counter outlives the tensor (views share it): a form of save_compact that no
  // longer holds its tensor reads it, so that a change in place after the forward gives PyTorch's
  // error even once the tensor is freed.
  pybind11::class_<c10::VariableVersion>(m, "VersionCounter",
                                         "A tensor's version counter, shared with its views; holds no data.")
      .def_property_readonly("version", &c10::VariableVersion::current_version,
                             "The counter's value now: t._version of every tensor that shares it.");
  m.def(
      "version_counter", [](const at::Tensor& t) { return t.unsafeGetTensorImpl()->version_counter(); },
      pybind11::arg("t"), "t's version counter (not its data): t._version, read later, even after t is freed.");
  m.def("bits_sum", &bits_sum_cpu, pybind11::arg("t"),
        "The sum of a dense CPU tensor's bytes as 64-bit words from its first element, modulo 2**64 (as an int64).");
  m.def(
      "output_strides",
      [](const std::string& name, const at::Tensor& x) {
#define X(Act) \
  if (name == Act::kName) return output_strides(x, Act::kOutputLikeInput);
        RELU_EXT_ACTIVATIONS(X)
#undef X
        TORCH_CHECK_VALUE(false, "relu_ext: no activation '", name, "'");
      },
      pybind11::arg("name"), pybind11::arg("x"),
      "The strides of relu_ext::<name>(x)'s output, PyTorch's (for the fake kernels; symbolic under tracing).");
  m.def(
      "backward_strides",
      [](const std::string& name, c10::SymIntArrayRef sizes, c10::SymIntArrayRef grad, c10::SymIntArrayRef self) {
#define X(Act) \
  if (name == Act::kName) return grad_in_strides<Act>(sizes, grad, self);
        RELU_EXT_ACTIVATIONS(X)
#undef X
        TORCH_CHECK_VALUE(false, "relu_ext: no activation '", name, "'");
      },
      pybind11::arg("name"), pybind11::arg("sizes"), pybind11::arg("grad"), pybind11::arg("self"),
      "The strides PyTorch's backward of relu_ext::<name> gives grad_in for a grad and the tensor that "
      "backward reads (its input or output) of these sizes and strides, in its operand order (for the vmap rules).");
  m.def(
      "activation_table",
      [] {
        std::vector<std::tuple<std::string, std::string, std::vector<std::string>>> rows;
#define X(Act) rows.emplace_back(Act::kName, Act::kNode, scalar_names(Act::kName));
        RELU_EXT_ACTIVATIONS(X)
#undef X
        return rows;
      },
      "The activation table (csrc/activations/activations.h): (op name, backward node name, names of its "
      "Scalar arguments in its registered schema) per trait, in order.");
  m.def("install_targets", &install_targets, "The aten ops install() can take over, by name.");
  m.def("install", &install, pybind11::arg("ops"),
        "Register relu_ext's kernels for these aten ops (and their in-place forms; idempotent).");
  m.def("uninstall", &uninstall, pybind11::arg("ops"),
        "Remove them: PyTorch's own kernels are back (idempotent).");
  m.def("installed", &installed, "The aten ops relu_ext's kernels run now.");
  m.def(
      "set_recompute_probe",
      [](pybind11::function probe) {
        // Kept for the life of the process: never destroyed, as there may be no GIL at exit.
        auto* held = new pybind11::function(std::move(probe));
        set_recompute_probe([held](const std::string& op, bool installed) {
          const pybind11::gil_scoped_acquire gil;
          try {
            return (*held)(op, installed).cast<bool>();
          } catch (pybind11::error_already_set& e) {
            e.discard_as_unraisable("relu_ext's checkpoint probe");
            return false;
          }
        });
      },
      pybind11::arg("probe"),
      "probe(op, installed) -> bool: whether an autograd kernel of relu_ext (installed for aten's op, or "
      "relu_ext's own), recording a node under saved-tensor hooks, must run PyTorch's kernel for op "
      "(activation checkpointing; relu_ext.dispatch).");

#define X(Act) register_node<Act>(m);
  RELU_EXT_ACTIVATIONS(X)
#undef X
  register_native_packer(m);
}
