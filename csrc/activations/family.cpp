// The activations' ops (activations.h), all generated from
// RELU_EXT_ACTIVATIONS: for an activation `act` with Scalar arguments A,
//   act(x, A) -> y, act_(x, A)                 public, as torch.nn.functional's
//                                              (mask-free when no gradient
//                                              and no tangent is needed)
//   act_fwd(x, A) -> (y, mask), act_fwd_(x, A) -> mask, act_bwd(grad, mask, A)
//                                              the training pieces
// with their kernels at every key, written as PyTorch writes its own
// (VariableType and the generated backward nodes): CPU / CUDA wrappers
// (checks, layout, allocation), ADInplaceOrView (version counting),
// Functionalize (in-place ops as functional ones), Tracer, and Autograd,
// whose node (MaskBackward<Act>, named ReluExtBackward0 for relu) saves only
// the mask. What relu_ext has no kernel for (integer dtypes but relu's,
// bool, complex, sparse, nested, quantized, other devices) goes to
// PyTorch's own aten op, so it gets exactly its answer and its errors.
#include <ATen/ATen.h>
#include <ATen/FunctionalTensorWrapper.h>
#include <ATen/MemoryOverlap.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <array>
#include <limits>
#include <string>
#include <utility>

#include "activations/autograd.h"
#include "activations/compiled.h"

namespace relu_ext {

void check_backward_mask(const at::Tensor& grad, const at::Tensor& mask, const char* op) {
  TORCH_CHECK(mask.device() == grad.device(), op, ": grad is on ", grad.device(), " but mask is on ", mask.device(),
              "; both must be on the same device");
  TORCH_CHECK(mask.scalar_type() == at::kByte, op, ": mask has dtype ", mask.scalar_type(),
              "; expected uint8 (the mask returned by the forward op)");
  const int64_t need = (grad.numel() + 7) / 8;
  TORCH_CHECK(mask.dim() == 1 && mask.numel() == need, op, ": mask has shape ", mask.sizes(), " but grad has ",
              grad.numel(), " elements, which need a 1-D mask of ", need, " bytes");
  TORCH_CHECK(mask.is_contiguous(), op, ": mask must be contiguous");
}


namespace ag = torch::autograd;
using ag::variable_list;

namespace {

template <size_t>
using ScalarArg = const c10::Scalar&;

// PyTorch's message for the in-place leaky_relu_ backward with a negative slope.
constexpr const char* kLeakyInplaceError =
    "In-place leakyReLu backward calculation is triggered with a negative slope which is not supported. This is "
    "caused by calling in-place forward function with a negative slope, please call out-of-place version instead "
    "(relu_ext follows PyTorch here: the mask would allow it, but the same code must behave the same with both)";

// Only leaky_relu_ has such a limit.
template <typename Act>
bool inplace_backward_refused(const ActArgs& a) {
  if constexpr (std::is_same_v<Act, LeakyRelu>) {
    return !(a[0].toDouble() >= 0.0);
  } else {
    return false;
  }
}

template <typename Act, typename Seq = std::make_index_sequence<Act::kArgs>>
struct Family;

template <typename Act, size_t... I>
struct Family<Act, std::index_sequence<I...>> {
  using PubFn = at::Tensor(const at::Tensor&, ScalarArg<I>...);
  using PubInplaceFn = void(at::Tensor&, ScalarArg<I>...);
  using AtenInplaceFn = at::Tensor&(at::Tensor&, ScalarArg<I>...);
  using FwdFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, ScalarArg<I>...);
  using FwdInplaceFn = at::Tensor(at::Tensor&, ScalarArg<I>...);
  using BwdFn = at::Tensor(const at::Tensor&, const at::Tensor&, ScalarArg<I>...);

  static std::string name(const char* suffix) { return std::string("relu_ext::") + Act::kName + suffix; }

