"""relu_ext: a bit-exact drop-in ReLU (and ReLU6, Hardtanh, LeakyReLU, Threshold,
Hardsigmoid) for PyTorch, with C++/CUDA kernels whose backward keeps a 1-bit mask.

Four ways in, from the narrowest::

    y = relu_ext.relu(x)                  # instead of F.relu(x); relu6, leaky_relu... alike
    layer = relu_ext.ReLU()               # instead of nn.ReLU(); ReLU6, LeakyReLU... alike
    relu_ext.convert(model)               # swap a model's nn.ReLU... modules (revert() undoes it)
    relu_ext.install()                    # every ReLU... the process runs (uninstall() undoes it)

and ``with relu_ext.save_compact() as sc:`` keeps ReLU outputs saved for
backward as a bitmap plus their nonzero values (``sc.report()`` says what it
saved). ``cuda_available()`` and ``build_info()`` describe this build.

Each name in ``relu_ext.__all__`` has its own documentation:
``help(relu_ext.convert)``, ``help(relu_ext.save_compact)``... Importing the
package loads the native library, which registers the ``torch.ops.relu_ext``
operators (a TorchScript archive of a converted model needs it: see
:func:`convert`), and teaches the exporters about them.
"""

import torch as _torch

from . import _build

_build.check_torch()  # before the native module loads

from . import _C  # noqa: E402  (the native module: registers the torch.ops.relu_ext operators)
from . import export as _export  # noqa: E402, F401  (registers the ONNX and decomposition hooks)
from ._build import build_info, cuda_available  # noqa: E402
from .compact import save_compact  # noqa: E402
from .dispatch import Installation, install, installed, uninstall  # noqa: E402
from . import activations as _activations  # noqa: E402
from .activations import *  # noqa: E402, F401, F403  (the table's functions and modules: activations.__all__)
from .dispatch import targets as install_targets  # noqa: E402
from .export import aten_decompositions  # noqa: E402
from .swap import convert, revert  # noqa: E402
from .swap import _pairs as _module_pairs  # noqa: E402
from . import quantization as _quantization  # noqa: E402

_quantization.register(_module_pairs())  # eager-mode quantization's tables learn relu_ext's modules

__all__ = [
    *_activations.__all__, "convert", "revert", "install", "uninstall", "installed", "install_targets",
    "Installation", "aten_decompositions", "save_compact", "cuda_available", "build_info",
]
__version__ = "0.1.0"

# Only a build without CUDA kernels asks torch about GPUs, to warn that one goes
# unused: in a CUDA build torch.cuda.is_available() would initialize the CUDA
# driver (cuInit) at import, which takes time and leaves processes forked
# afterwards unable to use CUDA. Hence the build fact here, not cuda_available()
# (which asks torch whenever the kernels are compiled in).
if not _C.with_cuda:
    _build.warn_if_gpu_unused(False, _torch.cuda.is_available())

# Pickles and reprs name the public path.
for _name in __all__:
    globals()[_name].__module__ = __name__
