// The CPU kernel sets and the one choice among them. Every CPU kernel file
// compiles its vector code under the target macros below and asks
// cpu_kernels() (or pick()) which set runs, so one binary runs on any x86-64
// CPU; no -march flag is needed or wanted.
//
// The sets: portable C++, AVX2 (with F16C, which every AVX2 CPU has) and
// AVX-512 with BW, VL and VBMI2 (16-bit lanes, compress / expand), as on Zen 4
// and Ice Lake on. The choice is made at run time (best_isa in isa.cpp) and
// may be lowered with set_cpu_isa or RELU_EXT_CPU_ISA.
#pragma once

#include <string>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define RELU_EXT_X86 1
#include <immintrin.h>
// The targets. The activations' and compaction's kernels take no FMA: a
// contracted a * b + c would round differently from PyTorch. The BatchNorm
// replay takes it (with fp-contract off, only its explicit fma), as PyTorch's
// CPU BatchNorm kernels are built with it; it also checks the CPU has it.
#define RELU_EXT_AVX2 __attribute__((target("avx2,f16c,popcnt")))
#define RELU_EXT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt")))
#define RELU_EXT_AVX2_FMA __attribute__((target("avx2,f16c,fma")))
#define RELU_EXT_AVX512_FMA __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,fma")))
// AVX512_BF16's conversion (and DQ's fpclass): the bfloat16 replay's own 512-bit code.
#define RELU_EXT_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

namespace relu_ext {

// Each set needs more of the CPU than the one before.
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
// The set in use: serves every CPU kernel.
Isa cpu_kernels();
const char* cpu_isa();  // its name
// "auto" (the best this CPU has), "scalar", "avx2" or "avx512"; an error names
// a set the CPU lacks.
void set_cpu_isa(const std::string& name);

// The kernel of the set in use, for kernels of one signature per set:
// `avx512` where that set runs and one is given, else `avx2` where AVX2 or
// better runs, else `scalar`. On other CPUs only `scalar` exists: pass
// nullptr for the others (RELU_EXT_X86_ONLY).
template <typename Fn>
Fn pick(Fn scalar, Fn avx2, Fn avx512 = nullptr) {
  const Isa set = cpu_kernels();
  if (avx512 != nullptr && set == kAvx512) return avx512;
  if (avx2 != nullptr && set >= kAvx2) return avx2;
  return scalar;
}

}  // namespace relu_ext

#ifdef RELU_EXT_X86
#define RELU_EXT_X86_ONLY(fn) (fn)
#else
#define RELU_EXT_X86_ONLY(fn) nullptr
#endif
