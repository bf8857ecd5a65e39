"""The activations: ``relu``, ``hardtanh`` / ``relu6``, ``leaky_relu``, ``threshold``, ``hardsigmoid``.

Each function is a drop-in for its ``torch.nn.functional`` twin (same
signature, values and gradients) and each module subclasses its ``torch.nn``
class. Where a gradient is needed, backward keeps a 1-bit mask per element
instead of the input or output PyTorch keeps. :data:`ACTIVATIONS` lists them
once; its op names, backward nodes and Scalar arguments are read from the C++
trait table (``csrc/activations/activations.h``), so they are not spelled
again here. Fake kernels, vmap rules, exporters, ``install()``,
``convert()`` and ``save_compact()`` are generated from it.

The native ops of an activation ``<name>`` (csrc/activations/family.cpp) are:

- ``<name>(x, *args) -> y`` and ``<name>_(x, *args)``: the public ops.
  Differentiable (forward and reverse mode); when a gradient is needed they
  write a mask, else not.
- ``<name>_fwd(x, *args) -> (y, mask)``, ``<name>_fwd_(x, *args) -> mask`` and
  ``<name>_bwd(grad, mask, *args) -> grad_in``: the training pieces behind them.

``mask`` holds one bit per element (``ceil(n / 8)`` uint8 bytes), the
element's backward predicate (relu: ``!(y <= 0)``) for the ``k``-th element in
memory order, so an fp32 activation costs 1 bit instead of 32.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from . import _C, registrations  # noqa: F401  (the native ops, their fake kernels and vmap rules)
from .quantization import refuse_fx_tracing

_ops = torch.ops.relu_ext
# Module-level names for what each call uses: attribute lookups cost as much as
# the call itself at 1K elements. TorchScript and Dynamo recognise these
# functions by identity, so the aliases keep their special meaning.
_is_scripting = torch.jit.is_scripting
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_has_torch_function_unary = torch._C._has_torch_function_unary
_eager_act = _C.act
_eager_relu = _C.relu
_NUMBERS = (float, int, bool)  # what _C.act takes as Scalars, as torch.ops converts them


def _number(a: Any) -> Any:
    """A Scalar argument as torch.ops takes it: numpy scalars and 0-dim
    tensors, which torch.nn.functional takes too, as Python numbers."""
    return a if type(a) in _NUMBERS or not hasattr(a, "item") else a.item()


def _eager(name: str, input: Tensor, inplace: Any, a0: float = 0.0, a1: float = 0.0) -> Tensor | None:
    """The op ``name`` called from C++ for a plain tensor in eager mode
    (about 1 us less per call than through ``torch.ops``), or None where
    Dynamo, a tensor subclass, a ``__torch_function__`` mode or an FX proxy
    must see the op called from Python."""
    if _is_dynamo_compiling() or _has_torch_function_unary(input):
        refuse_fx_tracing(input, name)
        return None
    if type(a0) not in _NUMBERS or type(a1) not in _NUMBERS:
        a0, a1 = _number(a0), _number(a1)
    return _eager_act(name, input, inplace is True or (inplace is not False and bool(inplace)), a0, a1)


_NATIVE = {name: (node, tuple(params)) for name, node, params in _C.activation_table()}  # the C++ traits


@dataclass(frozen=True)
class Activation:
    """One row of the activation table.

    Attributes:
        name: the op's name (``relu_ext::<name>``, PyTorch's ``aten::<name>``).
        functions: relu_ext's public functions running the op.
        modules: the ``torch.nn`` classes ``convert()`` replaces, with relu_ext's own.
        zeros: given the op's arguments, whether its outputs are mostly zeros,
            so that ``save_compact()`` compacts them where later layers keep them.
        params: its Scalar arguments' names, in schema order (as registered from the trait).
        node: relu_ext's backward node (``grad_fn.name()``; the C++ trait's ``kNode``).
        torch_node: PyTorch's backward node of the out-of-place op.
    """

    name: str
    functions: tuple[Callable[..., Tensor], ...]
    modules: tuple[tuple[type, type], ...]
    zeros: Callable[[tuple[float, ...]], bool]
    params: tuple[str, ...] = field(init=False)
    node: str = field(init=False)
    torch_node: str = field(init=False)

    def __post_init__(self) -> None:
        if self.name not in _NATIVE:
            raise ValueError(f"relu_ext: no C++ trait for activation {self.name!r} (csrc/activations/activations.h)")
        node, params = _NATIVE[self.name]
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "node", node)
        # PyTorch names its node after the op as relu_ext does, without "Ext".
        object.__setattr__(self, "torch_node", node.replace("ExtBackward0", "Backward0"))


def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """Drop-in for :func:`torch.nn.functional.relu`: same values, gradients and ``inplace`` semantics.

    When a gradient is needed, backward keeps a 1-bit-per-element mask instead
    of the output. Integer tensors work as with :func:`torch.relu`.

    Args:
        input (Tensor): the input.
        inplace (bool): overwrite ``input`` (an error on a leaf that requires
            grad, as in PyTorch). Any truthy value counts, as in PyTorch.
            Default: ``False``.

    Returns:
        Tensor: ``max(input, 0)``; ``input`` itself when ``inplace``.

    Example::

        >>> relu_ext.relu(torch.tensor([-1.0, 0.0, 2.0]))
        tensor([0., 0., 2.])
    """
    # Eager plain tensors go straight into C++ (_C.relu calls the same ops).
    # TorchScript, Dynamo, tensor subclasses, __torch_function__ modes and FX
    # proxies need the op called from Python, where they can see it.
    if not _is_scripting():
        if not (_is_dynamo_compiling() or _has_torch_function_unary(input)):
            if inplace is not False and inplace is not True:
                # F.relu takes any truthy value (nn.ReLU(inplace='yes') too);
                # pybind11 takes a bool, None or a number, not e.g. a string.
                inplace = bool(inplace)
            return _eager_relu(input, inplace)
        refuse_fx_tracing(input, "relu")
    if inplace:
        _ops.relu_(input)
        return input
    return _ops.relu(input)


def hardtanh(input: Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.hardtanh``: ``clamp(input, min_val, max_val)``.

    Backward keeps a 1-bit mask (``min_val < x < max_val``) instead of the input.

    Args:
        input (Tensor): the input.
        min_val (float): the lower bound. Default: ``-1.0``.
        max_val (float): the upper bound. Default: ``1.0``.
        inplace (bool): overwrite ``input`` (any truthy value, as in PyTorch). Default: ``False``.

    Returns:
        Tensor: the clamped tensor (``input`` itself when ``inplace``).

    Example::

        >>> relu_ext.hardtanh(torch.tensor([-2.0, 0.5, 3.0]))
        tensor([-1.0000,  0.5000,  1.0000])
    """
    if min_val > max_val:
        raise ValueError("min_val cannot be greater than max_val")
    if not _is_scripting():
        out = _eager("hardtanh", input, inplace, min_val, max_val)
        if out is not None:
            return out
        min_val, max_val = _number(min_val), _number(max_val)
    if inplace:
        _ops.hardtanh_(input, min_val, max_val)
        return input
    return _ops.hardtanh(input, min_val, max_val)


