"""The drop-in API: ``relu``, ``ReLU``, ``convert``, ``revert``.

The native ops (generated for every activation of the table in csrc/activations/family.cpp) are:

- ``relu(x) -> y`` and ``relu_(x)``: the public ops. Differentiable (forward
  and reverse mode); when a gradient is needed they write a mask, else not.
- ``relu_fwd(x) -> (y, mask)``, ``relu_fwd_(x) -> mask`` and
  ``relu_bwd(grad, mask) -> grad_in``: the training pieces behind them.

``mask`` holds one bit per element (``ceil(n / 8)`` uint8 bytes): bit ``k`` is
``!(y <= 0)`` for the ``k``-th element of ``y`` in memory order. Backward saves
only that mask, so an fp32 activation costs 1 bit instead of 32.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter

import torch
from torch import Tensor

from . import _C, registrations  # noqa: F401  (registrations: fake kernels and vmap rules)
from .activations import TorchScriptNote
from .quantization import refuse_fx_tracing

_ops = torch.ops.relu_ext
# Module-level names for what relu() calls each time: attribute lookups cost
# as much as the call itself at 1K elements. TorchScript and Dynamo recognise
# these functions by identity, so the aliases keep their special meaning.
_is_scripting = torch.jit.is_scripting
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_has_torch_function_unary = torch._C._has_torch_function_unary
_eager_relu = _C.relu
_log = logging.getLogger("relu_ext")


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


def _swap(module: torch.nn.Module, mapping: dict[type, type], done: dict[int, torch.nn.Module],
          swapped: Counter[type]) -> torch.nn.Module:
    """``module`` with every submodule whose type is exactly a key of ``mapping``
    replaced by its value; ``swapped`` counts the replacements by original class
    (a module used in several places once)."""
    if id(module) in done:
        return done[id(module)]
    dst = mapping.get(type(module))
    if dst is not None:
        new = dst.__new__(dst)
        new.__dict__.update(module.__dict__)  # arguments, inplace, training flag, hooks: all kept
        done[id(module)] = new
        swapped[type(module)] += 1
        return new
    done[id(module)] = module
    for name, child in list(module._modules.items()):
        if child is not None:
            module._modules[name] = _swap(child, mapping, done, swapped)
    return module


def _pairs() -> list[tuple[type, type]]:
    """(torch.nn class, relu_ext class) for ReLU and every activation of the family."""
    from .activations import ACTIVATIONS

    return [(torch.nn.ReLU, ReLU)] + [pair for act in ACTIVATIONS for pair in act.modules]


def _name(cls: type) -> str:
    return f"torch.nn.{cls.__name__}" if cls.__module__.startswith("torch.") else f"relu_ext.{cls.__name__}"


def _left_alone(module: torch.nn.Module, mapping: dict[type, type]) -> str:
    """``"; left alone: 2 torch.nn.GELU, ..."`` for the activation modules in
    ``module`` that convert() does not take (torch.nn's other activations,
    and subclasses of those it takes), or ``""``."""
    ours = set(mapping.values())
    left = Counter(
        type(m) for m in module.modules()
        if type(m) not in ours and type(m) not in mapping
        and (type(m).__module__ == "torch.nn.modules.activation" or isinstance(m, tuple(mapping)))
    )
    if not left:
        return ""
    return "; left alone: " + ", ".join(
        f"{n} {_name(c) if c.__module__.startswith('torch.') else c.__name__}" for c, n in left.items())


def _swap_and_tell(what: str, module: torch.nn.Module, mapping: dict[type, type]) -> torch.nn.Module:
    """Swap as :func:`_swap`, then log what was swapped, or warn that nothing was."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"relu_ext.{what}: expected an nn.Module, got {type(module).__name__}")
    swapped: Counter[type] = Counter()
    result = _swap(module, mapping, {}, swapped)
    left = _left_alone(result, mapping) if what == "convert" else ""
    if swapped:
        _log.info(
            "relu_ext.%s: swapped %d module(s) in %s: %s%s", what, sum(swapped.values()), type(module).__name__,
            ", ".join(f"{n} {_name(src)} -> {_name(mapping[src])}" for src, n in swapped.items()), left,
        )
    else:
        if left:
            _log.info("relu_ext.%s: %s%s", what, type(module).__name__, left)
        ours = tuple(dst for dst in mapping.values() if dst.__module__.startswith("relu_ext"))
        already = sum(type(m) in ours for m in module.modules()) if ours else 0
        warnings.warn(
            f"relu_ext.{what}: nothing to swap in this {type(module).__name__}: it replaces modules whose type is "
            f"exactly one of {', '.join(_name(c) for c in mapping)} (not a subclass)"
            + (f"; it holds {already} relu_ext module(s) already" if already else ""),
            UserWarning,
            stacklevel=3,
        )
    return result


def convert(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every :class:`~torch.nn.ReLU`, :class:`~torch.nn.ReLU6`, :class:`~torch.nn.Hardtanh`,
    :class:`~torch.nn.LeakyReLU`, :class:`~torch.nn.Threshold` and :class:`~torch.nn.Hardsigmoid`
    in ``module`` (type exactly that class, not a subclass) by relu_ext's subclass.

    Works in place. Arguments and ``inplace`` are kept (so are hooks and the
    ``state_dict``), and a module used in several places stays one shared
    module. What was swapped is logged at INFO level to the ``"relu_ext"``
    logger; a ``UserWarning`` says so when nothing was.

    TorchScript: a converted model, scripted, records ``relu_ext::`` ops, so
    ``torch.jit.load`` of its archive (``torch.jit.save``) needs
    ``import relu_ext`` first; without it, loading fails with
    ``Unknown builtin op: relu_ext::relu_``. For an archive that loads
    without relu_ext, :func:`revert` the model before scripting and saving it.

    Args:
        module (nn.Module): the model.

    Returns:
        nn.Module: ``module``, or its replacement when ``module`` itself is one
        of those classes.

    Raises:
        TypeError: ``module`` is no :class:`torch.nn.Module`.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU6())
        >>> relu_ext.convert(model)
        Sequential(
          (0): Linear(in_features=4, out_features=4, bias=True)
          (1): ReLU()
          (2): Linear(in_features=4, out_features=4, bias=True)
          (3): ReLU6()
        )
        >>> type(model[1]) is relu_ext.ReLU
        True
    """
    return _swap_and_tell("convert", module, dict(_pairs()))


def revert(module: torch.nn.Module) -> torch.nn.Module:
    """The inverse of :func:`convert`: every relu_ext module back to its ``torch.nn`` class.

    For tools that match ``torch.nn`` classes by type, such as quantization's
    ``fuse_modules``, and for a TorchScript archive (``torch.jit.save``) that
    loads without relu_ext. Logs and warns as :func:`convert` does.

    Args:
        module (nn.Module): the model.

    Returns:
        nn.Module: ``module``, or its replacement when ``module`` itself is a
        relu_ext module.

    Raises:
        TypeError: ``module`` is no :class:`torch.nn.Module`.

    Example::

        >>> model = relu_ext.convert(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        >>> type(relu_ext.revert(model)[1]) is nn.ReLU
        True
    """
    return _swap_and_tell("revert", module, {ours: theirs for theirs, ours in _pairs()})
