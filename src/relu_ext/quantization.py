"""Eager-mode quantization sees relu_ext's modules as the ``torch.nn`` classes they replace.

``torch.ao.quantization`` matches modules by their exact type: fusion
(``fuse_modules``, ``fuse_modules_qat``, torchvision's ``fuse_model()``) looks
up tuples such as ``(Conv2d, BatchNorm2d, ReLU)``; ``prepare`` and ``convert``
map ``ReLU6`` and ``LeakyReLU`` to quantized modules and give ``Hardsigmoid``
its fixed-range observer. At import, every entry of those tables that names a
class :func:`relu_ext.convert` replaces gets a twin that names relu_ext's
class and does what the entry does: a fuser is handed PyTorch's own module in
place of relu_ext's (the fused module is the one PyTorch builds), and the
quantized module is built from relu_ext's module as from PyTorch's.

FX graph mode quantization matches patterns of its own and is not taught:
``prepare_fx`` / ``prepare_qat_fx`` on a converted model raise an error that
says to :func:`relu_ext.revert` the model first (:func:`refuse_fx_tracing`).

Every read of ``torch.ao.quantization``'s tables is here (checked on torch
2.11, 2.14 and 2.15).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from torch.ao.quantization import fuser_method_mappings, quantization_mappings


def _as_torch(twins: dict[type, type], module: torch.nn.Module) -> torch.nn.Module:
    """PyTorch's module in place of a relu_ext module (same arguments, flags and hooks), else ``module``."""
    cls = twins.get(type(module))
    if cls is None:
        return module
    theirs = cls.__new__(cls)
    theirs.__dict__.update(module.__dict__)
    return theirs


def _fuser(twins: dict[type, type], fuse: Callable[..., Any]) -> Callable[..., Any]:
    """``fuse`` (a fuser method: ``fuse(is_qat, *modules)``) handed PyTorch's modules."""

    def fuse_relu_ext(is_qat: bool, *modules: torch.nn.Module) -> Any:
        return fuse(is_qat, *(_as_torch(twins, m) for m in modules))

    return fuse_relu_ext


def register(pairs: list[tuple[type, type]]) -> None:
    """Teach the tables about relu_ext's classes; ``pairs``: (torch.nn class, relu_ext class)."""
    ours = {theirs: mine for theirs, mine in pairs}
    twins = {mine: theirs for theirs, mine in pairs}
    table = fuser_method_mappings._DEFAULT_OP_LIST_TO_FUSER_METHOD
    for key, fuse in list(table.items()):
        if any(cls in ours for cls in key):
            for variant in itertools.product(*[(cls, ours[cls]) if cls in ours else (cls,) for cls in key]):
                if variant != key:
                    table.setdefault(variant, _fuser(twins, fuse))
    for name in dir(quantization_mappings):
        mapping = getattr(quantization_mappings, name)
        if name.startswith("DEFAULT_") and isinstance(mapping, dict):
            for theirs, mine in pairs:
                if theirs in mapping:
                    mapping.setdefault(mine, mapping[theirs])


def refuse_fx_tracing(input: object, name: str) -> None:
    """Raise where FX graph mode quantization traces relu_ext's function ``name``: its patterns
    match PyTorch's activations only, so the model would quantize otherwise than unconverted."""
    if not isinstance(input, torch.fx.Proxy):
        return
    from torch.ao.quantization.fx.tracer import QuantizationTracer

    if isinstance(input.tracer, QuantizationTracer):
        raise RuntimeError(
            f"relu_ext.{name}: FX graph mode quantization (prepare_fx, prepare_qat_fx) matches PyTorch's "
            "activations only and would not fuse or observe relu_ext's; call relu_ext.revert(model) before "
            "it (eager-mode quantization takes converted models as they are)"
        )