  template <typename Fn>
  static c10::TypedOperatorHandle<Fn> handle(const std::string& qualified) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(qualified.c_str(), "").template typed<Fn>();
  }
  static const auto& pub_op() {
    static const auto h = handle<PubFn>(name(""));
    return h;
  }
  static const auto& pub_inplace_op() {
    static const auto h = handle<PubInplaceFn>(name("_"));
    return h;
  }
  static const auto& fwd_op() {
    static const auto h = handle<FwdFn>(name("_fwd"));
    return h;
  }
  static const auto& fwd_inplace_op() {
    static const auto h = handle<FwdInplaceFn>(name("_fwd_"));
    return h;
  }
  static const auto& bwd_op() {
    static const auto h = handle<BwdFn>(name("_bwd"));
    return h;
  }
  static const auto& aten_op() {
    static const auto h = handle<PubFn>(std::string("aten::") + Act::kName);
    return h;
  }
  static const auto& aten_inplace_op() {
    static const auto h = handle<AtenInplaceFn>(std::string("aten::") + Act::kName + "_");
    return h;
  }

  static ActArgs args(ScalarArg<I>... s) {
    ActArgs a;
    ((a[I] = s), ...);
    return a;
  }

  // The public op through the dispatcher (act_call).
  static at::Tensor call(const at::Tensor& x, bool inplace, const ActArgs& a) {
    if (inplace) {
      pub_inplace_op().call(const_cast<at::Tensor&>(x), a[I]...);
      return x;
    }
    return pub_op().call(x, a[I]...);
  }

  // --- CPU / CUDA wrappers ----------------------------------------------------

  // The dtypes of relu_ext's kernels for the public op.
  static bool own_dtype(at::ScalarType t) { return Act::kInts ? is_relu_dtype(t) : is_float(t); }

  static void check_float(const at::Tensor& t, const std::string& op, const char* arg) {
    TORCH_CHECK_NOT_IMPLEMENTED(is_float(t.scalar_type()), op, ": ", arg, " has dtype ", t.scalar_type(),
                                "; this op writes or reads the gradient mask, for float32, float64, float16 and "
                                "bfloat16 only (integer tensors carry no gradient: relu_ext::",
                                Act::kName, " takes them)");
  }

  static void run_forward(const at::Tensor& x, const at::Tensor& y, uint8_t* mask, const ActArgs& a) {
    const bool ints = Act::kInts && !is_float(x.scalar_type());
    if (x.is_cuda()) {
#ifdef WITH_CUDA
      ints ? forward_int_cuda(x, y) : act_forward_cuda<Act>(x, y, mask, a);
#else
      no_cuda_kernels(name(""));
#endif
    } else {
      ints ? forward_int_cpu(x, y) : act_forward_cpu<Act>(x, y, mask, a);
    }
    // (After the kernel, which wrote the mask from x: in place, y is x.)
    if (!ints && Act::nan_output(a)) y.fill_(std::numeric_limits<double>::quiet_NaN());
  }

  // y in PyTorch's layout, which walks memory in xd's order (layout.h).
  static at::Tensor forward_new(const at::Tensor& x, uint8_t* mask, const ActArgs& a) {
    const at::Tensor xd = dense(x);
    at::Tensor y = new_output(x, Act::kOutputLikeInput);
    run_forward(xd, y, mask, a);
    return y;
  }

  static void forward_inplace(at::Tensor& x, uint8_t* mask, const ActArgs& a) {
    at::assert_no_internal_overlap(x);
    if (x.is_non_overlapping_and_dense()) return run_forward(x, x, mask, a);
    at::Tensor xd = dense(x);
    run_forward(xd, xd, mask, a);
    x.copy_(xd);
  }

  // The public op's kernels take every dtype PyTorch's op takes: what
  // relu_ext has no kernel for (and whatever PyTorch refuses, with its own
  // error) goes to aten.
  static at::Tensor kernel(const at::Tensor& x, ScalarArg<I>... s) {
    if (!own_dtype(x.scalar_type())) return aten_op().call(x, s...);
    return forward_new(x, nullptr, args(s...));
  }

  static void kernel_(at::Tensor& x, ScalarArg<I>... s) {
    if (!own_dtype(x.scalar_type())) {
      aten_inplace_op().call(x, s...);
      return;
    }
    forward_inplace(x, nullptr, args(s...));
  }

