// save_compact's pack hook, its C++ path: the saved tensors that no form of the table takes, kept as
// they are (a relu_ext mask, parameters and views of them (a Linear's weight.t()), buffers, BatchNorm's
// statistics, small tensors, outputs of ops the table has no row for: a convolution's), and the outputs
// of ReLU and its like that the compaction row would compact at once (the CPU's). Most saved tensors are
// the first (a ResNet's BatchNorm saves five of them for each it saves of its input), and kept as they
// are they need only be counted, once each; the second are most of what an MLP saves. Inside a training
// step a Python hook's cost is its interpreter's cache misses, not its work (docs/performance.md), so
// this is one C++ call: relu_ext._C.NativePacker, which hooks._Packer asks before its Python path, under
// its lock; a tensor it leaves (None) goes to that path, which decides as before.
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/python.h>

#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "activations/autograd.h"
#include "compact/compact.h"

namespace relu_ext {
namespace {

// Integer dtypes save_compact narrows (hooks._narrowable).
bool narrowable(at::ScalarType dtype) {
  return dtype == at::kLong || dtype == at::kInt || dtype == at::kShort;
}

// Dispatch keys of tensors whose Python path may differ (wrappers: functorch, functionalization, Python
// subclasses' modes): those go to it.
const c10::DispatchKeySet kWrapped{c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                   c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchGradWrapper,
                                   c10::DispatchKey::Functionalize};

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl>;

class NativePacker {
 public:
  // dense: the _Dense class; python_cache: the Python path's map (hooks._ByTensor.entries, by id), whose
  // tensors stay on that path; min_numel: the fewest elements any form takes (recipes._MIN_NUMEL);
  // python_nodes: the names of the nodes whose outputs the Python path decides (rows of the table,
  // remade ops); recent: the packer's recipes.Recent; note: graph._KEPT where the context recomputes (a
  // tensor with a node, kept as it is or compacted, is noted on it under that key, as hooks._Packer
  // does with graph._note_kept: note()), else None.
  // For the compactions at once (compact()): compacts: the nodes whose outputs are mostly zeros whatever
  // their arguments (graph.COMPACTS); after: the nodes after which an activation's output is replayed
  // instead where the context recomputes (a BatchNorm's: graph._BN_NODES); deferred: the Deferred class
  // (whose stand_in, in tests, makes every check wait); share: the most of its bytes a compaction may hold
  // (1 - min_saving); compacted: what makes, counts and caches the form of one (hooks._AtOnce).
  NativePacker(pybind11::object dense, pybind11::dict python_cache, int64_t min_numel,
               std::unordered_set<std::string> python_nodes, pybind11::object recent, pybind11::object note,
               std::unordered_set<std::string> compacts, std::unordered_set<std::string> after,
               pybind11::object deferred, double share, pybind11::object compacted)
      : dense_(std::move(dense)),
        python_cache_(std::move(python_cache)),
        min_numel_(min_numel),
        python_nodes_(std::move(python_nodes)),
        recent_(std::move(recent)),
        note_(std::move(note)),
        compacts_(std::move(compacts)),
        after_(std::move(after)),
        deferred_(std::move(deferred)),
        share_(share),
        compacted_(std::move(compacted)) {}

  // `obj` kept as it is (a _Dense), counted once however many nodes save it (a view of a parameter:
  // counted as the parameter), or compacted at once (made()), or the form made of it for a node before,
  // again; None where the Python path decides: a view of a tensor a node made, an output of a node a
  // row of the table or a remade op takes (made()), a tensor no node made that a form may take (an
  // integer tensor to narrow, a bitmap of one that needs no gradient), a wrapper or subclass, or a
  // tensor a form was made of at another version.
  pybind11::object keep(pybind11::handle obj) {
    PyObject* o = obj.ptr();
    if (!THPVariable_CheckExact(o)) return pybind11::none();
    const at::Tensor& t = THPVariable_Unpack(o);
    if (t.layout() != at::kStrided || t.is_nested() || !(t.is_cpu() || t.is_cuda()) || t.key_set().has_any(kWrapped))
      return pybind11::none();
    if (t.is_view()) return leaf_view(obj, t);
    if (t.grad_fn() != nullptr) return made(obj, t);
    const int64_t numel = t.numel();
    const at::ScalarType dtype = t.scalar_type();
    const bool needs_grad = t.requires_grad();
    if (numel >= min_numel_ &&
        (narrowable(dtype) || (!needs_grad && (at::isFloatingType(dtype) || dtype == at::kBool))))
      return pybind11::none();
    if (std::optional<pybind11::object> cached = from_python_cache(obj, t)) return *cached;
    count(t, /*made=*/false);
    return dense_(obj);
  }

