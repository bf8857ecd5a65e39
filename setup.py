"""Build relu_ext against the torch that is already installed.

Builds a CUDAExtension when torch has CUDA and nvcc is found, else a
CppExtension, and pins the distribution to the torch major.minor it was
compiled against. Environment:
  RELU_EXT_FORCE_CPU=1   build the CPU kernels only
  RELU_EXT_SANITIZE=1    CPU kernels with AddressSanitizer + UndefinedBehaviorSanitizer
                         (implies FORCE_CPU; run with LD_PRELOAD=libasan, see Makefile)
  CUDA_HOME              CUDA toolkit (default: /usr/local/cuda when it has nvcc)
  TORCH_CUDA_ARCH_LIST   GPU archs (default: the visible GPUs', else DEFAULT_ARCHS for a
                         wheel or an install, DEV_ARCH for a development build)
  MAX_JOBS               parallel compile jobs (honoured by torch's ninja build)

Without torch only metadata and the sdist can be made: pip's default isolated
build environment has no torch, so a wheel needs `--no-build-isolation`.
"""

import glob
import os
import re
import shlex
import subprocess
import sys

from setuptools import setup

# torch.utils.cpp_extension reads CUDA_HOME when imported. Without it, torch
# follows `which nvcc`, which may be a wrapper script (e.g. /usr/local/bin/nvcc).
if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"

# Commands that need no compiler and no torch.
METADATA_ONLY = {"egg_info", "dist_info", "sdist", "check", "clean", "--version", "--name", "--help"}
NO_TORCH = """
relu_ext compiles against the PyTorch it will run with, and this build environment has no torch.
pip builds in an isolated environment by default, which holds only the build requirements, and
torch is deliberately not one of them (a C++ extension must match the installed torch's ABI).
Install torch first, then build in your environment:
    pip install --no-build-isolation .        (or -e . for development)
    python -m build --wheel --no-isolation
"""

# GPUs people have (T4, A100, RTX 30xx/A10, L4/RTX 40xx, H100, B200, RTX 50xx),
# as far as nvcc supports them; the newest also as PTX for later GPUs.
DEFAULT_ARCHS = ["7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0"]
# A development build (`pip install -e .`, `setup.py build_ext --inplace` or `develop`) with no
# GPU visible compiles one architecture: seven take minutes, and one is enough to link, to read
# the SASS (test_cuda_codegen reads sm_90's) and to run on the H100s and H200s the GPU checks use.
DEV_ARCH = "9.0"
DEV_BUILD = bool({"editable_wheel", "develop", "--inplace"} & set(sys.argv[1:]))

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    torch = None
    if not set(sys.argv[1:]) & METADATA_ONLY:
        sys.exit(NO_TORCH)

SANITIZE = os.environ.get("RELU_EXT_SANITIZE", "0") == "1"


def cpu_only_reason() -> "str | None":
    """Why this build has no CUDA kernels, or None when it gets them."""
    if os.environ.get("RELU_EXT_FORCE_CPU", "0") == "1":
        return "RELU_EXT_FORCE_CPU=1 was set"
    if SANITIZE:
        return "RELU_EXT_SANITIZE=1 (sanitizer builds are CPU-only)"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} has no CUDA"
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return "nvcc was not found (set CUDA_HOME to a CUDA toolkit)"
    return None


def nvcc_archs() -> "set[str]":
    """The real architectures the installed nvcc can compile for, as '9.0'-style strings."""
    out = subprocess.run([os.path.join(CUDA_HOME, "bin", "nvcc"), "--list-gpu-code"],
                         capture_output=True, text=True, check=True).stdout
    return {f"{m[:-1]}.{m[-1]}" for m in re.findall(r"sm_(\d+)\b", out)}


def cuda_arch_list() -> "tuple[str, str]":
    """(TORCH_CUDA_ARCH_LIST for this build, where it came from)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"], "TORCH_CUDA_ARCH_LIST"
    known = nvcc_archs()
    if torch.cuda.is_available():
        caps = {"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
        # A GPU newer than nvcc gets nvcc's newest architecture, run through PTX.
        archs = sorted({c if c in known else max(known, key=float) for c in caps}, key=float)
        return ";".join(archs) + "+PTX", "the GPUs visible at build time"
    # With no GPU visible and no list, torch's arch detection fails (IndexError).
    if DEV_BUILD:
        return DEV_ARCH, "development build: no GPU visible at build time"
    archs = [a for a in DEFAULT_ARCHS if a in known]
    return ";".join(archs) + "+PTX", "default: no GPU visible at build time"


def torch_requirement() -> str:
    """The torch this build is compiled against, as a requirement: same major.minor."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return f"torch=={major}.{minor}.*"