  static std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& x, ScalarArg<I>... s) {
    check_float(x, name("_fwd"), "x");
    at::Tensor mask = new_mask(x);
    return {forward_new(x, mask.data_ptr<uint8_t>(), args(s...)), mask};
  }

  static at::Tensor fwd_(at::Tensor& x, ScalarArg<I>... s) {
    check_float(x, name("_fwd_"), "x");
    at::Tensor mask = new_mask(x);
    forward_inplace(x, mask.data_ptr<uint8_t>(), args(s...));
    return mask;
  }

  // `grad` must be laid out like the forward output (its mask order).
  static at::Tensor bwd(const at::Tensor& grad, const at::Tensor& mask, ScalarArg<I>... s) {
    const std::string op = name("_bwd");
    check_float(grad, op, "grad");
    check_backward_mask(grad, mask, op.c_str());
    const at::Tensor gd = dense(grad);
    at::Tensor grad_in = at::empty_like(gd);
    if (gd.is_cuda()) {
#ifdef WITH_CUDA
      act_backward_cuda<Act>(gd, mask.const_data_ptr<uint8_t>(), grad_in, args(s...));
      return grad_in;
#else
      no_cuda_kernels(op);
#endif
    }
    act_backward_cpu<Act>(gd, mask.const_data_ptr<uint8_t>(), grad_in, args(s...));
    return grad_in;
  }

  // --- ADInplaceOrView, Functionalize, Tracer (as ops.cpp's for relu) ---------

  static void inplace_view(at::Tensor& x, ScalarArg<I>... s) {
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      pub_inplace_op().call(x, s...);
    }
    ag::increment_version(x);
  }

  static at::Tensor fwd_inplace_view(at::Tensor& x, ScalarArg<I>... s) {
    at::Tensor mask;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      mask = fwd_inplace_op().call(x, s...);
    }
    ag::increment_version(x);
    return mask;
  }

  static void functionalize_(at::Tensor& x, ScalarArg<I>... s) {
    namespace fz = at::functionalization::impl;
    if (!fz::isFunctionalTensor(x)) {
      const at::AutoDispatchSkipFunctionalize skip;
      return pub_inplace_op().call(x, s...);
    }
    at::assert_no_internal_overlap(x);
    fz::sync(x);
    at::Tensor y;
    {
      const at::AutoDispatchSkipFunctionalize skip;
      y = pub_op().call(fz::from_functional_tensor(x), s...);
    }
    fz::replace_(x, y);
    fz::commit_update(x);
    fz::sync(x);
  }

  static at::Tensor fwd_functionalize_(at::Tensor& x, ScalarArg<I>... s) {
    namespace fz = at::functionalization::impl;
    if (!fz::isFunctionalTensor(x)) {
      const at::AutoDispatchSkipFunctionalize skip;
      return fwd_inplace_op().call(x, s...);
    }
    at::assert_no_internal_overlap(x);
    fz::sync(x);
    at::Tensor y, mask;
    {
      const at::AutoDispatchSkipFunctionalize skip;
      std::tie(y, mask) = fwd_op().call(fz::from_functional_tensor(x), s...);
    }
    fz::replace_(x, y);
    fz::commit_update(x);
    fz::sync(x);
    return fz::to_functional_tensor(mask);
  }

  static void trace_(at::Tensor& x, ScalarArg<I>... s) { x.copy_(pub_op().call(x, s...)); }

  // --- Autograd -----------------------------------------------------------------

  // grad_in from the mask, through the dispatcher above autograd (so that it
  // is differentiable again in grad), laid out as PyTorch's backward lays it
  // out: TensorIterator's layout over grad and the tensor it reads (strides
  // `self_strides`), in the op's operand order. Computed in that layout where
  // it walks memory in the mask's order, else in the mask's and copied.
  static at::Tensor masked(const at::Tensor& grad, const at::Tensor& mask, c10::SymIntArrayRef sizes,
                           c10::SymIntArrayRef strides, c10::SymIntArrayRef self_strides, const ActArgs& a) {
    const at::Tensor g = grad.sym_sizes() == sizes ? grad : grad.expand_symint(sizes);  // a scalar broadcasts
    const SymStrides want = grad_in_strides<Act>(sizes, g.sym_strides(), self_strides);
    if (same_order(sizes, want, strides)) return bwd_op().call(to_layout(grad, sizes, want), mask, a[I]...);
    return to_layout(bwd_op().call(to_layout(grad, sizes, strides), mask, a[I]...), sizes, want);
  }

  // grad_in's tangent: grad's tangent through the mask (grad_in is linear in grad), plus zeros where
  // PyTorch's backward op's forward derivative adds them (kTangentAddsZero: -0.0 becomes +0.0).
  static at::Tensor masked_tangent(const at::Tensor& grad_t, const at::Tensor& mask, c10::SymIntArrayRef sizes,
                                   c10::SymIntArrayRef strides, c10::SymIntArrayRef self_strides, const ActArgs& a) {
    at::Tensor t = masked(grad_t, mask, sizes, strides, self_strides, a);
    return Act::kTangentAddsZero ? at::add(at::zeros_like(t), t) : t;
  }

  static NodePtr make_node(ag::edge_list edges, const at::Tensor& mask, c10::SymIntArrayRef sizes, SymStrides strides,
                           SymStrides self_strides, const ActArgs& a, Reads reads) {
    NodePtr node = new_node<MaskBackward<Act>>();
    auto* fn = static_cast<MaskBackward<Act>*>(node.get());
    fn->set_next_edges(std::move(edges));
    if (mask.defined()) fn->mask_ = ag::SavedVariable(mask, /*is_output=*/false);
    fn->sizes_ = sizes.vec();
    fn->strides_ = std::move(strides);
    fn->self_strides_ = std::move(self_strides);
    fn->args_ = a;
    fn->reads_ = reads;
    return node;
  }

  // grad_in under create_graph=True: a node of its own, differentiable in
  // grad and (zeros) along `read`, the edge to the tensor PyTorch's backward reads.
  static at::Tensor differentiable_masked(const at::Tensor& grad, const at::Tensor& mask, c10::SymIntArrayRef sizes,
                                          const SymStrides& strides, const SymStrides& self_strides, const ActArgs& a,
                                          ag::Edge read) {
    at::Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      out = masked(grad, mask, sizes, strides, self_strides, a);
    }
    if (ag::isFwGradDefined(grad)) {
      out._set_fw_grad(masked_tangent(grad._fw_grad(0), mask, sizes, strides, self_strides, a), 0,
                       /*is_inplace_op=*/false);
    }
    auto edges = ag::collect_next_edges(grad);
    edges.push_back(std::move(read));
    ag::set_history(out, make_node(std::move(edges), mask, sizes, strides, self_strides, a, Reads::kEdge1));
    return out;
  }

  static std::tuple<at::Tensor, at::Tensor> differentiable_fwd(const at::Tensor& x, const ActArgs& a, bool grad,
                                                                bool tangent) {
    at::Tensor y, mask;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      std::tie(y, mask) = fwd_op().call(x, a[I]...);
    }
    auto strides = mask_strides(x);
    auto self_strides = (Act::kReadsResult ? y : x).sym_strides().vec();
    if (tangent) {
      y._set_fw_grad(masked(x._fw_grad(0), mask, x.sym_sizes(), strides, self_strides, a), 0, /*is_inplace_op=*/false);
    }
    if (grad) {
      ag::set_history(y, make_node(ag::collect_next_edges(x), mask, x.sym_sizes(), std::move(strides),
                                   std::move(self_strides), a, Act::kReadsResult ? Reads::kOutput : Reads::kInput));
    }
    return {y, mask};
  }

  static at::Tensor differentiable_fwd_(at::Tensor& x, const ActArgs& a, bool grad, bool tangent) {
    const bool refused = inplace_backward_refused<Act>(a);
    TORCH_CHECK(!(tangent && refused), kLeakyInplaceError);  // PyTorch's forward AD formula raises too
    auto strides = mask_strides(x);
    // The in-place forms read the output (x itself), or a clone of the input laid out as empty_like(x).
    auto self_strides = Act::kInplaceReadsResult ? x.sym_strides().vec() : strides;
    NodePtr node = grad ? make_node(ag::collect_next_edges(x), at::Tensor(), x.sym_sizes(), strides, self_strides, a,
                                    Act::kInplaceReadsResult ? Reads::kOutput : Reads::kInput)
                        : NodePtr();
    at::Tensor mask;
    {
      const at::AutoDispatchBelowAutograd below;  // ADInplaceOrView still bumps the version
      mask = fwd_inplace_op().call(x, a[I]...);
    }
    if (node) {
      auto* fn = static_cast<MaskBackward<Act>*>(node.get());
      fn->mask_ = ag::SavedVariable(mask, /*is_output=*/false);
      fn->inplace_error_ = refused;
      ag::rebase_history(x, node);
    }
    if (tangent) {
      at::Tensor t = x._fw_grad(0);
      t.copy_(masked(t, mask, x.sym_sizes(), strides, self_strides, a));
    }
    return mask;
  }

  // PyTorch's own op where relu_ext has no kernel and, for relu_ext's own op
  // (install.cpp asks for aten's), where a selective checkpointing policy must
  // see it (torch_kernel_wanted).
  static bool to_aten(const at::Tensor& x, bool own_op) {
    return !has_kernel_for(x) || !own_dtype(x.scalar_type()) ||
           (own_op && torch_kernel_wanted(x, Act::kName, /*installed=*/false));
  }

  static at::Tensor autograd(const at::Tensor& x, const ActArgs& a, bool own_op) {
    if (to_aten(x, own_op)) return aten_op().call(x, a[I]...);
    const bool grad = ag::compute_requires_grad(x);
    const bool tangent = ag::isFwGradDefined(x);
    if (!grad && !tangent) {
      const at::AutoDispatchBelowADInplaceOrView below;
      return pub_op().call(x, a[I]...);
    }
    return std::get<0>(differentiable_fwd(x, a, grad, tangent));
  }

  static void autograd_(at::Tensor& x, const ActArgs& a, bool own_op) {
    if (to_aten(x, own_op)) {
      aten_inplace_op().call(x, a[I]...);
      return;
    }
    const bool grad = ag::compute_requires_grad(x);
    const bool tangent = ag::isFwGradDefined(x);
    ag::check_inplace(x, grad);  // PyTorch's errors for a leaf, or a view of one, that requires grad
    if (!grad && !tangent) {
      const at::AutoDispatchBelowAutograd below;
      return pub_inplace_op().call(x, a[I]...);
    }
    differentiable_fwd_(x, a, grad, tangent);
  }

  static at::Tensor pub_autograd(const at::Tensor& x, ScalarArg<I>... s) { return autograd(x, args(s...), true); }
  static void pub_autograd_(at::Tensor& x, ScalarArg<I>... s) { autograd_(x, args(s...), true); }

  static std::tuple<at::Tensor, at::Tensor> fwd_autograd(const at::Tensor& x, ScalarArg<I>... s) {
    check_layout_and_device(x, name("_fwd").c_str(), "x");
    const bool grad = ag::compute_requires_grad(x);
    const bool tangent = ag::isFwGradDefined(x);
    if (!grad && !tangent) {
      const at::AutoDispatchBelowADInplaceOrView below;
      return fwd_op().call(x, s...);
    }
    return differentiable_fwd(x, args(s...), grad, tangent);
  }

  static at::Tensor fwd_autograd_(at::Tensor& x, ScalarArg<I>... s) {
    check_layout_and_device(x, name("_fwd_").c_str(), "x");
    const bool grad = ag::compute_requires_grad(x);
    const bool tangent = ag::isFwGradDefined(x);
    ag::check_inplace(x, grad);
    if (!grad && !tangent) {
      const at::AutoDispatchBelowAutograd below;
      return fwd_inplace_op().call(x, s...);
    }
    return differentiable_fwd_(x, args(s...), grad, tangent);
  }

  // Linear in grad with the same mask: its backward and tangent are itself.
  static at::Tensor bwd_autograd(const at::Tensor& grad, const at::Tensor& mask, ScalarArg<I>... s) {
    check_layout_and_device(grad, name("_bwd").c_str(), "grad");
    const bool needs = ag::compute_requires_grad(grad);
    const bool tangent = ag::isFwGradDefined(grad);
    at::Tensor out;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      out = bwd_op().call(grad, mask, s...);
    }
    if (!needs && !tangent) return out;
    const ActArgs a = args(s...);
    auto strides = mask_strides(grad);
    if (tangent) {
      out._set_fw_grad(masked_tangent(grad._fw_grad(0), mask, grad.sym_sizes(), strides, strides, a), 0, false);
    }
    if (needs) {
      ag::set_history(out, make_node(ag::collect_next_edges(grad), mask, grad.sym_sizes(), strides, strides, a,
                                     Reads::kNothing));
    }
    return out;
  }

  // --- registration -------------------------------------------------------------

  static void define(torch::Library& m) {
    const std::string n = Act::kName, a = Act::kSchemaArgs;
    m.def((n + "(Tensor x" + a + ") -> Tensor").c_str());
    m.def((n + "_(Tensor(a!) x" + a + ") -> ()").c_str());
    m.def((n + "_fwd(Tensor x" + a + ") -> (Tensor, Tensor)").c_str());
    m.def((n + "_fwd_(Tensor(a!) x" + a + ") -> Tensor").c_str());
    m.def((n + "_bwd(Tensor grad, Tensor mask" + a + ") -> Tensor").c_str());
  }

  static void impl_kernels(torch::Library& m) {
    const std::string n = Act::kName;
    m.impl(n.c_str(), &kernel);
    m.impl((n + "_").c_str(), &kernel_);
    m.impl((n + "_fwd").c_str(), &fwd);
    m.impl((n + "_fwd_").c_str(), &fwd_);
    m.impl((n + "_bwd").c_str(), &bwd);
  }

  // A build without CUDA kernels: its CUDA-key kernels say so and why,
  // instead of the dispatcher's "could not run ... with arguments from the
  // 'CUDA' backend".
  static void impl_no_cuda(torch::Library& m) {
    const std::string n = Act::kName;
    m.impl(n.c_str(), [](const at::Tensor&, ScalarArg<I>...) -> at::Tensor { no_cuda_kernels(name("")); });
    m.impl((n + "_").c_str(), [](at::Tensor&, ScalarArg<I>...) { no_cuda_kernels(name("_")); });
    m.impl((n + "_fwd").c_str(), [](const at::Tensor&, ScalarArg<I>...) -> std::tuple<at::Tensor, at::Tensor> {
      no_cuda_kernels(name("_fwd"));
    });
    m.impl((n + "_fwd_").c_str(), [](at::Tensor&, ScalarArg<I>...) -> at::Tensor { no_cuda_kernels(name("_fwd_")); });
    m.impl((n + "_bwd").c_str(), [](const at::Tensor&, const at::Tensor&, ScalarArg<I>...) -> at::Tensor {
      no_cuda_kernels(name("_bwd"));
    });
  }

  static void impl_autograd(torch::Library& m) {
    const std::string n = Act::kName;
    m.impl(n.c_str(), &pub_autograd);
    m.impl((n + "_").c_str(), &pub_autograd_);
    m.impl((n + "_fwd").c_str(), &fwd_autograd);
    m.impl((n + "_fwd_").c_str(), &fwd_autograd_);
    m.impl((n + "_bwd").c_str(), &bwd_autograd);
  }

  static void impl_views(torch::Library& m, c10::DispatchKey key) {
    const std::string n = Act::kName;
    if (key == c10::DispatchKey::ADInplaceOrView) {
      m.impl((n + "_").c_str(), &inplace_view);
      m.impl((n + "_fwd_").c_str(), &fwd_inplace_view);
    } else if (key == c10::DispatchKey::Functionalize) {
      m.impl((n + "_").c_str(), &functionalize_);
      m.impl((n + "_fwd_").c_str(), &fwd_functionalize_);
    } else {
      m.impl((n + "_").c_str(), &trace_);
    }
  }

  // --- the node's computation -------------------------------------------------------

  // grad_in (output 0) and, for a node recorded under create_graph=True, the
  // zeros along its second edge (output 1). With `read` (create_graph=True),
  // grad_in is differentiable as PyTorch's is (differentiable_masked).
  static variable_list apply_functional(const variable_list& grads, std::array<bool, 2> needs,
                                        const at::Tensor& mask, const std::vector<c10::SymInt>& sizes,
                                        const std::vector<c10::SymInt>& strides,
                                        const std::vector<c10::SymInt>& self_strides, const ActArgs& a, bool refused,
                                        Reads reads, const ag::Edge* read = nullptr) {
    TORCH_CHECK(!refused, kLeakyInplaceError);
    variable_list out(reads == Reads::kEdge1 ? 2 : 1);
    const at::Tensor& g = grads[0];
    if (!g.defined()) return out;
    if (needs[0]) {
      out[0] = read ? differentiable_masked(g, mask, sizes, strides, self_strides, a, *read)
                    : masked(g, mask, sizes, strides, self_strides, a);
    }
    if (needs[1]) {
      const at::NoGradGuard no_grad;
      out[1] = at::zeros_like(g);  // PyTorch's derivative in the tensor its backward reads: zeros_like(grad)
    }
    return out;
  }

  static variable_list apply_functional_ivalue(const variable_list& grads, const ag::ivalue_list& packed_args) {
    auto packed = torch::dynamo::autograd::PackedArgs(packed_args);
    const auto needs = packed.unpack<std::array<bool, 2>>();
    const auto mask = packed.unpack<at::Tensor>();
    const auto sizes = packed.unpack<std::vector<c10::SymInt>>();
    const auto strides = packed.unpack<std::vector<c10::SymInt>>();
    const auto self_strides = packed.unpack<std::vector<c10::SymInt>>();
    ActArgs a;
    a[0] = packed.unpack<c10::Scalar>();
    a[1] = packed.unpack<c10::Scalar>();
    const auto refused = packed.unpack<bool>();
    const auto reads = static_cast<Reads>(packed.unpack<int64_t>());
    return apply_functional(grads, needs, mask, sizes, strides, self_strides, a, refused, reads);
  }
};

}  // namespace

