"""The forms ``save_compact()`` keeps saved tensors in, each restored for backward bit for bit.

``_Dense`` (as it is), ``Compacted`` (kept elements and a bitmap), ``Replayed`` (rebuilt from
its BatchNorm), ``Concatenated`` (pieces shared along a chain), ``Narrowed`` (a narrower integer
type), ``TwoValued`` (a bitmap and one bit pattern), ``Pooled`` (a max-pool's input at its
indices), ``_ViewOf`` (a view of another's form); all but ``_Dense`` and ``_ViewOf`` are
``_Shared``: rebuilt once for all the nodes that saved them.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import torch
from torch import Tensor

from .bits import _bool_bits, _bools_of, _same_bits
from .deferred import Deferred
from .graph import _inputs

_ops = torch.ops.relu_ext


def _check_version(t: Tensor, version: int, why: str) -> None:
    """PyTorch's in-place error where `t` changed (its version counter) since it was saved."""
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version "
            f"{version} instead ({why})."
        )


class _Shared:
    """A saved tensor kept in another form, rebuilt for backward (``rebuild``).

    Saved by several nodes (a ReLU and the conv after it), it is rebuilt
    once: the first unpack keeps the result until the last of them has
    unpacked it, as the graph would have held the tensor without hooks.
    Unpacked again (retain_graph), it is rebuilt again each time.
    """

    __slots__ = ("pending", "restored", "nbytes", "depth", "__weakref__")
    kind: ClassVar[str]  # what save_compact counts it as (a key of stats._KINDS)

    def __init__(self, nbytes: int, depth: int = 1) -> None:
        self.nbytes = nbytes  # what it adds to the graph
        self.depth = depth  # passes over a tensor that rebuild() makes
        self.pending = 0  # nodes that saved this and have not unpacked it yet
        self.restored: Tensor | None = None

    def rebuild(self) -> Tensor:
        raise NotImplementedError

    def fresh(self) -> bool:
        """Whether rebuild() would succeed: what it reads has not changed since."""
        return True

    def current(self, keep: bool = False) -> Tensor:
        """The saved tensor: the one restored for pending unpacks, else rebuilt (counts no unpack),
        and with `keep`, kept for the pending unpacks (those of a backward that is about to need it)."""
        if self.restored is not None:
            return self.restored
        t = self.rebuild()
        if keep and self.pending > 0:
            self.restored = t
        return t

    def live(self) -> Tensor:
        """The saved tensor while packing, to verify a recipe that reads this with: what is held
        now, else rebuilt from what its sources hold now; nothing is kept for backward."""
        return self.current()

    def gathered(self, indices: Tensor, size: Any, stride: Any) -> Tensor:
        """live()'s elements at max-pool `indices` (see _gathered), to verify a Pooled recipe with."""
        return _gathered(self.live(), indices, size, stride)

    def restore(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout."""
        t = self.current()
        self.pending -= 1
        self.restored = t if self.pending > 0 else None
        return t


class Compacted(_Shared):
    """A saved tensor as its kept elements and a bitmap of where they are."""

    __slots__ = ("values", "mask", "size", "stride")
    kind = "compacted"

    def __init__(self, values: Tensor, mask: Tensor, like: Tensor) -> None:
        super().__init__(values.nbytes + mask.nbytes)  # (less when the mask is the node's: see _compacted)
        self.values, self.mask, self.size, self.stride = values, mask, like.size(), like.stride()

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout."""
        return _ops.expand(self.values, self.mask, self.size, self.stride)

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting)."""
        return self.values, self.mask


class _Dense:
    """A tensor saved as it is, with the version it had (the check PyTorch makes without hooks)."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: Tensor) -> None:
        # Detached: the same data and version counter, without the grad_fn, so that
        # a saved output does not hold its own node (a cycle Python cannot free).
        self.tensor, self.version = tensor.detach(), tensor._version

    def restore(self) -> Tensor:
        _check_version(self.tensor, self.version, "checked by relu_ext.save_compact, which saved it as it was")
        return self.tensor

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting)."""
        return (self.tensor,)


class Replayed(_Shared):
    """A saved activation output as a recipe: the BatchNorm input it was computed from
    (held by the BatchNorm's node anyway), the BatchNorm's per-channel terms, the activation;
    after a residual add, also the add's other input with its terms: a second BatchNorm's
    input, or (terms 1 and -0.0: added as it is) a tensor that other nodes keep as it is or
    compacted or rebuilt in one pass (rebuilt for this rebuild, then dropped)."""

    __slots__ = ("x", "version", "alpha", "beta", "act", "args", "x2", "version2", "alpha2", "beta2")
    kind = "replayed"

    def __init__(self, x: Tensor | _Shared, alpha: Tensor, beta: Tensor, act: str, args: list[float],
                 second: tuple[Tensor | _Shared, Tensor, Tensor] | None = None) -> None:
        x2, alpha2, beta2 = second if second is not None else (None, None, None)
        super().__init__(sum(t.nbytes for t in (alpha, beta, alpha2, beta2) if t is not None),
                         1 + sum(s.depth for s in (x, x2) if isinstance(s, _Shared)))
        self.x, self.alpha, self.beta, self.act, self.args = x, alpha, beta, act, args
        self.x2, self.alpha2, self.beta2 = x2, alpha2, beta2
        self.version = x._version if isinstance(x, Tensor) else None
        self.version2 = x2._version if isinstance(x2, Tensor) else None

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout (the BatchNorm input's)."""
        return self._make(live=False)

    def live(self) -> Tensor:
        """The saved tensor while packing (see _Shared.live)."""
        return self._make(live=True)

    def gathered(self, indices: Tensor, size: Any, stride: Any) -> Tensor:
        """The recipe's elements at max-pool `indices`, made from its sources' elements there: a
        pool's output rebuilt without the pool's input (a pass over the whole input saved). Not float16:
        the replay's vector and scalar conversions round NaN payloads apart, so its bits can depend on
        an element's position; only the same positions compare there."""
        x, x2 = self._sources(live=True)
        if x.dtype == torch.float16:
            return _gathered(self._replay(x, x2), indices, size, stride)
        return self._replay(*(None if s is None else _gathered(s, indices, size, stride) for s in (x, x2)))

    def _make(self, live: bool) -> Tensor:
        return self._replay(*self._sources(live))

    def _replay(self, x: Tensor, x2: Tensor | None) -> Tensor:
        return _ops.bn_act_rebuild(x, self.alpha, self.beta, self.act, self.args, x2, self.alpha2, self.beta2)

    def _sources(self, live: bool) -> tuple[Tensor, Tensor | None]:
        why = "relu_ext.save_compact rebuilds an activation output from this tensor, which changed after the forward"
        x, x2 = self.x, self.x2
        if isinstance(x, _Shared):  # (in backward: a concatenation its BatchNorm unpacks next, kept for it)
            x = x.live() if live else x.current(keep=True)
        else:
            _check_version(x, self.version, why)
        if isinstance(x2, _Shared):
            x2 = x2.live() if live else x2.current()
        elif x2 is not None:
            _check_version(x2, self.version2, why)
        return x, x2

    def fresh(self) -> bool:
        """Whether rebuild() would succeed: the tensors it reads are at the versions they had."""
        return all(s.fresh() if isinstance(s, _Shared) else s is None or s._version == v
                   for s, v in ((self.x, self.version), (self.x2, self.version2)))

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive beyond what the graph holds anyway (for memory accounting)."""
        return tuple(t for t in (self.alpha, self.beta, self.alpha2, self.beta2) if t is not None)


class Concatenated(_Shared):
    """A saved concatenation (DenseNet's ``torch.cat`` of a block's features, saved by the next
    BatchNorm) kept as pieces along its dimension: the pieces of the concatenation before it, which
    it begins with (shared, not copied), and a copy of what it adds. The first of a chain is kept
    as it is. Rebuilt in backward in one pass; a chain of n holds one concatenation's bytes, not n."""

    __slots__ = ("pieces", "version", "dim", "inputs", "size", "stride", "source", "source_version")
    kind = "concatenated"

    def __init__(self, t: Tensor, dim: int, prev: Concatenated | None) -> None:
        # Detached: the same data and version counter, without the grad_fn (see _Dense).
        start = 0 if prev is None else prev.size[dim]
        piece = t.detach() if prev is None else t.narrow(dim, start, t.shape[dim] - start).clone()
        super().__init__(0 if prev is None else piece.nbytes)
        self.pieces = (piece,) if prev is None else (*prev.pieces, piece)
        self.version = t._version if prev is None else prev.version  # (of the first piece, the tensor itself)
        self.dim, self.inputs, self.size, self.stride = dim, _inputs(t), t.size(), t.stride()
        self.source, self.source_version = weakref.ref(t), t._version  # (verified equal to this, see live())

    def extends(self, t: Tensor, dim: int) -> bool:
        """Whether `t` begins with this concatenation: the same inputs (nodes) first, then more,
        and bit for bit the same elements."""
        inputs = _inputs(t)
        if dim != self.dim or len(inputs) <= len(self.inputs) or self.size[dim] >= t.shape[dim] or not self.fresh():
            return False
        if any(a is not b or i != j for (a, i), (b, j) in zip(self.inputs, inputs)):
            return False
        lengths = [piece.shape[dim] for piece in self.pieces]
        parts = t.split([*lengths, t.shape[dim] - self.size[dim]], dim)
        return _same_bits(list(zip(parts, self.pieces)))

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout."""
        first = self.pieces[0]
        _check_version(first, self.version, "relu_ext.save_compact rebuilds a concatenation from this tensor, "
                       "which changed after the forward")
        if len(self.pieces) == 1:
            return first
        out = torch.cat(self.pieces, self.dim)
        if out.stride() != self.stride:  # (cat lays out its result after its inputs')
            out = torch.empty_strided(self.size, self.stride, dtype=out.dtype, device=out.device).copy_(out)
        return out

    def fresh(self) -> bool:
        """Whether rebuild() would succeed: the first piece is at the version it had."""
        return self.pieces[0]._version == self.version

    def live(self) -> Tensor:
        """The saved tensor: the concatenation itself while it is alive and unchanged, else rebuilt."""
        t = self.source()
        return t if t is not None and t._version == self.source_version else self.rebuild()

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting; the pieces are shared along a chain)."""
        return self.pieces


# Integer types a saved integer tensor may be kept in, narrowest first.
_NARROWER = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32)


