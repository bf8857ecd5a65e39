// The CUDA kernels' launch knobs, for tests and tuning (set from Python,
// module.cpp; kept in cuda_launch.cpp, a C++ file: nvcc would parse its
// headers once per GPU architecture); their use: cuda_launch.cuh. And the
// alignment test by which the entry points (*/cuda_host.cpp) pick the vector kernels.
#pragma once

#include <cstdint>

namespace relu_ext {

#ifdef WITH_CUDA
// Whether the vector kernels can take data at p (16-byte loads and stores).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Rows per warp and loop iteration when not set otherwise (set_cuda_unroll). 4:
// more bytes in flight per thread is what lets the 16-bit forwards approach a
// copy's bandwidth (docs/performance.md, "CUDA unroll").
constexpr int kDefaultUnroll = 4;
// Rows of 32 16-byte vectors a warp loads per loop iteration in the vector
// kernels (1, 2 or 4; all three are compiled).
int cuda_unroll();
void set_cuda_unroll(int64_t rows);
// Grid cap in waves of resident blocks (set_cuda_waves): 0, no cap (every
// block needed, each warp one group of rows, as PyTorch launches); W, at most
// W waves of resident blocks that grid-stride. 0 by default: the uncapped
// grids kept a higher DRAM rate on the same bytes (docs/performance.md, "CUDA
// grid cap").
int cuda_waves();
void set_cuda_waves(int64_t waves);
#endif

}  // namespace relu_ext