// --- the node ---------------------------------------------------------------------

template <typename Act>
ag::Edge MaskBackward<Act>::read_edge() {
  switch (reads_) {
    case Reads::kInput:
      return next_edge(0);
    case Reads::kOutput:
      return ag::Edge(getptr(), 0);
    case Reads::kEdge1:
      return next_edge(1);
    case Reads::kNothing:
      break;
  }
  return ag::Edge();
}

template <typename Act>
variable_list MaskBackward<Act>::apply(variable_list&& grads) {
  const std::lock_guard<std::mutex> lock(mutex_);
  const at::Tensor mask = mask_.unpack();  // raises PyTorch's error after the mask was released
  const std::array<bool, 2> needs = {task_should_compute_output(0),
                                     reads_ == Reads::kEdge1 && task_should_compute_output(1)};
  // create_graph=True: grad_in also depends on what PyTorch's backward reads.
  const ag::Edge read = at::GradMode::is_enabled() ? read_edge() : ag::Edge();
  return Family<Act>::apply_functional(grads, needs, mask, sizes_, strides_, self_strides_, args_, inplace_error_,
                                       reads_, read.is_valid() ? &read : nullptr);
}

template <typename Act>
void MaskBackward<Act>::release_variables() {
  const std::lock_guard<std::mutex> lock(mutex_);
  mask_.reset_data();
}

