// The CUDA kernels' launch knobs, for tests and tuning (set from Python,
// module.cpp); their use: cuda_launch.cuh.
#pragma once

#include <cstdint>

namespace relu_ext {

#ifdef WITH_CUDA
// Rows of 32 16-byte vectors a warp loads per loop iteration in the vector
// kernels (1, 2 or 4; all three are compiled).
int cuda_unroll();
void set_cuda_unroll(int64_t rows);
// Grid cap in waves of resident blocks (0: no cap).
int cuda_waves();
void set_cuda_waves(int64_t waves);
#endif

}  // namespace relu_ext