def relu6(input: Tensor, inplace: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.relu6``: ``hardtanh(input, 0, 6)``.

    Args:
        input (Tensor): the input.
        inplace (bool): overwrite ``input`` (any truthy value, as in PyTorch). Default: ``False``.

    Returns:
        Tensor: ``min(max(input, 0), 6)`` (``input`` itself when ``inplace``).

    Example::

        >>> relu_ext.relu6(torch.tensor([-1.0, 3.0, 7.0]))
        tensor([0., 3., 6.])
    """
    return hardtanh(input, 0.0, 6.0, inplace)


def leaky_relu(input: Tensor, negative_slope: float = 0.01, inplace: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.leaky_relu``: ``x > 0 ? x : x * negative_slope``.

    Backward keeps a 1-bit mask (``x > 0``) instead of the input. As in PyTorch,
    the backward of the in-place form raises for a negative slope.

    Args:
        input (Tensor): the input.
        negative_slope (float): the slope below 0. Default: ``0.01``.
        inplace (bool): overwrite ``input`` (any truthy value, as in PyTorch). Default: ``False``.

    Returns:
        Tensor: the activation (``input`` itself when ``inplace``).

    Example::

        >>> relu_ext.leaky_relu(torch.tensor([-2.0, 3.0]), 0.1)
        tensor([-0.2000,  3.0000])
    """
    if not _is_scripting():
        out = _eager("leaky_relu", input, inplace, negative_slope)
        if out is not None:
            return out
        negative_slope = _number(negative_slope)
    if inplace:
        _ops.leaky_relu_(input, negative_slope)
        return input
    return _ops.leaky_relu(input, negative_slope)


def threshold(input: Tensor, threshold: float, value: float, inplace: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.threshold``: ``x <= threshold ? value : x``.

    Backward keeps a 1-bit mask (``x > threshold``) instead of the input.

    Args:
        input (Tensor): the input.
        threshold (float): the value to threshold at.
        value (float): the value that replaces what is not above it.
        inplace (bool): overwrite ``input`` (any truthy value, as in PyTorch). Default: ``False``.

    Returns:
        Tensor: the thresholded tensor (``input`` itself when ``inplace``).

    Example::

        >>> relu_ext.threshold(torch.tensor([0.5, 2.0]), 1.0, 0.0)
        tensor([0., 2.])
    """
    if not _is_scripting():
        out = _eager("threshold", input, inplace, threshold, value)
        if out is not None:
            return out
        threshold, value = _number(threshold), _number(value)
    if inplace:
        _ops.threshold_(input, threshold, value)
        return input
    return _ops.threshold(input, threshold, value)


def hardsigmoid(input: Tensor, inplace: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.hardsigmoid``: ``min(max(x + 3, 0), 6) / 6``.

    Backward keeps a 1-bit mask (``-3 < x < 3``) instead of the input.

    Args:
        input (Tensor): the input.
        inplace (bool): overwrite ``input`` (any truthy value, as in PyTorch). Default: ``False``.

    Returns:
        Tensor: the activation (``input`` itself when ``inplace``).

    Example::

        >>> relu_ext.hardsigmoid(torch.tensor([-4.0, 0.0, 4.0]))
        tensor([0.0000, 0.5000, 1.0000])
    """
    if not _is_scripting():
        out = _eager("hardsigmoid", input, inplace)
        if out is not None:
            return out
    if inplace:
        _ops.hardsigmoid_(input)
        return input
    return _ops.hardsigmoid(input)


class TorchScriptNote:
    """What relu_ext's modules add to their ``torch.nn`` class: a warning when
    TorchScript records one (``torch.jit.script`` or ``torch.jit.trace``). The
    graph then holds ``relu_ext::`` ops, so an archive saved with
    ``torch.jit.save`` needs ``import relu_ext`` before ``torch.jit.load``;
    nothing in eager mode pays for the check."""

    def __prepare_scriptable__(self) -> Any:
        # torch.jit.script calls this on every submodule before compiling.
        _warn_torchscript(self, "torch.jit.script")
        return self

    def _slow_forward(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module calls this instead of forward while torch.jit.trace records.
        _warn_torchscript(self, "torch.jit.trace")
        return super()._slow_forward(*args, **kwargs)  # type: ignore[misc]


def _warn_torchscript(module: torch.nn.Module, how: str) -> None:
    warnings.warn(
        f"relu_ext.{type(module).__name__} under {how}: the TorchScript graph records relu_ext's ops, so an archive "
        "saved with torch.jit.save needs `import relu_ext` before torch.jit.load. For an archive that loads "
        "without relu_ext, call relu_ext.revert(model) before scripting or tracing it.",
        UserWarning,
        stacklevel=3,
    )


class ReLU(TorchScriptNote, torch.nn.ReLU):
    """Drop-in for :class:`torch.nn.ReLU`, running :func:`relu_ext.relu`.

    A subclass (see ``help(torch.nn.ReLU)``): same constructor, attributes,
    repr, ``state_dict`` and pickling; backward keeps a 1-bit mask instead of
    the output.

    TorchScript: a scripted model that runs relu_ext's modules records
    ``relu_ext::`` ops, so ``torch.jit.load`` of its archive needs
    ``import relu_ext`` first (else ``Unknown builtin op: relu_ext::relu_``);
    :func:`relu_ext.revert` the model before scripting and saving it for an
    archive that loads without relu_ext.

    Args:
        inplace (bool): overwrite the input. Default: ``False``.

    Example::

        >>> m = relu_ext.ReLU()
        >>> m(torch.tensor([-1.0, 2.0]))
        tensor([0., 2.])
    """

    def forward(self, input: Tensor) -> Tensor:
        """Apply :func:`relu_ext.relu` with this module's ``inplace``."""
        return relu(input, self.inplace)


class Hardtanh(TorchScriptNote, torch.nn.Hardtanh):
    """Drop-in for :class:`torch.nn.Hardtanh`, running :func:`relu_ext.hardtanh`.

    A subclass (see ``help(torch.nn.Hardtanh)``): same constructor, attributes,
    repr and ``state_dict``; backward keeps a 1-bit mask instead of the input.
    A TorchScript archive of it needs ``import relu_ext`` to load.

    Args:
        min_val (float): the lower bound. Default: ``-1.0``.
        max_val (float): the upper bound. Default: ``1.0``.
        inplace (bool): overwrite the input. Default: ``False``.

    Example::

        >>> m = relu_ext.Hardtanh(-2.0, 2.0)
        >>> m(torch.tensor([-3.0, 0.5, 3.0]))
        tensor([-2.0000,  0.5000,  2.0000])
    """

    def forward(self, input: Tensor) -> Tensor:
        """Apply :func:`relu_ext.hardtanh` with this module's arguments."""
        return hardtanh(input, self.min_val, self.max_val, self.inplace)


class ReLU6(TorchScriptNote, torch.nn.ReLU6):
    """Drop-in for :class:`torch.nn.ReLU6`, running :func:`relu_ext.relu6`.

    A subclass (see ``help(torch.nn.ReLU6)``): same constructor, attributes,
    repr and ``state_dict``; backward keeps a 1-bit mask instead of the input.
    A TorchScript archive of it needs ``import relu_ext`` to load.

    Args:
        inplace (bool): overwrite the input. Default: ``False``.

    Example::

        >>> m = relu_ext.ReLU6()
        >>> m(torch.tensor([-1.0, 3.0, 7.0]))
        tensor([0., 3., 6.])
    """

    def forward(self, input: Tensor) -> Tensor:
        """Apply :func:`relu_ext.relu6` with this module's arguments."""
        return hardtanh(input, self.min_val, self.max_val, self.inplace)


class LeakyReLU(TorchScriptNote, torch.nn.LeakyReLU):
    """Drop-in for :class:`torch.nn.LeakyReLU`, running :func:`relu_ext.leaky_relu`.

    A subclass (see ``help(torch.nn.LeakyReLU)``): same constructor, attributes,
    repr and ``state_dict``; backward keeps a 1-bit mask instead of the input.
    A TorchScript archive of it needs ``import relu_ext`` to load.

    Args:
        negative_slope (float): the slope below 0. Default: ``0.01``.
        inplace (bool): overwrite the input. Default: ``False``.

    Example::

        >>> m = relu_ext.LeakyReLU(0.1)
        >>> m(torch.tensor([-2.0, 3.0]))
        tensor([-0.2000,  3.0000])
    """

    def forward(self, input: Tensor) -> Tensor:
        """Apply :func:`relu_ext.leaky_relu` with this module's arguments."""
        return leaky_relu(input, self.negative_slope, self.inplace)


class Threshold(TorchScriptNote, torch.nn.Threshold):
    """Drop-in for :class:`torch.nn.Threshold`, running :func:`relu_ext.threshold`.

    A subclass (see ``help(torch.nn.Threshold)``): same constructor, attributes,
    repr and ``state_dict``; backward keeps a 1-bit mask instead of the input.
    A TorchScript archive of it needs ``import relu_ext`` to load.

    Args:
        threshold (float): the value to threshold at.
        value (float): the value that replaces what is not above it.
        inplace (bool): overwrite the input. Default: ``False``.

    Example::

        >>> m = relu_ext.Threshold(1.0, 0.0)
        >>> m(torch.tensor([0.5, 2.0]))
        tensor([0., 2.])
    """

    def forward(self, input: Tensor) -> Tensor:
        """Apply :func:`relu_ext.threshold` with this module's arguments."""
        return threshold(input, self.threshold, self.value, self.inplace)


class Hardsigmoid(TorchScriptNote, torch.nn.Hardsigmoid):
    """Drop-in for :class:`torch.nn.Hardsigmoid`, running :func:`relu_ext.hardsigmoid`.

    A subclass (see ``help(torch.nn.Hardsigmoid)``): same constructor, attributes,
    repr and ``state_dict``; backward keeps a 1-bit mask instead of the input.
    A TorchScript archive of it needs ``import relu_ext`` to load.

    Args:
        inplace (bool): overwrite the input. Default: ``False``.

    Example::

        >>> m = relu_ext.Hardsigmoid()
        >>> m(torch.tensor([-4.0, 0.0, 4.0]))
        tensor([0.0000, 0.5000, 1.0000])
    """

    def forward(self, input: Tensor) -> Tensor:
        """Apply :func:`relu_ext.hardsigmoid` with this module's arguments."""
        return hardsigmoid(input, self.inplace)


ACTIVATIONS: tuple[Activation, ...] = (
    Activation("relu", (relu,), ((torch.nn.ReLU, ReLU),), lambda a: True),
    Activation("hardtanh", (hardtanh, relu6), ((torch.nn.Hardtanh, Hardtanh), (torch.nn.ReLU6, ReLU6)),
               lambda a: a[0] == 0),
    Activation("leaky_relu", (leaky_relu,), ((torch.nn.LeakyReLU, LeakyReLU),), lambda a: False),
    Activation("threshold", (threshold,), ((torch.nn.Threshold, Threshold),), lambda a: a[1] == 0),
    Activation("hardsigmoid", (hardsigmoid,), ((torch.nn.Hardsigmoid, Hardsigmoid),), lambda a: True),
)
"""The activation table, one row per op of the C++ trait table, in its order."""

__all__ = [obj.__name__ for act in ACTIVATIONS for obj in (*act.functions, *(ours for _, ours in act.modules))]