template <typename Act>
void MaskBackward<Act>::compiled_args(ag::CompiledNodeArgs& args) const {
  // SymInts in the order apply_with_saved swaps them: self_strides_ first, then record_apply's.
  args.collect(self_strides_);
  args.collect(mask_, /*is_output=*/false);
  args.collect(sizes_);
  args.collect(strides_);
  args.collect(args_[0]);
  args.collect(args_[1]);
  args.collect(inplace_error_);
  args.collect(static_cast<int64_t>(reads_));
}

template <typename Act>
variable_list MaskBackward<Act>::apply_with_saved(const variable_list& grads, ag::SwapSavedVariables& saved) {
  static bool bound = false;
  const std::array<bool, 2> needs = {task_should_compute_output(0),
                                     reads_ == Reads::kEdge1 && task_should_compute_output(1)};
  saved.before(self_strides_);
  auto out = record_apply(*this, grads, saved, bound, &Family<Act>::apply_functional_ivalue, needs, mask_, sizes_,
                          strides_, self_strides_, args_[0], args_[1], inplace_error_, static_cast<int64_t>(reads_));
  saved.after(self_strides_);
  return out;
}

template <typename Act>
at::Tensor act_kernel(const at::Tensor& x, const ActArgs& a) {
  return Family<Act>::forward_new(x, nullptr, a);
}

