"""``install`` / ``uninstall``: relu_ext as the kernel behind PyTorch's own ``aten::relu``.

After :func:`install`, every ReLU the process runs through ``aten::relu`` /
``aten::relu_`` on an ordinary CPU or CUDA tensor runs relu_ext's kernels and
records a ``ReluExtBackward0`` node, however it was called: ``F.relu``,
``torch.relu``, ``torch.relu_``, ``Tensor.relu``, ``nn.ReLU``, library code,
TorchScript graphs, C++ callers. The kernels are registered with PyTorch's
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

import torch

from . import _C

_lock = threading.Lock()
_holds = 0  # install() calls not yet undone; the kernels are registered while > 0
_generation = 0  # bumped by uninstall(), which cancels every earlier hold


class Installation:
    """A hold on the installation, returned by :func:`install`.

    ``remove()`` (or leaving the ``with`` block) gives it back; relu_ext
    stays installed while any other hold remains. Removing twice, or after
    :func:`uninstall`, does nothing.
    """

    def __init__(self, generation: int) -> None:
        self._generation = generation
        self._held = True

    @property
    def active(self) -> bool:
        """Whether this hold still keeps relu_ext installed."""
        return self._held and self._generation == _generation

    def remove(self) -> None:
        """Give the hold back; the last one uninstalls."""
        global _holds
        with _lock:
            if not self.active:
                return
            self._held = False
            _holds -= 1
            if _holds == 0:
                _C.uninstall()

    def __enter__(self) -> Installation:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<relu_ext.Installation {'active' if self.active else 'removed'}>"


def install() -> Installation:
    """Run relu_ext's kernels for every ``aten::relu`` / ``aten::relu_`` from now on.

    Returns a hold that is also a context manager::

        with relu_ext.install():
            loss = model(x).sum()    # every ReLU inside is relu_ext's
            loss.backward()

    Nestable: relu_ext stays installed until every hold is removed, or until
    :func:`uninstall`. Call it outside compiled code: inside a region
    ``torch.compile`` traces it raises RuntimeError.
    """
    global _holds
    if torch.compiler.is_compiling():
        raise RuntimeError(
            "relu_ext.install() was called inside a region torch.compile is tracing; a compiled graph "
            "cannot change which kernels PyTorch dispatches to. Call relu_ext.install() before compiling "
            "or calling the compiled function."
        )
    with _lock:
        if _holds == 0:
            _C.install()
        _holds += 1
        return Installation(_generation)


def uninstall() -> None:
    """Restore PyTorch's own ReLU kernels at once, whatever holds remain (they become inactive)."""
    global _holds, _generation
    with _lock:
        _holds = 0
        _generation += 1
        _C.uninstall()


def installed() -> bool:
    """Whether relu_ext's kernels currently run PyTorch's ``aten::relu``."""
    return bool(_C.installed())