class Narrowed(_Shared):
    """A saved integer tensor (max-pool indices, gather indices) kept in the narrowest integer
    type that holds all its values, and widened back for backward, bit for bit, in its own layout.

    Until the context exits it holds the tensor itself: only then is it known whether the graph
    is its only holder (max-pool indices: yes; a user's token ids: no, and a narrowed copy would
    add bytes, not save them). ``settle()`` decides then."""

    __slots__ = ("tensor", "version", "dtype", "narrow")
    kind = "narrowed"

    def __init__(self, t: Tensor) -> None:
        super().__init__(t.nbytes)
        self.tensor: Tensor | None = t
        self.version, self.dtype, self.narrow = t._version, t.dtype, None

    def settle(self) -> bool:
        """Keep the narrowed copy instead of the tensor where that is exact and frees it; whether it did."""
        t = self.tensor
        if t is None or t._version != self.version:  # (changed in place: restore() raises PyTorch's error)
            return False
        lo, hi = Deferred(torch.stack(torch.aminmax(t))).ints()
        bits = torch.iinfo(t.dtype).bits
        fits = [d for d in _NARROWER if torch.iinfo(d).bits < bits and torch.iinfo(d).min <= lo and hi <= torch.iinfo(d).max]
        if not fits:
            return False
        narrow = t.to(fits[0])  # (preserve_format: a dense tensor keeps its strides)
        alive = weakref.ref(t)
        self.tensor = t = None
        self.tensor = alive()  # (a tensor held elsewhere, in Python or C++, keeps its Python object alive)
        if self.tensor is not None:
            return False
        self.narrow, self.nbytes = narrow, narrow.nbytes
        return True

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout."""
        if self.tensor is not None:
            _check_version(self.tensor, self.version, "checked by relu_ext.save_compact, which saved it as it was")
            return self.tensor
        assert self.narrow is not None
        return self.narrow.to(self.dtype)

    def fresh(self) -> bool:
        """Whether rebuild() would succeed: the tensor, until settled, is at the version it had."""
        return self.tensor is None or self.tensor._version == self.version

    def live(self) -> Tensor:
        """The saved tensor (not widened again while the tensor itself is held)."""
        return self.tensor if self.tensor is not None else self.current()

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting)."""
        return (self.tensor,) if self.tensor is not None else (self.narrow,)


