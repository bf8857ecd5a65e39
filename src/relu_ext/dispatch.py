"""``install`` / ``uninstall``: relu_ext as the kernel behind PyTorch's own activation ops.

After :func:`install`, every ReLU the process runs through ``aten::relu`` /
``aten::relu_`` on an ordinary CPU or CUDA tensor runs relu_ext's kernels and
records a ``ReluExtBackward0`` node, however it was called: ``F.relu``,
``torch.relu``, ``torch.relu_``, ``Tensor.relu``, ``nn.ReLU``, library code,
TorchScript graphs, C++ callers. The same holds for the family's ops
(``aten::hardtanh``, hence ``F.relu6`` and ``nn.ReLU6``; ``leaky_relu``;
``threshold``; ``hardsigmoid``) on floating-point tensors: ``install(ops=...)``
takes a subset. The kernels are registered with PyTorch's
dispatcher (csrc/activations/install.cpp); no Python function is replaced and no other op
is touched. Everything else (sparse, quantized, nested, mkldnn, other devices
and dtypes, ``__torch_dispatch__`` subclasses, hence the fake tensors
``torch.compile`` and ``torch.export`` trace with) keeps PyTorch's kernel.

The registration is process-wide: it applies to every thread at once. PyTorch
does not guard its dispatch table against a registration that races with ops
running in other threads, so install and uninstall while no other thread is
running PyTorch ops (at start-up, say). Processes started with ``spawn``
(``torch.multiprocessing``, DDP workers) begin without it: call ``install()``
in each.

Activation checkpointing (``torch.utils.checkpoint``, non-reentrant) reruns
the forward in backward and checks that it saves what the forward saved.
relu_ext's nodes save a mask where PyTorch's save a tensor, so the rerun must
run the kernels the forward ran, whatever is installed by then: a checkpoint
whose forward ran an op through relu_ext holds an installation of that op
while it recomputes, and an op it ran through PyTorch keeps PyTorch's kernel
in the recomputation even where relu_ext is installed (:func:`_probe`).
"""

from __future__ import annotations

import inspect
import threading
from types import TracebackType
from typing import Any, Callable, Iterable

import torch
import torch.utils.checkpoint as _checkpoint
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from . import _C

_lock = threading.Lock()
_holds: dict[str, int] = {}  # op -> install() holds not yet undone; registered while > 0
_generation = 0  # bumped by uninstall(), which cancels every earlier hold


def targets() -> tuple[str, ...]:
    """The ops :func:`install` can take over: ``relu`` and the family's (``relu_ext.install_targets``).

    Returns:
        tuple[str, ...]: their aten names; each comes with its in-place form.

    Example::

        >>> relu_ext.install_targets()[:2]
        ('relu', 'hardtanh')
    """
    return tuple(_C.install_targets())


class Installation:
    """A hold on the installation of some ops, returned by :func:`install` (not made directly).

    ``remove()`` (or leaving the ``with`` block) gives it back; an op stays
    installed while any other hold on it remains. Removing twice, or after
    :func:`uninstall`, does nothing. ``with relu_ext.install() as hold:``
    gives the hold itself; ``active`` says whether it still holds.

    Args:
        generation (int): the :func:`uninstall` count it was made in (internal).
        ops (tuple[str, ...]): the ops it holds (also the attribute ``ops``).

    Example::

        >>> hold = relu_ext.install(["relu"])
        >>> hold.active, relu_ext.installed("relu")
        (True, True)
        >>> hold.remove()
        >>> hold.active, relu_ext.installed("relu")
        (False, False)
    """

    def __init__(self, generation: int, ops: tuple[str, ...]) -> None:
        self._generation = generation
        self._held = True
        self.ops = ops

    @property
    def active(self) -> bool:
        """Whether this hold still keeps its ops installed."""
        return self._held and self._generation == _generation

    def remove(self) -> None:
        """Give the hold back; the last hold on an op uninstalls it."""
        with _lock:
            if not self.active:
                return
            self._held = False
            done = []
            for op in self.ops:
                _holds[op] -= 1
                if _holds[op] == 0:
                    del _holds[op]
                    done.append(op)
            _registered(done, _C.uninstall)

    def __enter__(self) -> Installation:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<relu_ext.Installation {'active' if self.active else 'removed'} ops={list(self.ops)}>"


def _registered(ops: list[str], change: Callable[[list[str]], None]) -> None:
    """Install or uninstall ``ops`` (``change``) in the dispatcher, and make
    PyTorch's Python dispatcher see it.

    The Python dispatcher (what torch.compile and torch.export trace with)
    caches, per aten overload, which key's kernel serves each dispatch key,
    and only a registration from Python clears that cache. Kept after
    uninstall, it pointed AutogradCPU at the kernel removed, and a model
    compiled afterwards got no gradient through its ReLUs.
    """
    change(ops)
    for op in ops:
        for name in (op, op + "_"):
            packet = getattr(torch.ops.aten, name)
            for overload in packet.overloads():
                getattr(packet, overload)._dispatch_cache.clear()