def loaded_libstdcxx() -> "str | None":
    """The libstdc++ this process (so torch) runs with, from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split()[-1] for line in f if "/libstdc++.so" in line]
    except OSError:
        return None
    return paths[0] if paths else None


def shared_libstdcxx_args() -> "list[str]":
    """Link arguments that keep libstdc++ a shared library.

    A compiler with no shared libstdc++ of its own (seen on a GPU image whose
    CC / CXX were /opt/gcc/bin/g++) links its static libstdc++.a into _C.so:
    a second libstdc++ beside the one torch loaded. Streams then mix the two
    copies' locales, and the first error message that formats an integer
    crashed the process (segfault in ostream::_M_insert<long>). Naming the
    libstdc++ torch runs with makes the linker take it, dynamically.
    """
    if not sys.platform.startswith("linux"):
        return []
    for compiler in {os.environ.get("CXX") or "c++", os.environ.get("CC") or "c++"}:
        try:
            found = subprocess.run([*shlex.split(compiler), "-print-file-name=libstdc++.so"],
                                   capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError, ValueError):
            continue
        if found and not os.path.isabs(found):  # the bare name: this compiler has no shared libstdc++
            lib = loaded_libstdcxx()
            if lib:
                print(f"relu_ext: {compiler} has no shared libstdc++; linking {lib} (torch's) instead of "
                      "its static one")
                return [lib]
    return []


def needed_libraries(path: str) -> "list[str] | None":
    """The DT_NEEDED entries of a shared object (readelf -d), or None without readelf."""
    try:
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


# ninja starts the compiles in the order it is given them: the longest first, so that at the end no
# core idles while the other finishes one of them (the CUDA files, compiled once per architecture;
# the replay and family kernels, once per instruction set; the module, with torch's Python
# headers). The rest follow by name.
SLOWEST_FIRST = ["csrc/compact/cuda.cu", "csrc/activations/cuda.cu", "csrc/compact/replay_cpu.cpp",
                 "csrc/activations/family.cpp", "csrc/core/module.cpp"]


def build_order(sources: "list[str]") -> "list[str]":
    """`sources` in the order ninja should start them (SLOWEST_FIRST, then by name)."""
    missing = set(SLOWEST_FIRST) - set(glob.glob("csrc/*/*"))
    if missing:
        sys.exit(f"setup.py: SLOWEST_FIRST names {sorted(missing)}, which csrc/ does not have")
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    return sorted(sources, key=lambda s: (rank.get(s, len(rank)), s))


class SlowestFirst:
    """A compiler's compile(), given its sources in build_order: setuptools sorts an extension's
    sources by name before it compiles them. The objects come back in the order of the sources it
    was called with, so the link line stays as it was."""

    def __init__(self, compile_) -> None:
        self.compile = compile_

    def __call__(self, sources, *args, **kwargs):
        ordered = build_order(list(sources))
        objects = dict(zip(ordered, self.compile(ordered, *args, **kwargs)))
        return [objects[s] for s in sources]


def extension(reason: "str | None", arch: "str | None"):
    # csrc/core (shared), csrc/activations and csrc/compact (save_compact); includes are from csrc/.
    sources = sorted(glob.glob("csrc/*/*.cpp"))
    include = [os.path.abspath("csrc")]
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
    link += shared_libstdcxx_args()
    if reason is not None:
        return CppExtension("relu_ext._C", sources, include_dirs=include, extra_compile_args={"cxx": cxx},
                            extra_link_args=link)
    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    return CUDAExtension(
        "relu_ext._C",
        sources + sorted(glob.glob("csrc/*/*.cu")),
        include_dirs=include,
        define_macros=[("WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-Xcompiler", "-g0"]},
        extra_link_args=link,
    )


if torch is None:  # metadata or sdist only
    setup(install_requires=["torch"])
else:
    REASON = cpu_only_reason()
    ARCH, ARCH_SOURCE = cuda_arch_list() if REASON is None else (None, None)
    CONFIG = {
        "TORCH_VERSION": torch.__version__,
        "CPU_ONLY_REASON": REASON,
        "CUDA_ARCH_LIST": ARCH,
        "CUDA_ARCH_SOURCE": ARCH_SOURCE,
    }

    NATIVE_TEMP = os.path.join("build", "native", f"torch-{torch.__version__}-{sys.implementation.cache_tag}")

    class build_ext(BuildExtension.with_options(use_ninja=True)):
        """torch's build, then `_build_config.py` beside the native module.

        The package reads it before it loads the native module, so a torch
        of another major.minor gets a clear ImportError instead of a crash.

        The objects stay in one folder per torch and Python (NATIVE_TEMP), whichever
        command builds: ninja then compiles again only what changed, by content of the
        command line or by the files it read. A development build after an edit redoes
        one file, and the release wheel built in the same tree after it compiles only the
        CUDA files again, for its longer list of architectures (pip's editable build
        would otherwise use a new temporary folder each time).
        """

        def finalize_options(self) -> None:
            super().finalize_options()
            self.build_temp = NATIVE_TEMP

        def build_extension(self, ext) -> None:
            compile_ = self.compiler.compile  # (torch's ninja build, set by build_extensions)
            self.compiler.compile = SlowestFirst(compile_)
            try:
                super().build_extension(ext)
            finally:
                self.compiler.compile = compile_

        def run(self) -> None:
            super().run()
            needed = needed_libraries(self.get_ext_fullpath("relu_ext._C")) if sys.platform.startswith("linux") else None
            if needed is not None and not any(n.startswith("libstdc++.so") for n in needed):
                sys.exit("relu_ext: the compiler linked libstdc++ statically into relu_ext._C (a second copy beside "
                         "torch's, which crashes at the first error message). Build with a compiler that links it "
                         "as a shared library, e.g. CC=gcc CXX=g++ (the system's).")
            path = os.path.join(os.path.dirname(self.get_ext_fullpath("relu_ext._C")), "_build_config.py")
            with open(path, "w") as f:
                f.write("# Written by setup.py when relu_ext._C was built. Do not edit.\n")
                f.writelines(f"{k} = {v!r}\n" for k, v in CONFIG.items())

    setup(
        install_requires=[torch_requirement()],
        ext_modules=[extension(REASON, ARCH)],
        cmdclass={"build_ext": build_ext},
    )
