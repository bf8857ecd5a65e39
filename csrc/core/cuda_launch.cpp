// The launch knobs' setters and getters (cuda_launch.h).
#include "core/cuda_launch.h"

#ifdef WITH_CUDA
#include <c10/util/Exception.h>

#include <atomic>

namespace relu_ext {

namespace {
std::atomic<int> g_unroll{kDefaultUnroll};
std::atomic<int> g_waves{0};
}  // namespace

int cuda_unroll() { return g_unroll.load(std::memory_order_relaxed); }

void set_cuda_unroll(int64_t rows) {
  TORCH_CHECK_VALUE(rows == 1 || rows == 2 || rows == 4, "relu_ext: set_cuda_unroll takes 1, 2 or 4 rows per warp, not ",
              rows);
  g_unroll.store(static_cast<int>(rows), std::memory_order_relaxed);
}

int cuda_waves() { return g_waves.load(std::memory_order_relaxed); }

void set_cuda_waves(int64_t waves) {
  TORCH_CHECK_VALUE(waves >= 0 && waves <= 64, "relu_ext: set_cuda_waves takes 0 (no cap) to 64 waves, not ", waves);
  g_waves.store(static_cast<int>(waves), std::memory_order_relaxed);
}

}  // namespace relu_ext
#endif