template <typename Act>
void act_kernel_(at::Tensor& x, const ActArgs& a) {
  Family<Act>::forward_inplace(x, nullptr, a);
}

template <typename Act>
at::Tensor act_autograd(const at::Tensor& x, const ActArgs& a) {
  return Family<Act>::autograd(x, a, /*own_op=*/false);
}

template <typename Act>
void act_autograd_(at::Tensor& x, const ActArgs& a) {
  Family<Act>::autograd_(x, a, /*own_op=*/false);
}

at::Tensor act_call(const std::string& name, const at::Tensor& x, bool inplace, const ActArgs& a) {
#define X(Act) \
  if (name == Act::kName) return Family<Act>::call(x, inplace, a);
  RELU_EXT_ACTIVATIONS(X)
#undef X
  TORCH_CHECK(false, "relu_ext: no activation '", name, "'");
}

#define RELU_EXT_INSTANTIATE(Act)                                         \
  template struct MaskBackward<Act>;                                      \
  template at::Tensor act_kernel<Act>(const at::Tensor&, const ActArgs&); \
  template void act_kernel_<Act>(at::Tensor&, const ActArgs&);            \
  template at::Tensor act_autograd<Act>(const at::Tensor&, const ActArgs&); \
  template void act_autograd_<Act>(at::Tensor&, const ActArgs&);
