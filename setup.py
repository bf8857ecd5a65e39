"""Build relu_ext against the torch that is already installed.

Builds a CUDAExtension when torch has CUDA and nvcc is found, else a
CppExtension. Environment:
  RELU_EXT_FORCE_CPU=1   build the CPU kernels only
  RELU_EXT_SANITIZE=1    CPU kernels with AddressSanitizer + UndefinedBehaviorSanitizer
                         (implies FORCE_CPU; run with LD_PRELOAD=libasan, see Makefile)
  CUDA_HOME              CUDA toolkit (default: /usr/local/cuda when it has nvcc)
  TORCH_CUDA_ARCH_LIST   GPU archs (default: the visible GPUs', else "9.0")
  MAX_JOBS               parallel compile jobs (honoured by torch's ninja build)
"""

import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))

# torch.utils.cpp_extension reads CUDA_HOME when imported. Without it, torch
# follows `which nvcc`, which may be a wrapper script (e.g. /usr/local/bin/nvcc).
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit(
        "relu_ext builds against your installed PyTorch, and none was found.\n"
        "Install torch first, then: pip install --no-build-isolation -e ."
    )


SANITIZE = os.environ.get("RELU_EXT_SANITIZE", "0") == "1"


def want_cuda() -> bool:
    if os.environ.get("RELU_EXT_FORCE_CPU", "0") == "1" or SANITIZE:
        return False
    if torch.version.cuda is None:
        print("relu_ext: this torch has no CUDA; building CPU kernels only")
        return False
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        print("relu_ext: nvcc not found (set CUDA_HOME); building CPU kernels only")
        return False
    return True


def cuda_arch_list() -> str:
    # With no GPU visible and no list, torch's arch detection fails (IndexError).
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    return os.environ.get("TORCH_CUDA_ARCH_LIST", "detected")


def extension():
    sources = ["csrc/ops.cpp", "csrc/autograd.cpp", "csrc/module.cpp", "csrc/relu_cpu.cpp"]
    # -g0: Python's default CFLAGS carry -g, which doubles compile time.
    cxx, link = ["-O3", "-g0"], []
    if SANITIZE:
        # -O1 keeps the vector kernels (target attributes) while staying debuggable;
        # no recovery, so any UB report fails the process.
        san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
        cxx, link = ["-O1", "-g1"] + san, san
    if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
        # ATen's OpenMP at::parallel_for is an inline `#pragma omp parallel`:
        # without -fopenmp it runs on one thread. At run time libgomp.so.1
        # resolves to the copy torch has already loaded.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    if not want_cuda():
        return CppExtension("relu_ext._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=link)
    arch = cuda_arch_list()
    return CUDAExtension(
        "relu_ext._C",
        sources + ["csrc/relu_cuda.cu"],
        define_macros=[("WITH_CUDA", None), ("RELU_EXT_CUDA_ARCH", f'"{arch}"')],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-Xcompiler", "-g0"]},
        extra_link_args=link,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
