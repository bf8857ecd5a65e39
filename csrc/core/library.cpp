// The library relu_ext's ops live in. Each subsystem adds its own ops with
// their schema (TORCH_LIBRARY_FRAGMENT): the activations in
// activations/family.cpp, save_compact's in compact/ops.cpp.
#include <torch/library.h>

TORCH_LIBRARY(relu_ext, m) {}