class TwoValued(_Shared):
    """A saved floating-point tensor that no node made, of +0 and one other bit pattern (CPU
    dropout's noise), as the bitmap of its nonzero elements and that pattern, rebuilt for backward
    bit for bit in its own layout. A bool tensor (CUDA dropout's mask) likewise, on any device, with
    no pattern to keep: bits packed and unpacked with PyTorch's own ops (_bool_bits), so no host sync.

    Made when the tensor is saved, so the tensor is freed as soon as nothing else holds it (the
    step's peak falls too); where something does, the bitmap adds 1/32 of its bytes (float32). A
    weak reference tells whether it lives on: changed in place since, backward raises PyTorch's
    in-place error, as it would without the hooks."""

    __slots__ = ("mask", "value", "size", "stride", "ref", "version")
    kind = "two_valued"

    def __init__(self, mask: Tensor, value: Tensor | None, t: Tensor) -> None:
        super().__init__(mask.nbytes + (0 if value is None else value.nbytes))
        self.mask, self.value, self.size, self.stride = mask, value, t.size(), t.stride()
        self.ref, self.version = weakref.ref(t), t._version

    @staticmethod
    def of(t: Tensor) -> TwoValued | None:
        """`t` as a bitmap and its one nonzero bit pattern, or None where it has a second one."""
        if t.dtype == torch.bool:
            return TwoValued(_bool_bits(t), None, t)
        mask, value, ok = _ops.binary_mask(t)
        return TwoValued(mask, value, t) if Deferred(ok).flag() else None

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout."""
        t = self.ref()
        if t is not None:
            _check_version(t, self.version, "checked by relu_ext.save_compact, which saved it as a bitmap")
        if self.value is None:
            return _bools_of(self.mask, self.size, self.stride)
        return _ops.binary_expand(self.mask, self.value, self.size, self.stride)

    def fresh(self) -> bool:
        """Whether rebuild() would succeed: the tensor is gone, or at the version it had."""
        t = self.ref()
        return t is None or t._version == self.version

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting)."""
        return (self.mask,) if self.value is None else (self.mask, self.value)


