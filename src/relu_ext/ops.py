"""The drop-in API: ``relu``, ``ReLU``, ``convert``, ``revert``.

The native ops (schema in csrc/ops.cpp, autograd in csrc/autograd.cpp) are:

- ``relu(x) -> y`` and ``relu_(x)``: the public ops. Differentiable (forward
  and reverse mode); when a gradient is needed they write a mask, else not.
- ``relu_fwd(x) -> (y, mask)``, ``relu_fwd_(x) -> mask`` and
  ``relu_bwd(grad, mask) -> grad_in``: the training pieces behind them.

``mask`` holds one bit per element (``ceil(n / 8)`` uint8 bytes): bit ``k`` is
``!(y <= 0)`` for the ``k``-th element of ``y`` in memory order. Backward saves
only that mask, so an fp32 activation costs 1 bit instead of 32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _C, registrations  # noqa: F401  (registrations: fake kernels and vmap rules)

_ops = torch.ops.relu_ext
# Module-level names for what relu() calls each time: attribute lookups cost
# as much as the call itself at 1K elements. TorchScript and Dynamo recognise
# these functions by identity, so the aliases keep their special meaning.
_is_scripting = torch.jit.is_scripting
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_has_torch_function_unary = torch._C._has_torch_function_unary
_eager_relu = _C.relu


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.relu``: same values, gradients and ``inplace`` semantics.

    When a gradient is needed, backward keeps a 1-bit-per-element mask instead of
    the output. ``inplace=True`` overwrites ``input`` (and errors on a leaf that
    requires grad, as PyTorch does). Integer tensors work as with ``torch.relu``.
    """
    # Eager plain tensors go straight into C++ (_C.relu calls the same ops).
    # TorchScript, Dynamo, tensor subclasses, __torch_function__ modes and FX
    # proxies need the op called from Python, where they can see it.
    if not _is_scripting():
        if not (_is_dynamo_compiling() or _has_torch_function_unary(input)):
            return _eager_relu(input, inplace)
    if inplace:
        _ops.relu_(input)
        return input
    return _ops.relu(input)


class ReLU(torch.nn.ReLU):
    """Drop-in for ``torch.nn.ReLU`` (a subclass: same constructor, repr, state_dict, pickling).

    Args:
        inplace: overwrite the input, as ``nn.ReLU(inplace=True)`` does.
    """

    def forward(self, input: Tensor) -> Tensor:
        return relu(input, self.inplace)


def _swap(module: torch.nn.Module, mapping: dict[type, type], done: dict[int, torch.nn.Module]) -> torch.nn.Module:
    """``module`` with every submodule whose type is exactly a key of ``mapping`` replaced by its value."""
    if id(module) in done:
        return done[id(module)]
    dst = mapping.get(type(module))
    if dst is not None:
        new = dst.__new__(dst)
        new.__dict__.update(module.__dict__)  # arguments, inplace, training flag, hooks: all kept
        done[id(module)] = new
        return new
    done[id(module)] = module
    for name, child in list(module._modules.items()):
        if child is not None:
            module._modules[name] = _swap(child, mapping, done)
    return module


def _pairs() -> list[tuple[type, type]]:
    """(torch.nn class, relu_ext class) for ReLU and every activation of the family."""
    from .activations import ACTIVATIONS

    return [(torch.nn.ReLU, ReLU)] + [pair for act in ACTIVATIONS for pair in act.modules]


def convert(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``nn.ReLU``, ``nn.ReLU6``, ``nn.Hardtanh``, ``nn.LeakyReLU``, ``nn.Threshold``
    and ``nn.Hardsigmoid`` in ``module`` (type exactly that class) by relu_ext's subclass.

    Works in place and returns ``module`` (or, when ``module`` itself is one of
    them, its replacement). Arguments and ``inplace`` are kept (so is the
    ``state_dict``), and a module used in several places stays one shared module.
    """
    return _swap(module, dict(_pairs()), {})


def revert(module: torch.nn.Module) -> torch.nn.Module:
    """The inverse of :func:`convert`: every relu_ext module back to its ``torch.nn`` class.

    For tools that match ``torch.nn`` classes by type, such as quantization's
    ``fuse_modules``.
    """
    return _swap(module, {ours: theirs for theirs, ours in _pairs()}, {})
