"""relu_ext: a bit-exact drop-in ReLU for PyTorch with C++/CUDA kernels.

    import relu_ext
    model = nn.Sequential(nn.Linear(10, 10), relu_ext.ReLU())   # instead of nn.ReLU()
    y = relu_ext.relu(x)                                         # instead of F.relu(x)

Importing the package loads the native library, which registers the
``torch.ops.relu_ext`` operators.
"""

from .ops import ReLU, build_info, cuda_available, relu

__all__ = ["ReLU", "relu", "cuda_available", "build_info"]
__version__ = "0.1.0"

# Pickles and reprs name the public path.
ReLU.__module__ = __name__
relu.__module__ = __name__