class Pooled(_Shared):
    """A saved max-pool output (kept by the next layer) as a recipe: the pool's input and indices,
    which the pool's node keeps anyway (in the form this context saved them: as they are, compacted,
    rebuilt, narrowed), gathered in backward. A max-pool output is its input at the indices, bit for
    bit (verified when saved)."""

    __slots__ = ("x", "version", "indices", "iversion", "size", "stride")
    kind = "pooled"

    def __init__(self, x: Tensor | _Shared, indices: Tensor | _Shared, t: Tensor) -> None:
        super().__init__(0, 1 + (x.depth if isinstance(x, _Shared) else 0))
        self.x, self.indices, self.size, self.stride = x, indices, t.size(), t.stride()
        self.version = x._version if isinstance(x, Tensor) else None
        self.iversion = indices._version if isinstance(indices, Tensor) else None

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout (the pool's backward, next, reads the same two:
        kept for it)."""
        return self._make(live=False)

    def live(self) -> Tensor:
        """The saved tensor while packing (see _Shared.live)."""
        return self._make(live=True)

    def _make(self, live: bool) -> Tensor:
        why = "relu_ext.save_compact rebuilds a max-pool output from this tensor, which changed after the forward"
        x, indices = ((s.live() if live else s.current(keep=True)) if isinstance(s, _Shared) else _checked(s, v, why)
                      for s, v in ((self.x, self.version), (self.indices, self.iversion)))
        return _gathered(x, indices, self.size, self.stride)

    def fresh(self) -> bool:
        """Whether rebuild() would succeed: the tensors it reads are at the versions they had."""
        return all(s.fresh() if isinstance(s, _Shared) else s._version == v
                   for s, v in ((self.x, self.version), (self.indices, self.iversion)))

    def held(self) -> tuple[Tensor, ...]:
        """Nothing the graph does not hold anyway (for memory accounting)."""
        return ()


def _checked(t: Tensor, version: int | None, why: str) -> Tensor:
    """`t`, where it is at `version` (see _check_version)."""
    _check_version(t, version, why)
    return t


def _gathered(x: Tensor, indices: Tensor, size: Any, stride: Any) -> Tensor:
    """The elements of `x` (N, C, H, W) at `indices` (N, C, h, w, each an index into its H x W plane),
    laid out as `size` / `stride`; without copying `x` where it is contiguous or channels_last."""
    n, c = x.shape[:2]
    last = torch.channels_last
    if x.is_contiguous(memory_format=last) and indices.is_contiguous(memory_format=last):
        flat, at = x.permute(0, 2, 3, 1).reshape(n, -1, c), indices.permute(0, 2, 3, 1).reshape(n, -1, c)
        out = flat.gather(1, at).view(n, *indices.shape[2:], c).permute(0, 3, 1, 2)
    else:
        out = x.reshape(n, c, -1).gather(2, indices.reshape(n, c, -1)).view(indices.shape)
    if out.stride() != tuple(stride):
        out = torch.empty_strided(size, stride, dtype=out.dtype, device=out.device).copy_(out)
    return out


class _ViewOf:
    """A saved view with all of an activation output's elements (what a Linear on a 3-D input keeps:
    a 2-D view of it), kept as the output's form (compacted, a recipe) and viewed again on unpack."""

    __slots__ = ("inner", "size", "stride", "base_size", "base_stride", "__weakref__")

    def __init__(self, inner: Any, t: Tensor, base: Tensor) -> None:
        self.inner, self.size, self.stride = inner, t.size(), t.stride()
        self.base_size, self.base_stride = base.size(), base.stride()

    def restore(self) -> Tensor:
        base = self.inner.restore()
        if base.stride() != self.base_stride:  # (restored in its own layout, always: the view's strides need it)
            base = torch.empty_strided(self.base_size, self.base_stride, dtype=base.dtype, device=base.device).copy_(base)
        return base.as_strided(self.size, self.stride, base.storage_offset())

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting): the output's form's."""
        return self.inner.held()