def install(ops: Iterable[str] | None = None) -> Installation:
    """Run relu_ext's kernels for PyTorch's own activation ops from now on.

    Args:
        ops: the ops to take over, by name (default: all of :func:`targets`,
            e.g. ``relu``, ``hardtanh``; each with its in-place form).

    Returns:
        A hold that is also a context manager.

    Example::

        with relu_ext.install():
            loss = model(x).sum()    # every ReLU, ReLU6, LeakyReLU... inside is relu_ext's
            loss.backward()

    Nestable: an op stays installed until every hold on it is removed, or
    until :func:`uninstall`. Call it outside compiled code: inside a region
    ``torch.compile`` traces it raises RuntimeError.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "relu_ext.install() was called inside a region torch.compile is tracing; a compiled graph "
            "cannot change which kernels PyTorch dispatches to. Call relu_ext.install() before compiling "
            "or calling the compiled function."
        )
    known = targets()
    chosen = known if ops is None else tuple(dict.fromkeys([ops] if isinstance(ops, str) else _names(ops)))
    unknown = [op for op in chosen if op not in known]
    if unknown:
        raise ValueError(f"relu_ext.install: unknown op(s) {unknown}; choose from {list(known)}")
    with _lock:
        _registered([op for op in chosen if op not in _holds], _C.install)
        for op in chosen:
            _holds[op] = _holds.get(op, 0) + 1
        return Installation(_generation, chosen)


def _names(ops: object) -> list[str]:
    """install()'s `ops` as a list of names, or a TypeError that says what it got instead (a tensor
    passed by mistake is iterable, element by element)."""
    if isinstance(ops, torch.Tensor) or not isinstance(ops, Iterable):
        raise TypeError(f"relu_ext.install: ops must be an op's name or an iterable of names, got {type(ops).__name__}")
    names = list(ops)
    wrong = [type(op).__name__ for op in names if not isinstance(op, str)]
    if wrong:
        raise TypeError(f"relu_ext.install: ops must be names (str), got {', '.join(dict.fromkeys(wrong))}")
    return names


def uninstall() -> None:
    """Restore PyTorch's own kernels for every op at once, whatever holds remain (they become inactive).

    Returns:
        None

    Example::

        >>> hold = relu_ext.install()
        >>> relu_ext.uninstall()
        >>> relu_ext.installed(), hold.active
        (False, False)
    """
    global _generation
    with _lock:
        _holds.clear()
        _generation += 1
        _registered(list(targets()), _C.uninstall)


def installed(op: str | None = None) -> bool:
    """Whether relu_ext's kernels run PyTorch's ``aten::<op>`` now.

    Args:
        op (str, optional): an op of :func:`targets`. Default: any of them.

    Returns:
        bool: whether it (any of them, without ``op``) is installed.

    Example::

        >>> with relu_ext.install(["relu"]):
        ...     print(relu_ext.installed("relu"), relu_ext.installed("hardtanh"))
        True False
    """
    now = _C.installed()
    return bool(now) if op is None else op in now


def _checkpoint_of(pack_hook: Callable[..., Any]) -> tuple[str, Any] | None:
    """("forward", frame) or ("recompute", frame) for the pack hooks of
    ``torch.utils.checkpoint``'s non-reentrant checkpoint, None for any other.

    The frame is found in the hook's closure (``frame`` in the forward's hook,
    ``target_frame_ref`` in the recomputation's), as torch 2.11 to 2.15 write them.
    """
    if getattr(pack_hook, "__module__", None) != "torch.utils.checkpoint":
        return None  # (first, as it is cheap: functools.wraps copies __module__ to a wrapper)
    fn = inspect.unwrap(pack_hook)
    if getattr(fn, "__module__", None) != "torch.utils.checkpoint" or not fn.__closure__:
        return None
    names = dict(zip(fn.__code__.co_freevars, fn.__closure__))
    if "frame" in names:
        return "forward", names["frame"].cell_contents
    if "target_frame_ref" in names:
        return "recompute", names["target_frame_ref"].cell_contents()
    return None


# The __torch_dispatch__ modes of torch.utils.checkpoint's selective
# checkpointing, whose policy sees the ops they run (named so in torch 2.11 to 2.15).
_SELECTIVE_MODES = tuple(
    c for c in (getattr(_checkpoint, n, None) for n in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode"))
    if isinstance(c, type)
)


def _selective_checkpointing() -> bool:
    """Whether selective checkpointing runs now (one of its modes is on the stack)."""
    return torch._C._len_torch_dispatch_stack() > 0 and any(
        isinstance(m, _SELECTIVE_MODES) for m in _get_current_dispatch_mode_stack())


def _probe(op: str, installed: bool) -> bool:
    """Asked by an autograd kernel of relu_ext that records a node under
    saved-tensor hooks: True when it must run PyTorch's kernel for ``op``.

    Under selective checkpointing, True: a policy names aten ops
    (``aten.relu.default``), and must decide for this call as it decides for
    PyTorch's. Otherwise, for an installed kernel (``installed``), under a
    checkpoint's forward, notes ``op`` on the checkpoint and makes its
    recomputation hold an installation of the ops noted (False); under its
    recomputation, True for an op its forward did not note.
    """
    try:
        if _selective_checkpointing():
            return True
        if not installed:
            return False
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        found = None if hooks is None else _checkpoint_of(hooks[0])
        if found is None or found[1] is None:
            return False
        phase, frame = found
        ops: set[str] | None = getattr(frame, "_relu_ext_ops", None)
        if phase == "recompute":
            return ops is None or op not in ops
        if ops is None:
            ops = frame._relu_ext_ops = set()
            recompute = frame.recompute_fn

            def recompute_installed(*args: Any) -> Any:
                with install(tuple(ops)):
                    return recompute(*args)

            frame.recompute_fn = recompute_installed  # closes over ops, not the frame: no cycle
        ops.add(op)
        return False
    except Exception:  # a torch whose checkpoint looks different: behave as before
        return False


_C.set_recompute_probe(_probe)
