"""relu_ext: a bit-exact drop-in ReLU for PyTorch with C++/CUDA kernels.

    import relu_ext
    model = nn.Sequential(nn.Linear(10, 10), relu_ext.ReLU())   # instead of nn.ReLU()
    y = relu_ext.relu(x)                                         # instead of F.relu(x)
    relu_ext.convert(model)                                      # every nn.ReLU in a model

Importing the package loads the native library, which registers the
``torch.ops.relu_ext`` operators, and teaches the exporters about them.
"""

from . import export as _export  # noqa: F401  (registers the ONNX and decomposition hooks)
from .ops import ReLU, build_info, convert, cuda_available, relu, revert

__all__ = ["ReLU", "relu", "convert", "revert", "cuda_available", "build_info"]
__version__ = "0.1.0"

# Pickles and reprs name the public path.
ReLU.__module__ = __name__
relu.__module__ = __name__
