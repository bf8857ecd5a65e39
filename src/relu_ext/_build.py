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
    """True when the CUDA kernels were compiled into this build."""
    from . import _C

    return bool(_C.with_cuda)


def build_info() -> dict[str, Any]:
    """How this extension was built and what it runs with.

    ``cpu_only_reason`` says why a build has no CUDA kernels (None when it has
    them); ``cuda_arch_source`` where its GPU architecture list came from;
    ``cuda_unroll`` the CUDA kernels' rows per warp and iteration (None
    without CUDA kernels).
    """
    from . import _C

    return {
        "cuda": bool(_C.with_cuda),
        "cpu_only_reason": _config.CPU_ONLY_REASON,
        "cuda_arch_list": _config.CUDA_ARCH_LIST,
        "cuda_arch_source": _config.CUDA_ARCH_SOURCE,
        "cpu_isa": _C.cpu_isa(),
        "cuda_unroll": _C.cuda_unroll() if _C.with_cuda else None,
        "built_with_torch": _config.TORCH_VERSION,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
