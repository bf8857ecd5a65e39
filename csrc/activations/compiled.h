// Compiled autograd for the mask-saving nodes (MaskBackward<Act>, family.cpp):
// the call a node records into the graph being
// captured, as PyTorch's generated nodes do.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <optional>
#include <vector>

namespace relu_ext {

// Binds `fn` (the node's apply_functional_ivalue) under the node's name the
// first time (`bound`, one per node type), then records a call to it with
// `needs`, the mask, sizes, strides and `rest`, in that order: fn's packed
// arguments. The saved ones are swapped in for the capture and back after.
template <typename Fn, typename Needs, typename... Rest>
torch::autograd::variable_list record_apply(const torch::autograd::Node& node, const torch::autograd::variable_list& grads,
                                            torch::autograd::SwapSavedVariables& saved, bool& bound, Fn fn,
                                            const Needs& needs, torch::autograd::SavedVariable& mask,
                                            std::vector<c10::SymInt>& sizes, std::vector<c10::SymInt>& strides,
                                            const Rest&... rest) {
  namespace ca = torch::dynamo::autograd;
  saved.before(mask);
  saved.before(sizes);
  saved.before(strides);
  const auto& py = ca::getPyCompilerInterface();
  if (!bound) {
    bound = true;
    std::vector<at::TypePtr> schema = {ca::IValuePacker<Needs>::packed_type(), ca::IValuePacker<at::Tensor>::packed_type(),
                                       ca::IValuePacker<std::vector<c10::SymInt>>::packed_type(),
                                       ca::IValuePacker<std::vector<c10::SymInt>>::packed_type(),
                                       ca::IValuePacker<Rest>::packed_type()...};
    py->bind_function(saved.get_py_compiler(), node.name(), fn, schema);
  }
  ca::PackedArgs packed;
  packed.pack(needs);
  packed.pack(mask.unpack());
  packed.pack(sizes);
  packed.pack(strides);
  (packed.pack(rest), ...);
  const auto output_metadata = ca::IValuePacker<std::vector<std::optional<torch::autograd::InputMetadata>>>::pack(
      ca::get_input_metadata(node.next_edges()));
  auto result = py->call_function(saved.get_py_compiler(), "apply_functional", node.name(), grads,
                                  std::move(packed).vec(), output_metadata);
  saved.after(mask);
  saved.after(sizes);
  saved.after(strides);
  return result;
}

}  // namespace relu_ext
