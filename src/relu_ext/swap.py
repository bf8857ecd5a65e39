"""``convert`` and ``revert``: swap a model's ``torch.nn`` activation modules for relu_ext's, and back.

The pairs come from the activation table (:data:`relu_ext.activations.ACTIVATIONS`).
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter

import torch

from .activations import ACTIVATIONS

_log = logging.getLogger("relu_ext")


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
    """(torch.nn class, relu_ext class) for every activation of the table."""
    return [pair for act in ACTIVATIONS for pair in act.modules]


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
