// save_compact's CUDA launches on raw pointers (cuda.cu), for its entry points
// on tensors (cuda_host.cpp: device guard, stream, the host's steps between
// kernels). Split as activations/cuda.h is: nvcc parses cuda.cu once per GPU
// architecture, without ATen's tensor headers.
#pragma once

#ifdef WITH_CUDA
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "activations/activations.h"

namespace relu_ext {

// Compaction of n > 0 elements of `width` bytes (2, 4 or 8) by a bitmap
// (compact/kernels.cuh); vec: the data is 16-byte aligned (the vector kernels).
// count: each tile's kept elements into counts (one int64 per tile);
// compact: the kept elements into values (total of them, from `ends`, the
// inclusive sum of the counts), the others that are not +0 counted in *missed;
// expand: the inverse into out; nonzero_mask: the bitmap of y's nonzero elements.
// The tiles of kTile elements that n elements take (count_launch's counts).
int64_t compact_tiles(int64_t n);
void count_launch(int64_t n, int device, cudaStream_t stream, const uint8_t* mask, int64_t* counts);
void compact_launch(int64_t width, bool vec, int64_t n, int device, cudaStream_t stream, const void* y,
                    const uint8_t* mask, const int64_t* ends, void* values, int64_t total, unsigned long long* missed);
void expand_launch(int64_t width, bool vec, int64_t n, int device, cudaStream_t stream, const void* values,
                   int64_t total, const uint8_t* mask, const int64_t* ends, void* out);
void nonzero_mask_launch(int64_t width, bool vec, int64_t n, int device, cudaStream_t stream, const void* y,
                         uint8_t* mask);

// One BatchNorm input of the replay: its data (null: none) and its terms in
// opmath (alpha = [weight; invstd], beta = [mean; bias], 2 x C).
struct BnData {
  const void* x;
  const void* alpha;
  const void* beta;
};
// The replay y = act(BN(x) [+ BN2(x2)]) of n > 0 elements of `dtype`, written
// to y, or with `differ` non-null only compared with it (*differ set to 1
// where an element differs).
void bn_act_launch(const std::string& act, c10::ArrayRef<double> args, c10::ScalarType dtype, BnData in, BnData in2,
                   int64_t inner, int64_t channels, int64_t n, int device, cudaStream_t stream, void* y, int* differ);

}  // namespace relu_ext
#endif
