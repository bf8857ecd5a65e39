"""Build facts: what this copy of relu_ext was compiled against and why.

``_build_config.py`` is written by setup.py beside the native module. It is
read before the native module loads: a C++ extension only works with the torch
major.minor it was compiled for, and loading it into another one ends in an
undefined-symbol error at best and a silent misbehaviour at worst.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import torch

try:
    from . import _build_config as _config
except ImportError:
    raise ImportError(
        f"relu_ext's native module is not built in {os.path.dirname(__file__)}. Build it against your "
        "installed torch, from the repository root: pip install --no-build-isolation -e ."
    ) from None


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def check_torch(running: str = torch.__version__, built: str = _config.TORCH_VERSION) -> None:
    """Raise ImportError when the running torch is not the major.minor relu_ext was built against."""
    if _major_minor(running) != _major_minor(built):
        raise ImportError(
            f"relu_ext was built against torch {built}, but torch {running} is installed; a C++ "
            "extension only loads into the torch major.minor it was compiled for. Rebuild relu_ext "
            "against this torch from its source (a checkout or the sdist): "
            "pip install --no-build-isolation --no-deps --force-reinstall ."
        )


def warn_if_gpu_unused(with_cuda: bool, gpu_visible: bool) -> None:
    """Warn when torch sees a GPU that this CPU-only build cannot use, saying why it is CPU-only."""
    if gpu_visible and not with_cuda:
        warnings.warn(
            f"relu_ext: torch sees a GPU, but this relu_ext build has CPU kernels only "
            f"({_config.CPU_ONLY_REASON}); CUDA tensors will raise. Rebuild with the CUDA toolkit "
            "present: pip install --no-build-isolation --no-deps --force-reinstall .",
            RuntimeWarning,
            stacklevel=2,
        )


def cuda_available() -> bool:
    """Whether relu_ext can run on a GPU here: its CUDA kernels are compiled in
    *and* torch sees a GPU (:func:`torch.cuda.is_available`).

    Read it as you would :func:`torch.cuda.is_available`; whether this build
    has CUDA kernels at all, GPU or not, is ``build_info()["cuda"]``. A build
    without CUDA kernels answers False without asking torch about GPUs.

    Returns:
        bool: True when CUDA tensors can go through relu_ext's kernels.

    Example::

        >>> device = "cuda" if relu_ext.cuda_available() else "cpu"
        >>> relu_ext.relu(torch.randn(4, device=device)).device.type == device
        True
    """
    from . import _C

    return bool(_C.with_cuda) and torch.cuda.is_available()


def build_info() -> dict[str, Any]:
    """How this extension was built and what it runs with.

    Returns:
        dict: ``cuda``: whether the CUDA kernels were compiled in (whether or
        not a GPU is visible now; :func:`cuda_available` asks both);
        ``cpu_only_reason``: why a build has no CUDA kernels (None when it
        has them); ``cuda_arch_list`` and ``cuda_arch_source``: the GPU
        architectures compiled for and where that list came from;
        ``cpu_isa``: the CPU kernel set in use; ``cuda_unroll``: the CUDA
        kernels' rows per warp and iteration, ``cuda_waves``: their grid
        cap in waves of resident blocks (0: none; both None without CUDA
        kernels);
        ``built_with_torch``, ``torch``, ``torch_cuda``: the torch compiled
        against, the one running, and its CUDA version.

    Example::

        >>> info = relu_ext.build_info()
        >>> info["cuda"], info["cpu_isa"]          # doctest: +SKIP
        (False, 'avx2')
    """
    from . import _C

    return {
        "cuda": bool(_C.with_cuda),
        "cpu_only_reason": _config.CPU_ONLY_REASON,
        "cuda_arch_list": _config.CUDA_ARCH_LIST,
        "cuda_arch_source": _config.CUDA_ARCH_SOURCE,
        "cpu_isa": _C.cpu_isa(),
        "cuda_unroll": _C.cuda_unroll() if _C.with_cuda else None,
        "cuda_waves": _C.cuda_waves() if _C.with_cuda else None,
        "built_with_torch": _config.TORCH_VERSION,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
