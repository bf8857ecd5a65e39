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

import weakref
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

    __slots__ = ("values", "mask", "size", "stride", "pending", "restored", "nbytes")

    def __init__(self, values: Tensor, mask: Tensor, like: Tensor) -> None:
        self.values, self.mask, self.size, self.stride = values, mask, like.size(), like.stride()
        self.nbytes = values.nbytes + mask.nbytes  # what it adds to the graph (less when the mask is the node's)
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
    packed = Compacted(values, mask, y)
    packed.nbytes = cost  # a shared mask is held by the ReLU's node anyway
    return packed


# Why a tensor was saved as it is: save_compact.kept_by_reason's keys, and the words report() uses.
_REASONS = {
    "not_activation": "not an activation output",
    "unsupported": "unsupported type",
    "too_small": "too small",
    "too_few_zeros": "too few zeros",
}


class _Stats:
    """What a save_compact's pack hook did (kept apart from the context: the hook holds this, not the context)."""

    __slots__ = ("compacted", "kept_by_reason", "compacted_bytes", "compacted_held", "kept_bytes")

    def __init__(self) -> None:
        self.compacted = 0
        self.kept_by_reason = dict.fromkeys(_REASONS, 0)
        self.compacted_bytes = self.compacted_held = self.kept_bytes = 0

    def keep(self, reason: str, t: Tensor) -> None:
        """Count `t`, saved as it is for `reason`."""
        self.kept_by_reason[reason] += 1
        self.kept_bytes += t.nbytes


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


