// The activations' CUDA launches on raw pointers (cuda.cu), for their entry
// points on tensors (cuda_host.cpp: device guard, stream, alignment). Split
// so that cuda.cu includes no ATen tensor headers: nvcc parses a .cu once per
// GPU architecture, and those headers were most of its time.
#pragma once

#ifdef WITH_CUDA
#include <cuda_runtime_api.h>

#include <cstdint>

#include "activations/activations.h"

namespace relu_ext {

// An activation's forward and backward on a float dtype, n > 0 elements;
// vec: every pointer is 16-byte aligned (the vector kernels). ReLU's are its
// own kernels on the raw bits, the family's the generic ones.
template <typename Act>
void act_forward_launch(c10::ScalarType dtype, bool vec, int64_t n, int device, cudaStream_t stream, const void* x,
                        void* y, uint8_t* mask, const ActArgs& args);
template <typename Act>
void act_backward_launch(c10::ScalarType dtype, bool vec, int64_t n, int device, cudaStream_t stream,
                         const void* grad, const uint8_t* mask, void* grad_in, const ActArgs& args);
template <>
void act_forward_launch<Relu>(c10::ScalarType dtype, bool vec, int64_t n, int device, cudaStream_t stream,
                              const void* x, void* y, uint8_t* mask, const ActArgs& args);
template <>
void act_backward_launch<Relu>(c10::ScalarType dtype, bool vec, int64_t n, int device, cudaStream_t stream,
                               const void* grad, const uint8_t* mask, void* grad_in, const ActArgs& args);
// ReLU on an integer dtype, n > 0 elements.
void relu_int_launch(c10::ScalarType dtype, int64_t n, int device, cudaStream_t stream, const void* x, void* y);

}  // namespace relu_ext
#endif
