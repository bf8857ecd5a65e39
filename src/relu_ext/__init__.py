"""relu_ext: a bit-exact drop-in ReLU for PyTorch with C++/CUDA kernels.

    import relu_ext
    model = nn.Sequential(nn.Linear(10, 10), relu_ext.ReLU())   # instead of nn.ReLU()
    y = relu_ext.relu(x)                                         # instead of F.relu(x)
    relu_ext.convert(model)                                      # every nn.ReLU in a model
    relu_ext.install()                                           # every ReLU the process runs
    with relu_ext.save_compact(): loss = model(x)                # ReLU outputs kept as mask + values

Importing the package loads the native library, which registers the
``torch.ops.relu_ext`` operators, and teaches the exporters about them.
"""

import torch as _torch

from . import _build

_build.check_torch()  # before the native module loads

from . import export as _export  # noqa: E402, F401  (registers the ONNX and decomposition hooks)
from ._build import build_info, cuda_available  # noqa: E402
from .compact import save_compact  # noqa: E402
from .dispatch import Installation, install, installed, uninstall  # noqa: E402
from .activations import (  # noqa: E402
    Hardsigmoid, Hardtanh, LeakyReLU, ReLU6, Threshold, hardsigmoid, hardtanh, leaky_relu, relu6, threshold,
)
from .dispatch import targets as install_targets  # noqa: E402
from .export import aten_decompositions  # noqa: E402
from .ops import ReLU, convert, relu, revert  # noqa: E402

__all__ = [
    "ReLU", "relu", "ReLU6", "relu6", "Hardtanh", "hardtanh", "LeakyReLU", "leaky_relu", "Threshold", "threshold",
    "Hardsigmoid", "hardsigmoid", "convert", "revert", "install", "uninstall", "installed", "install_targets",
    "Installation", "aten_decompositions", "save_compact", "cuda_available", "build_info",
]
__version__ = "0.1.0"

# Only a CPU-only build asks torch about GPUs (a CUDA build need not wake the driver).
if not cuda_available():
    _build.warn_if_gpu_unused(False, _torch.cuda.is_available())

# Pickles and reprs name the public path.
for _public in (ReLU, relu, ReLU6, relu6, Hardtanh, hardtanh, LeakyReLU, leaky_relu, Threshold, threshold, Hardsigmoid,
                hardsigmoid, Installation, install, uninstall, installed, install_targets, aten_decompositions,
                save_compact):
    _public.__module__ = __name__
