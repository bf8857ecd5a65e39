"""What the exporters need to know about the relu_ext ops, registered at import.

- TorchScript-based ONNX export (``torch.onnx.export(..., dynamo=False)``): a
  symbolic that writes ``relu_ext::relu`` as a standard ``Relu`` node (the JIT
  tracer records ``relu_`` as ``relu`` plus ``copy_``, see csrc/ops.cpp).
- ``torch.export``-based ONNX export (``dynamo=True``) and anything else that
  decomposes with ``torch._decomp.decomposition_table``: ``relu`` decomposes
  to ``aten.relu``, which exporters know. (Exported programs hold no
  ``relu_``: functionalization turns it into ``relu``, see csrc/ops.cpp.)
"""

from __future__ import annotations

import torch
import torch.onnx
from torch import Tensor

from . import ops  # noqa: F401  (loads the native library: the ops must exist first)

_ONNX_MIN_OPSET = 7  # the oldest opset the TorchScript exporter targets; Relu has been in ONNX since opset 1


def _relu_symbolic(g: torch._C.Graph, x: torch._C.Value) -> torch._C.Value:
    return g.op("Relu", x)


torch.onnx.register_custom_op_symbolic("relu_ext::relu", _relu_symbolic, _ONNX_MIN_OPSET)


@torch._decomp.register_decomposition(torch.ops.relu_ext.relu.default)
def _relu_decomposition(x: Tensor) -> Tensor:
    return torch.ops.aten.relu.default(x)