RELU_EXT_ACTIVATIONS(RELU_EXT_INSTANTIATE)
#undef RELU_EXT_INSTANTIATE

TORCH_LIBRARY_FRAGMENT(relu_ext, m) {
#define X(Act) Family<Act>::define(m);
  RELU_EXT_ACTIVATIONS(X)
#undef X
}

// The wrappers pick CPU or CUDA kernels from the tensor's device, so both
// keys share them (a build without CUDA kernels has impl_no_cuda's instead).
TORCH_LIBRARY_IMPL(relu_ext, CPU, m) {
#define X(Act) Family<Act>::impl_kernels(m);
  RELU_EXT_ACTIVATIONS(X)
#undef X
}

TORCH_LIBRARY_IMPL(relu_ext, CUDA, m) {
#ifdef WITH_CUDA
#define X(Act) Family<Act>::impl_kernels(m);
#else
#define X(Act) Family<Act>::impl_no_cuda(m);
#endif
  RELU_EXT_ACTIVATIONS(X)
#undef X
}

TORCH_LIBRARY_IMPL(relu_ext, Autograd, m) {
#define X(Act) Family<Act>::impl_autograd(m);
  RELU_EXT_ACTIVATIONS(X)
#undef X
}

TORCH_LIBRARY_IMPL(relu_ext, ADInplaceOrView, m) {
#define X(Act) Family<Act>::impl_views(m, c10::DispatchKey::ADInplaceOrView);
  RELU_EXT_ACTIVATIONS(X)
#undef X
}

TORCH_LIBRARY_IMPL(relu_ext, Functionalize, m) {
#define X(Act) Family<Act>::impl_views(m, c10::DispatchKey::Functionalize);
  RELU_EXT_ACTIVATIONS(X)
#undef X
}

TORCH_LIBRARY_IMPL(relu_ext, Tracer, m) {
#define X(Act) Family<Act>::impl_views(m, c10::DispatchKey::Tracer);
  RELU_EXT_ACTIVATIONS(X)
#undef X
}

}  // namespace relu_ext
