"""``install`` / ``uninstall``: relu_ext as the kernel behind PyTorch's own activation ops.

After :func:`install`, every ReLU the process runs through ``aten::relu`` /
``aten::relu_`` on an ordinary CPU or CUDA tensor runs relu_ext's kernels and
records a ``ReluExtBackward0`` node, however it was called: ``F.relu``,
``torch.relu``, ``torch.relu_``, ``Tensor.relu``, ``nn.ReLU``, library code,
TorchScript graphs, C++ callers. The same holds for the family's ops
(``aten::hardtanh``, hence ``F.relu6`` and ``nn.ReLU6``; ``leaky_relu``;
``threshold``; ``hardsigmoid``) on floating-point tensors: ``install(ops=...)``
takes a subset. The kernels are registered with PyTorch's
dispatcher (csrc/install.cpp); no Python function is replaced and no other op
is touched. Everything else (sparse, quantized, nested, mkldnn, other devices
and dtypes, ``__torch_dispatch__`` subclasses, hence the fake tensors
``torch.compile`` and ``torch.export`` trace with) keeps PyTorch's kernel.

The registration is process-wide: it applies to every thread at once. PyTorch
does not guard its dispatch table against a registration that races with ops
running in other threads, so install and uninstall while no other thread is
running PyTorch ops (at start-up, say). Processes started with ``spawn``
(``torch.multiprocessing``, DDP workers) begin without it: call ``install()``
in each.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Iterable

import torch

from . import _C

_lock = threading.Lock()
_holds: dict[str, int] = {}  # op -> install() holds not yet undone; registered while > 0
_generation = 0  # bumped by uninstall(), which cancels every earlier hold


def targets() -> tuple[str, ...]:
    """The ops :func:`install` can take over: ``relu`` and the family's."""
    return tuple(_C.install_targets())


class Installation:
    """A hold on the installation of some ops, returned by :func:`install`.

    ``remove()`` (or leaving the ``with`` block) gives it back; an op stays
    installed while any other hold on it remains. Removing twice, or after
    :func:`uninstall`, does nothing.
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
            _C.uninstall(done)

    def __enter__(self) -> Installation:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<relu_ext.Installation {'active' if self.active else 'removed'} ops={list(self.ops)}>"


def install(ops: Iterable[str] | None = None) -> Installation:
    """Run relu_ext's kernels for PyTorch's own activation ops from now on.

    Args:
        ops: the ops to take over, by name (default: all of :func:`targets`:
            ``relu``, ``hardtanh``, ``leaky_relu``, ``threshold``,
            ``hardsigmoid``; each with its in-place form).

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
    chosen = known if ops is None else tuple(dict.fromkeys([ops] if isinstance(ops, str) else ops))
    unknown = [op for op in chosen if op not in known]
    if unknown:
        raise ValueError(f"relu_ext.install: unknown op(s) {unknown}; choose from {list(known)}")
    with _lock:
        _C.install([op for op in chosen if op not in _holds])
        for op in chosen:
            _holds[op] = _holds.get(op, 0) + 1
        return Installation(_generation, chosen)


def uninstall() -> None:
    """Restore PyTorch's own kernels for every op at once, whatever holds remain (they become inactive)."""
    global _generation
    with _lock:
        _holds.clear()
        _generation += 1
        _C.uninstall(list(targets()))


def installed(op: str | None = None) -> bool:
    """Whether relu_ext's kernels run PyTorch's ``aten::<op>`` now (without ``op``: any of them)."""
    now = _C.installed()
    return bool(now) if op is None else op in now
