"""``save_compact()``: ReLU outputs saved for backward, kept as a bitmap plus their nonzero values.

In a CNN the layer after a ReLU (a conv, a linear, a max-pool) saves the ReLU's
output at full size for its own backward, so the 1-bit mask alone frees
nothing there. About half of a ReLU output's elements are zero, and a tensor
is exactly its nonzero elements plus a bitmap of where they are: inside
``save_compact()`` (saved-tensor hooks, like ``torch.autograd.graph.save_on_cpu``)
every tensor saved for backward that is a ReLU output (``relu_ext``'s
``ReluExtBackward0`` or PyTorch's ``ReluBackward0``) is kept that way, once
however many nodes save it, and restored bit for bit when backward needs it.

Exactness: the bitmap of a relu_ext output is its mask (no second bitmap);
a dropped element must then be +0.0 bit for bit, which is checked while
compacting (relu(-0.0) is -0.0 and its mask bit is 0, and an output changed
under ``no_grad`` after the ReLU is no ReLU output any more): where it is
not, the tensor gets a bitmap of its nonzero bits instead, which is exact for
any data. Values are moved as integers of their width, so NaN payloads, -0.0
and denormals come back unchanged. The work is done by the ops
``relu_ext::compact`` / ``expand`` / ``nonzero_mask`` (csrc/compact_cpu.cpp on
the CPU, csrc/relu_cuda_kernels.cuh on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

_RELU_NODES = frozenset({"ReluBackward0", "ReluExtBackward0"})


def _family_nodes() -> dict[str, tuple[Any, bool]]:
    """Node name -> (its activation, whether it is relu_ext's), from the activation table."""
    from .activations import ACTIVATIONS

    nodes: dict[str, tuple[Any, bool]] = {}
    for act in ACTIVATIONS:
        nodes[act.node] = (act, True)
        nodes[act.torch_node] = (act, False)
    return nodes


_FAMILY_NODES = _family_nodes()


def _mostly_zeros(fn: Any) -> bool:
    """Whether outputs of `fn`'s op are mostly zeros: ReLU, and the family where
    its arguments say so (relu6 / hardtanh with min_val 0, threshold with value
    0, hardsigmoid). PyTorch's nodes keep some arguments (``_saved_min_val``),
    relu_ext's keep them all (``_saved_args``); an argument not kept counts as no."""
    name = fn.name()
    if name in _RELU_NODES:
        return True
    hit = _FAMILY_NODES.get(name)
    if hit is None:
        return False
    act, ours = hit
    args = fn._saved_args if ours else tuple(getattr(fn, f"_saved_{p}", None) for p in act.params)
    return bool(act.zeros(args))
_MIN_NUMEL = 4096  # below this the hooks' own cost outweighs what they save


_ops = torch.ops.relu_ext


class Compacted:
    """A saved tensor as its kept elements and a bitmap of where they are."""

    __slots__ = ("values", "mask", "size", "stride", "pending", "restored")

    def __init__(self, values: Tensor, mask: Tensor, like: Tensor) -> None:
        self.values, self.mask, self.size, self.stride = values, mask, like.size(), like.stride()
        self.pending = 0  # nodes that saved this and have not unpacked it yet
        self.restored: Tensor | None = None

    def restore(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout.

        Saved by several nodes (a ReLU and the conv after it), it is expanded
        once: the first unpack keeps the result until the last of them has
        unpacked it, as the graph would have held the tensor without hooks.
        Unpacked again (retain_graph), it is expanded again each time.
        """
        t = self.restored if self.restored is not None else _ops.expand(self.values, self.mask, self.size, self.stride)
        self.pending -= 1
        self.restored = t if self.pending > 0 else None
        return t

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting)."""
        return self.values, self.mask


class _Dense:
    """A tensor saved as it is, with the version it had (the check PyTorch makes without hooks)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: Tensor) -> None:
        # Detached: the same data and version counter, without the grad_fn, so that
        # a saved output does not hold its own node (a cycle Python cannot free).
        self.tensor, self.version = tensor.detach(), tensor._version

    def restore(self) -> Tensor:
        if self.tensor._version != self.version:
            t = self.tensor
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
                f"{self.version} instead (checked by relu_ext.save_compact, which saved it as it was)."
            )
        return self.tensor

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting)."""
        return (self.tensor,)


def _compacted(t: Tensor, min_saving: float) -> Compacted | None:
    """`t` compacted, or None when that would save less than `min_saving` of its bytes."""
    y = t.detach()
    values, mask, shared = None, None, False
    if t.grad_fn.name() == "ReluExtBackward0":
        mask = t.grad_fn._saved_mask  # relu_ext's own mask: no second bitmap
        values, missed = _ops.compact(y, mask)
        shared = not bool(missed)  # else -0.0, or changed after the ReLU: not exact with this mask
    if not shared:
        mask = _ops.nonzero_mask(y)
        values, _ = _ops.compact(y, mask)
    cost = values.nbytes + (0 if shared else mask.nbytes)
    if cost > (1 - min_saving) * y.nbytes:
        return None
    return Compacted(values, mask, y)


class save_compact(torch.autograd.graph.saved_tensors_hooks):
    """Keep ReLU outputs saved for backward as bitmap + nonzero values, restored bit for bit.

    Use it around the forward pass of a training step::

        with relu_ext.save_compact():
            loss = model(x).sum()
        loss.backward()

    Args:
        min_saving: compact a tensor only if that saves at least this fraction
            of its bytes (default 0.1); denser ones are saved as they are.

    A ReLU output changed in place after it was saved gives backward the
    values it had when saved (compacted) or PyTorch's in-place error (saved as
    it is), never the changed data. Tensors that are no ReLU output, views,
    tensor subclasses and tensors under 4096 elements are saved as usual.
    """

    def __init__(self, min_saving: float = 0.1) -> None:
        if not 0.0 <= min_saving < 1.0:
            raise ValueError(f"relu_ext.save_compact: min_saving must be in [0, 1), got {min_saving}")
        # Saved by several nodes (a ReLU output and the conv after it), a tensor
        # is compacted once. Keyed by the tensor itself, weakly: data pointers
        # are reused as soon as memory is freed. None: saved as it is.
        cache: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

        def pack(t: Tensor) -> Any:
            if not _is_relu_output(t):
                return _Dense(t)
            hit = cache.get(t)
            if hit is None or hit[0] != t._version:
                with torch.no_grad():
                    hit = (t._version, _compacted(t, min_saving))
                cache[t] = hit
            if hit[1] is None:
                return _Dense(t)
            hit[1].pending += 1
            return hit[1]

        def unpack(packed: Any) -> Tensor:
            return packed.restore()

        super().__init__(pack, unpack)


def _is_relu_output(t: Tensor) -> bool:
    """Whether `t` is a plain dense floating-point output of ReLU (or of the
    family, where mostly zeros) worth compacting."""
    fn = t.grad_fn
    return (
        fn is not None
        and type(t) is torch.Tensor
        and _mostly_zeros(fn)
        and t.is_floating_point()
        and t.layout == torch.strided
        and t.device.type in ("cpu", "cuda")
        and t.numel() >= _MIN_NUMEL
        and _is_dense(t)
    )


def _is_dense(t: Tensor) -> bool:
    """Whether `t`'s elements fill a block of memory exactly once, in any order of dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
