"""What the exporters need to know about the relu_ext ops, registered at import.

- TorchScript-based ONNX export (``torch.onnx.export(..., dynamo=False)``): a
  symbolic that writes ``relu_ext::relu`` as a standard ``Relu`` node (the JIT
  tracer records ``relu_`` as ``relu`` plus ``copy_``, see csrc/ops.cpp).
- ``torch.export``-based ONNX export (``dynamo=True``) and anything else that
  decomposes with ``torch._decomp.decomposition_table``: ``relu`` decomposes
  to ``aten.relu``, which exporters know. (Exported programs hold no
  ``relu_``: functionalization turns it into ``relu``, see csrc/ops.cpp.)
- :func:`aten_decompositions`: a table for ``ExportedProgram.run_decompositions``
  that lowers relu_ext's ops to aten, so a saved program loads without relu_ext.
"""

from __future__ import annotations

from typing import Any, Callable

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


def _relu_inplace_decomposition(x: Tensor) -> None:
    torch.ops.aten.relu_.default(x)


def aten_decompositions() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """PyTorch's default decompositions plus relu_ext's ``relu`` / ``relu_`` lowered to ``aten.relu`` / ``aten.relu_``.

    For an exported program that must load where relu_ext is not installed::

        ep = torch.export.export(model, args).run_decompositions(relu_ext.aten_decompositions())
        torch.export.save(ep, "model.pt2")      # holds aten.relu, no relu_ext op

    (``run_decompositions()`` without it keeps ``relu_ext.relu``, which a
    process without relu_ext cannot load.) The training pieces ``relu_fwd``
    / ``relu_bwd`` have no aten form; ``torch.export`` does not record them.
    """
    table = dict(torch.export.default_decompositions())
    table[torch.ops.relu_ext.relu.default] = _relu_decomposition
    table[torch.ops.relu_ext.relu_.default] = _relu_inplace_decomposition
    return table