  // Output `obj` of a node no row of the table takes and no remade op is (a convolution's, kept by its
  // BatchNorm): kept as it is and noted on its node (hooks._Packer._kept); or of a node in compacts_,
  // compacted at once where it can be (compactable()). First, as for any tensor of an op outside the
  // remade ones, the remade forms' values held for the next are forgotten (recipes.Recent).
  pybind11::object made(pybind11::handle obj, const at::Tensor& t) {
    const std::string name = t.grad_fn()->name();
    if (std::optional<pybind11::object> cached = from_python_cache(obj, t)) return *cached;
    const bool compacts = compacts_.count(name) > 0;
    if (!compacts && python_nodes_.count(name) > 0) return pybind11::none();
    if (compacts && !compactable(t)) return pybind11::none();
    forget_recent();
    if (compacts) return compact(obj, t, name);
    count(t, /*made=*/true);
    pybind11::object dense = dense_(obj);
    this->note(obj, t, dense);
    return dense;
  }

  // Whether `t`, an output of a node in compacts_, is compacted at once, exactly as the Python path
  // would (the rows of recipes.FORMS in order: a replay where one comes first; else compaction where
  // recipes._zeros_mostly applies; its Compacted made at once where Deferred.at_once).
  bool compactable(const at::Tensor& t) const {
    if (!t.is_cpu() || !is_float(t.scalar_type()) || t.numel() < min_numel_ ||
        !t.is_non_overlapping_and_dense() || !deferred_.attr("stand_in").is_none())
      return false;
    if (note_.is_none()) return true;  // (no recompute: no replay)
    // recipes._after_a_batchnorm (graph._after_batchnorm): its input a BatchNorm's, or a residual add's.
    const auto& edges = t.grad_fn()->next_edges();
    const torch::autograd::Node* prev = edges.empty() ? nullptr : edges[0].function.get();
    if (prev == nullptr) return true;
    const std::string prev_name = prev->name();
    if (prev_name == "AddBackward0") {
      for (const auto& edge : prev->next_edges()) {
        if (edge.function != nullptr && after_.count(edge.function->name()) > 0) return false;
      }
      return true;
    }
    return after_.count(prev_name) == 0;
  }

  // `obj` compacted at once (recipes._compacted, Compacted.now): by its node's mask (relu_ext's) where
  // that restores it, else by its own bitmap; its form made by compacted_ where that saves enough,
  // else None: the Python path keeps it, counted as too few zeros.
  pybind11::object compact(pybind11::handle obj, const at::Tensor& t, const std::string& name) {
    std::optional<at::Tensor> mask;
    if (name == Relu::kNode) {  // (graph._relu_ext_mask; unpacked through the hook that packed it)
      at::Tensor saved = static_cast<MaskBackward<Relu>*>(t.grad_fn().get())->mask_.unpack();
      if (saved.defined()) {
        check_compaction_mask(saved, t, "relu_ext.save_compact");
        mask = std::move(saved);
      }
    }
    at::Tensor values, used;
    bool shared = false;
    {
      const pybind11::gil_scoped_release no_gil;
      std::tie(values, used, shared) = compact_now_cpu(t, mask);
    }
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    const int64_t cost = values.numel() * static_cast<int64_t>(values.element_size()) +
                         (shared ? 0 : used.numel() * static_cast<int64_t>(used.element_size()));
    if (static_cast<double>(cost) > share_ * static_cast<double>(nbytes)) return pybind11::none();
    pybind11::object form = compacted_(obj, values, used, shared, cost);
    this->note(obj, t, form);
    return form;
  }

