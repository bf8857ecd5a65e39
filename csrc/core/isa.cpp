// The run-time choice of the CPU kernel set (isa.h).
#include "core/isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

namespace relu_ext {
namespace {

const char* const kIsaNames[] = {"scalar", "avx2", "avx512"};

int best_isa() {
#ifdef RELU_EXT_X86
  // libgcc / compiler-rt also check that the OS saves the YMM / ZMM registers.
  __builtin_cpu_init();
  // F16C: the family's float16 kernels convert with it (every AVX2 CPU has it).
  if (!__builtin_cpu_supports("f16c")) return kScalar;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2")) {
    return kAvx512;
  }
  if (__builtin_cpu_supports("avx2")) return kAvx2;
#endif
  return kScalar;
}

int parse_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  for (int i = 0; i <= kAvx512; ++i) {
    if (name == kIsaNames[i]) {
      TORCH_CHECK(i <= best_isa(), "relu_ext: this CPU does not support the '", name,
                  "' kernels; the best it supports is '", kIsaNames[best_isa()], "'");
      return i;
    }
  }
  TORCH_CHECK(false, "relu_ext: unknown CPU kernel set '", name, "'; choose auto, scalar, avx2 or avx512");
}

// RELU_EXT_CPU_ISA may lower the choice (for testing or comparison); an invalid
// value is reported at the first kernel call rather than at import.
std::atomic<int>& isa_choice() {
  static std::atomic<int> choice{[] {
    const char* env = std::getenv("RELU_EXT_CPU_ISA");
    return env && *env ? parse_isa(env) : best_isa();
  }()};
  return choice;
}

}  // namespace

Isa cpu_kernels() { return static_cast<Isa>(isa_choice().load()); }

const char* cpu_isa() { return kIsaNames[cpu_kernels()]; }

void set_cpu_isa(const std::string& name) { isa_choice().store(parse_isa(name)); }

}  // namespace relu_ext