class save_compact(torch.autograd.graph.saved_tensors_hooks):
    """Keep ReLU outputs saved for backward as bitmap + nonzero values, restored bit for bit.

    A context manager of saved-tensor hooks, like
    :class:`torch.autograd.graph.save_on_cpu`: put it around the forward pass
    of a training step. The outputs of ReLU (PyTorch's or relu_ext's) and of
    the family where they are mostly zeros (ReLU6, Hardtanh with ``min_val=0``,
    Threshold with ``value=0``, Hardsigmoid) that some node saves for backward
    are kept compacted, once however many nodes save them. A ReLU output
    changed in place after it was saved gives backward the values it had when
    saved (compacted) or PyTorch's in-place error (saved as it is), never the
    changed data.

    ``with`` gives the context itself, which reports what its hooks did (totals
    over every ``with`` block it was used in; each distinct tensor counted once,
    however many nodes saved it):

    - ``compacted`` (int): tensors kept compacted;
    - ``kept`` (int): tensors saved as they are; ``kept_by_reason``
      (dict[str, int]) says why: ``"not_activation"`` (no such activation
      output: inputs, weights, other layers' outputs), ``"too_small"`` (under
      4096 elements), ``"too_few_zeros"`` (compacting would save less than
      ``min_saving``), ``"unsupported"`` (a tensor subclass, or not floating
      point, dense and strided, on the CPU or CUDA);
    - ``bytes_saved_for_backward`` (int): what those tensors hold
      (``nbytes`` each), what the graph would hold without the hooks;
    - ``bytes_held`` (int): what the graph holds with them: tensors kept as
      they are, plus the compacted ones' values and bitmaps (a relu_ext
      output's bitmap is its node's mask, held anyway: not counted);
    - ``report()`` (str): all of it in words; ``repr()`` in one line.

    Args:
        min_saving (float): compact a tensor only if that saves at least this
            fraction of its bytes; denser ones are saved as they are.
            Default: ``0.1``.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        >>> with relu_ext.save_compact() as sc:
        ...     loss = model(torch.randn(64, 256)).sum()
        >>> loss.backward()
        >>> sc.compacted, sc.kept, sc.kept_by_reason["not_activation"]
        (1, 2, 2)
        >>> print(sc.report())
        relu_ext.save_compact: 3 tensors saved for backward, 138.00 KiB, held in 107.93 KiB (78.2%)
          compacted: 1 tensor, 64.00 KiB held in 33.93 KiB
          kept as they are: 2 tensors, 74.00 KiB: 2 not an activation output

    (The ReLU's output, saved by its node and by the second Linear, is
    compacted once; the input and the second Linear's weight are kept.)
    """

    def __init__(self, min_saving: float = 0.1) -> None:
        if not 0.0 <= min_saving < 1.0:
            raise ValueError(f"relu_ext.save_compact: min_saving must be in [0, 1), got {min_saving}")
        self.min_saving = min_saving
        # Saved by several nodes (a ReLU output and the conv after it), a tensor
        # is compacted once. Keyed by the tensor itself, weakly: data pointers
        # are reused as soon as memory is freed. None: saved as it is.
        cache: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        # The tensors saved as they are, counted once each: id -> weak reference,
        # cheaper than a WeakTensorKeyDictionary for the many tensors the hook
        # only counts (and than reading their versions: a tensor saved as it is
        # holds its storage once, whatever it went through). Entries of dead
        # tensors are pruned as it grows.
        seen: dict[int, weakref.ref] = {}
        prune_at = [1024]
        stats = self._stats = _Stats()
        kept_by_reason = stats.kept_by_reason

        def pack(t: Tensor) -> Any:
            why = _why_kept(t)
            if why is not None:
                key = id(t)
                ref = seen.get(key)
                if ref is None or ref() is not t:
                    seen[key] = weakref.ref(t)
                    kept_by_reason[why] += 1
                    stats.kept_bytes += t.nbytes
                    if len(seen) > prune_at[0]:
                        for dead in [k for k, r in seen.items() if r() is None]:
                            del seen[dead]
                        prune_at[0] = 2 * len(seen) + 1024
                return _Dense(t)
            hit = cache.get(t)
            if hit is None or hit[0] != t._version:
                with torch.no_grad():
                    hit = (t._version, _compacted(t, min_saving))
                cache[t] = hit  # counted again when changed in place: a second compact form is held
                if hit[1] is None:
                    stats.keep("too_few_zeros", t)
                else:
                    stats.compacted += 1
                    stats.compacted_bytes += t.nbytes
                    stats.compacted_held += hit[1].nbytes
            if hit[1] is None:
                return _Dense(t)
            hit[1].pending += 1
            return hit[1]

        def unpack(packed: Any) -> Tensor:
            return packed.restore()

        super().__init__(pack, unpack)

    def __enter__(self) -> save_compact:
        super().__enter__()
        return self

    @property
    def compacted(self) -> int:
        """Distinct tensors saved for backward that were kept compacted."""
        return self._stats.compacted

    @property
    def kept(self) -> int:
        """Distinct tensors saved for backward as they are (``kept_by_reason`` says why)."""
        return sum(self._stats.kept_by_reason.values())

    @property
    def kept_by_reason(self) -> dict[str, int]:
        """``kept`` by reason: ``not_activation``, ``unsupported``, ``too_small``, ``too_few_zeros``."""
        return dict(self._stats.kept_by_reason)

    @property
    def bytes_saved_for_backward(self) -> int:
        """Bytes of the distinct tensors saved for backward: what the graph would hold without the hooks."""
        return self._stats.compacted_bytes + self._stats.kept_bytes

    @property
    def bytes_held(self) -> int:
        """Bytes the graph holds for them: tensors kept as they are plus the compacted ones' values and bitmaps."""
        return self._stats.compacted_held + self._stats.kept_bytes

    def report(self) -> str:
        """What the hooks did, in words (see the class documentation)."""
        st, total, held = self._stats, self.bytes_saved_for_backward, self.bytes_held
        n = self.compacted + self.kept
        share = f" ({100 * held / total:.1f}%)" if total else ""
        why = ", ".join(f"{k} {_REASONS[r]}" for r, k in st.kept_by_reason.items() if k)
        return "\n".join([
            f"relu_ext.save_compact: {n} tensor{'s' * (n != 1)} saved for backward, {_size(total)}, "
            f"held in {_size(held)}{share}",
            f"  compacted: {st.compacted} tensor{'s' * (st.compacted != 1)}, {_size(st.compacted_bytes)} held in "
            f"{_size(st.compacted_held)}",
            f"  kept as they are: {self.kept} tensor{'s' * (self.kept != 1)}, {_size(st.kept_bytes)}"
            + (f": {why}" if why else ""),
        ])

    def __repr__(self) -> str:
        return (
            f"<relu_ext.save_compact min_saving={self.min_saving} compacted={self.compacted} kept={self.kept} "
            f"bytes_saved_for_backward={self.bytes_saved_for_backward} bytes_held={self.bytes_held}>"
        )


def _why_kept(t: Tensor) -> str | None:
    """Why `t` is saved as it is (a key of ``_REASONS``), or None when it is a plain
    dense floating-point output of ReLU (or of the family, where mostly zeros)
    worth compacting. Cheapest checks first: the pack hook asks for every tensor."""
    fn = t.grad_fn
    if fn is None or not _mostly_zeros(fn):
        return "not_activation"
    if (
        type(t) is not torch.Tensor
        or not t.is_floating_point()
        or t.layout != torch.strided
        or t.device.type not in ("cpu", "cuda")
    ):
        return "unsupported"
    if t.numel() < _MIN_NUMEL:
        return "too_small"
    if not _is_dense(t):
        return "unsupported"
    return None


def _is_dense(t: Tensor) -> bool:
    """Whether `t`'s elements fill a block of memory exactly once, in any order of dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