  // A view of a leaf that requires grad (a parameter: a Linear keeps its weight.t()), kept as it is and
  // counted as that leaf (hooks._Packer._of_leaf); None for a view of anything else.
  pybind11::object leaf_view(pybind11::handle obj, const at::Tensor& t) {
    const at::TensorBase& base = t._base();
    if (base.grad_fn() != nullptr || !base.requires_grad()) return pybind11::none();
    count(base, /*made=*/false);
    pybind11::object dense = dense_(obj);
    if (t.grad_fn() != nullptr) this->note(obj, t, dense);
    return dense;
  }

  // Whether keep() counted `t` (hooks._Packer._pack: a tensor then changed, by an op in place that gave
  // it a node, is not counted twice).
  bool counted(const at::Tensor& t) const { return seen_.count(t.unsafeGetTensorImpl()) > 0; }

  // (tensors, bytes, leaves, leaves' bytes) counted since the last call.
  std::tuple<int64_t, int64_t, int64_t, int64_t> take() {
    auto counts = std::make_tuple(kept_, bytes_, leaves_, leaf_bytes_);
    kept_ = bytes_ = leaves_ = leaf_bytes_ = 0;
    return counts;
  }

  // (tensors, bytes) of those counted since the last call that need no gradient and that something
  // still holds (a buffer, the step's input; not what only the graph holds, whose _Dense holds a
  // detached alias, another TensorImpl): held outside the graph, as hooks._Packer._exit counts.
  std::pair<int64_t, int64_t> outside() {
    int64_t tensors = 0, bytes = 0;
    for (const auto& [weak, nbytes] : unmade_) {
      if (weak.use_count() > 0) {
        tensors += 1;
        bytes += nbytes;
      }
    }
    unmade_.clear();
    return {tensors, bytes};
  }

 private:
  // graph._note_kept, where the context recomputes: on the node of `obj` (`t`), under note_, its output
  // number -> a weak reference to `packed`, what this context saved for it (graph._kept reads it: a
  // later recipe reads `t` through it). Through the node's `metadata` dict, as that function, with no
  // Python function call per tensor: the cost this path exists to avoid. (Not by casting the C++ node's
  // metadata() to torch's PyAnomalyMetadata: that type's typeinfo is not exported, and the sanitizer
  // build's vptr check needs it to load the module.)
  void note(pybind11::handle obj, const at::Tensor& t, pybind11::handle packed) {
    if (note_.is_none()) return;
    static PyObject* const grad_fn = PyUnicode_InternFromString("grad_fn");  // (never freed: no decref at exit)
    static PyObject* const metadata = PyUnicode_InternFromString("metadata");
    const pybind11::dict entries = obj.attr(grad_fn).attr(metadata);
    PyObject* kept = PyDict_GetItemWithError(entries.ptr(), note_.ptr());  // borrowed
    if (kept == nullptr) {  // (the node's first: a dict of its own, held by its metadata)
      if (PyErr_Occurred()) throw pybind11::error_already_set();
      const pybind11::dict fresh;
      entries[note_] = fresh;
      kept = fresh.ptr();
    }
    pybind11::handle{kept}[pybind11::int_(t.output_nr())] = pybind11::weakref(packed);
  }

  // As hooks._Packer._pack, for any tensor of an op outside the remade ones: the remade forms' values held
  // for the next are forgotten (recipes.Recent).
  void forget_recent() {
    const int remembers = PyObject_IsTrue(recent_.attr("forms").ptr());
    if (remembers < 0) throw pybind11::error_already_set();
    if (remembers) recent_.attr("forget")();
  }

