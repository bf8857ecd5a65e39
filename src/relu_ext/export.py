"""What the exporters need to know about the relu_ext ops, registered at import.

- TorchScript-based ONNX export (``torch.onnx.export(..., dynamo=False)``): a
  symbolic that writes ``relu_ext::relu`` as a standard ``Relu`` node, and the
  family's ops as PyTorch's own symbolics write theirs (``Clip``,
  ``LeakyRelu``, ``HardSigmoid``, ...) (the JIT
  tracer records ``relu_`` as ``relu`` plus ``copy_``, see csrc/activations/family.cpp).
- ``torch.export``-based ONNX export (``dynamo=True``) and anything else that
  decomposes with ``torch._decomp.decomposition_table``: ``relu`` decomposes
  to ``aten.relu``, which exporters know. (Exported programs hold no
  ``relu_``: functionalization turns it into ``relu``, see csrc/activations/family.cpp.)
- :func:`aten_decompositions`: a table for ``ExportedProgram.run_decompositions``
  that lowers relu_ext's ops to aten, so a saved program loads without relu_ext.
- Inductor: runs the ops that have a decomposition as what they are (a fallback
  kernel, as for any op it has no lowering for). Its implicit fallback refuses an op
  with a decomposition when the ``CI`` environment variable is set ("make_fallback:
  a decomposition exists"), so the fallbacks are made explicitly, once
  ``torch._inductor.lowering`` is imported (importing it here would add seconds to
  ``import relu_ext``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
import torch.onnx
import torch.onnx.symbolic_opset9
import torch.onnx.symbolic_opset11
from torch import Tensor

from .activations import ACTIVATIONS  # (loads the native library: the ops must exist first)

_ONNX_MIN_OPSET = 7  # the oldest opset the TorchScript exporter targets; Relu has been in ONNX since opset 1


def _relu_symbolic(g: torch._C.Graph, x: torch._C.Value) -> torch._C.Value:
    return g.op("Relu", x)


# Below opset 9, where PyTorch's symbolics start: ONNX has had Relu since opset 1.
torch.onnx.register_custom_op_symbolic("relu_ext::relu", _relu_symbolic, _ONNX_MIN_OPSET)


def _exporters(name: str) -> None:
    """An activation's decompositions to its aten op, and PyTorch's own ONNX symbolic for that op."""
    aten, aten_ = getattr(torch.ops.aten, name).default, getattr(torch.ops.aten, f"{name}_").default
    ours, ours_ = getattr(torch.ops.relu_ext, name).default, getattr(torch.ops.relu_ext, f"{name}_").default

    def decomposition(x: Tensor, *args: Any) -> Tensor:
        return aten(x, *args)

    def inplace_decomposition(x: Tensor, *args: Any) -> None:
        aten_(x, *args)

    torch._decomp.register_decomposition(ours)(decomposition)
    _DECOMPOSED.append(ours)
    _TABLE[ours], _TABLE[ours_] = decomposition, inplace_decomposition
    # PyTorch's own symbolics, each from the opset that introduced it (Clip
    # takes its bounds as inputs from opset 11 on), so both exporters write
    # exactly what they write for PyTorch's op.
    for opset, module in ((9, torch.onnx.symbolic_opset9), (11, torch.onnx.symbolic_opset11)):
        symbolic = getattr(module, name, None)
        if symbolic is not None:
            torch.onnx.register_custom_op_symbolic(f"relu_ext::{name}", symbolic, opset)


_TABLE: dict[torch._ops.OpOverload, Callable[..., Any]] = {}
_DECOMPOSED: list[torch._ops.OpOverload] = []  # in torch's decomposition table
for _act in ACTIVATIONS:
    _exporters(_act.name)


def _inductor_fallbacks(lowering: ModuleType) -> None:
    """Makes inductor's fallback for each op with a decomposition, with the layout constraint its
    implicit fallback would give (from the op's tags), unless something already lowers it."""
    from torch._library import utils

    names = ("lowerings", "make_fallback", "tag_to_layout_constraint")
    if not all(hasattr(lowering, n) for n in names) or not hasattr(utils, "get_layout_constraint_tag"):
        return  # a torch without them: its own implicit fallback stands, rather than a failed inductor import
    for op in _DECOMPOSED:
        if op not in lowering.lowerings:
            constraint = lowering.tag_to_layout_constraint(utils.get_layout_constraint_tag(op, with_default=True))
            lowering.make_fallback(op, constraint, warn=False)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once, after the module named `name` is imported (at once if it
    already is): the other finders find it, and its loader's exec_module is wrapped."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then
        self.exec_module: "Callable[[ModuleType], None] | None" = None  # the module's loader's
        if name in sys.modules:
            then(sys.modules[name])
        else:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: "Sequence[str] | None", target: "ModuleType | None" = None
                  ) -> "importlib.machinery.ModuleSpec | None":
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            self.exec_module = spec.loader.exec_module
            spec.loader.exec_module = self._exec_module  # type: ignore[method-assign]
        return spec

    def _exec_module(self, module: ModuleType) -> None:
        assert self.exec_module is not None
        self.exec_module(module)
        self.then(module)


_AfterImport("torch._inductor.lowering", _inductor_fallbacks)


def aten_decompositions() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """PyTorch's default decompositions plus relu_ext's public ops lowered to aten.

    ``relu`` becomes ``aten.relu``, ``hardtanh`` ``aten.hardtanh``, and so on,
    in-place forms included. ``run_decompositions()`` without it keeps
    ``relu_ext.relu``, which a process without relu_ext cannot load. The
    training pieces ``relu_fwd`` / ``relu_bwd`` have no aten form;
    ``torch.export`` does not record them.

    Returns:
        A decomposition table for ``ExportedProgram.run_decompositions``.

    Example::

        ep = torch.export.export(model, (x,)).run_decompositions(relu_ext.aten_decompositions())
        torch.export.save(ep, "model.pt2")      # aten ops only: loads without relu_ext
    """
    table = dict(torch.export.default_decompositions())
    table.update(_TABLE)
    return table