  // Where the Python path (or compact()) made a form of `obj` first: that form again, for one node more,
  // where `obj` is at the version it was made at (hooks._Packer._pack), else None (that path decides).
  // Nothing where it did not.
  std::optional<pybind11::object> from_python_cache(pybind11::handle obj, const at::Tensor& t) const {
    const pybind11::object id = pybind11::reinterpret_steal<pybind11::object>(PyLong_FromVoidPtr(obj.ptr()));
    if (!id) throw pybind11::error_already_set();
    PyObject* entry = PyDict_GetItemWithError(python_cache_.ptr(), id.ptr());  // (ref, _Cached), borrowed
    if (entry == nullptr) {
      if (PyErr_Occurred()) throw pybind11::error_already_set();
      return std::nullopt;
    }
    const pybind11::tuple pair = pybind11::reinterpret_borrow<pybind11::tuple>(entry);
    if (!pair[0]().is(obj)) return std::nullopt;  // (its tensor gone, the entry not yet dropped)
    const pybind11::object cached = pair[1];
    if (cached.attr("version").cast<int64_t>() != static_cast<int64_t>(t._version())) return pybind11::none();
    return cached.attr("packed").attr("again")();
  }

  // Count `t` once, kept as it is; one no node `made`, held outside the graph where it is a leaf that
  // requires grad, or where something else still holds it when the block exits (outside()).
  void count(const at::TensorBase& t, bool made) {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (seen_.find(impl) != seen_.end()) return;
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    WeakImpl weak(t.getIntrusivePtr());
    kept_ += 1;
    bytes_ += nbytes;
    if (!made) {
      if (t.requires_grad()) {
        leaves_ += 1;
        leaf_bytes_ += nbytes;
      } else {
        unmade_.emplace_back(weak, nbytes);
      }
    }
    sweep();
    seen_.emplace(impl, std::move(weak));
  }

  // Forget the tensors that are gone (their weak references keep only the TensorImpl's object, never its
  // storage, and keep its address from being reused while here), once the map doubles.
  void sweep() {
    if (seen_.size() < limit_) return;
    for (auto it = seen_.begin(); it != seen_.end();) {
      it = it->second.expired() ? seen_.erase(it) : std::next(it);
    }
    limit_ = std::max<size_t>(kMinLimit, 2 * seen_.size());
  }

  static constexpr size_t kMinLimit = 1024;
  pybind11::object dense_;
  pybind11::dict python_cache_;
  int64_t min_numel_;
  std::unordered_set<std::string> python_nodes_;
  pybind11::object recent_;
  pybind11::object note_;
  std::unordered_set<std::string> compacts_;
  std::unordered_set<std::string> after_;
  pybind11::object deferred_;
  double share_;
  pybind11::object compacted_;
  std::unordered_map<c10::TensorImpl*, WeakImpl> seen_;
  size_t limit_ = kMinLimit;
  std::vector<std::pair<WeakImpl, int64_t>> unmade_;
  int64_t kept_ = 0, bytes_ = 0, leaves_ = 0, leaf_bytes_ = 0;
};

}  // namespace

void register_native_packer(pybind11::module_& m) {
  pybind11::class_<NativePacker>(m, "NativePacker",
                         "save_compact's pack hook, its C++ path: the saved tensors no form takes, kept as they are, "
                         "and CPU compactions at once (csrc/compact/hooks.cpp).")
      .def(pybind11::init<pybind11::object, pybind11::dict, int64_t, std::unordered_set<std::string>, pybind11::object,
                          pybind11::object, std::unordered_set<std::string>, std::unordered_set<std::string>,
                          pybind11::object, double, pybind11::object>(),
           pybind11::arg("dense"), pybind11::arg("python_cache"), pybind11::arg("min_numel"),
           pybind11::arg("python_nodes"), pybind11::arg("recent"), pybind11::arg("note"), pybind11::arg("compacts"),
           pybind11::arg("after"), pybind11::arg("deferred"),
           pybind11::arg("share"), pybind11::arg("compacted"))
      .def("keep", &NativePacker::keep, pybind11::arg("t"),
           "t kept as it is (a _Dense) and counted once, or compacted, or the form made of it before, again; "
           "None where the Python path decides.")
      .def("counted", &NativePacker::counted, pybind11::arg("t"), "Whether keep() counted t.")
      .def("take", &NativePacker::take, "(tensors, bytes, leaves, leaves' bytes) counted since the last call.")
      .def("outside", &NativePacker::outside,
           "(tensors, bytes) of the tensors counted since the last call that need no gradient and that something "
           "else still holds.");
}

}  // namespace relu_ext
