"""The forms ``save_compact()`` keeps saved tensors in, each restored for backward bit for bit.

``_Dense`` (as it is), ``Compacted`` (kept elements and a bitmap), ``Replayed`` (rebuilt from
its BatchNorm), ``Concatenated`` (pieces shared along a chain), ``Narrowed`` (a narrower integer
type), ``TwoValued`` (a bitmap and one bit pattern), ``Pooled`` (a max-pool's input at its
indices), ``_ViewOf`` (a view of another's form); all but ``_Dense`` and ``_ViewOf`` are
``_Shared``: rebuilt once for all the nodes that saved them.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, ClassVar, Iterator, NamedTuple

import torch
from torch import Tensor

from .. import _C
from .bits import _INTS, _bools_of, _like, _same_bits_later
from .deferred import Deferred
from .graph import _inputs, _kept
from .streams import STREAMS

_ops = torch.ops.relu_ext


def _check_version(t: Tensor, version: int, why: str) -> None:
    """PyTorch's in-place error where `t` changed (its version counter) since it was saved."""
    if t._version != version:
        _changed(t, t._version, version, why)


def _changed(t: Tensor | None, now: int, version: int, why: str) -> None:
    """Raise PyTorch's in-place error for a saved tensor `t` (None: freed since) at version `now`, saved
    at `version`."""
    what = "a tensor freed since" if t is None else f"{t.type()} {list(t.shape)}"
    raise RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{what}] is at version {now}; expected version {version} instead ({why})."
    )


class _Shared:
    """A saved tensor kept in another form, rebuilt for backward (``rebuild``).

    Saved by several nodes (a ReLU and the conv after it), it is rebuilt
    once: the first unpack keeps the result until the last of them has
    unpacked it, as the graph would have held the tensor without hooks.
    Unpacked again (retain_graph), it is rebuilt again each time.

    A form whose check runs on the device (a recipe verified bit for bit)
    holds the tensor itself (``whole``) until the check's value reaches the
    host (see hooks._Packer.resolve): then it drops the tensor, or, where the
    check failed, keeps it and is the tensor as it is from then on. Until then
    it is that tensor too: an unpack returns it, exactly, without waiting.

    It stands for the tensor at its version when saved (``saved``, weakly, and its version counter,
    ``counter``, which outlives it): a change in place since makes backward raise PyTorch's in-place
    error, as without hooks, whether or not the check has come back, and whether or not the tensor
    was freed since (a change through a view of it, or before it was freed).

    It is made on the stream the forward runs on (``stream``; None off CUDA), which the work that
    fills it runs on too, and which a read on another stream waits for (see streams.py).
    """

    __slots__ = ("pending", "restored", "nbytes", "depth", "whole", "saved", "counter", "saved_version",
                 "stream", "__weakref__")
    kind: ClassVar[str]  # what save_compact counts it as (a key of stats._KINDS)
    op_name: str | None = None  # the op that remakes it (Remade), for the report
    missed_as: ClassVar[str] = "not_activation"  # why a tensor whose check failed is counted as kept

    def __init__(self, t: Tensor, nbytes: int, depth: int = 1) -> None:
        self.nbytes = nbytes  # what it adds to the graph
        self.depth = depth  # passes over a tensor that rebuild() makes
        self.pending = 0  # nodes that saved this and have not unpacked it yet
        self.restored: Tensor | None = None
        self.whole: _Dense | None = None  # the tensor itself, while the check runs or after it failed
        self.saved, self.counter, self.saved_version = weakref.ref(t), _C.version_counter(t), t._version
        self.stream = STREAMS.of(t)

    def unchanged(self) -> bool:
        """Whether the tensor this stands for (alive or freed since) is at the version it was saved at."""
        return self.counter.version == self.saved_version

    def hold(self, t: Tensor) -> None:
        """Stand for `t` as `t` itself until resolved()."""
        self.whole = _Dense(t)

    def checked(self, check: Deferred) -> bool | str | Deferred:
        """The form's check is back: True where the form is exact, else why the tensor is kept as it is
        (a key of stats._REASONS), or the next check to wait for (a form made in steps, whose next step
        runs on the stream the form was made on, whichever thread or stream resolves it)."""
        with STREAMS.on(self.stream):
            return self._step(check)

    def _step(self, check: Deferred) -> bool | str | Deferred:
        """checked() on the form's stream; a form made in one step has its one check."""
        return True if check.flag() else self.missed_as

    def kept_as_is(self) -> bool:
        """Whether the form holds the tensor itself as it is (counted as kept, see hooks._Packer._count)."""
        return False

    def resolved(self, exact: bool) -> None:
        """The last check is back: drop the tensor where this form is `exact`, else keep it from now on."""
        if exact:
            self.whole = None

    def rebuild(self) -> Tensor:
        raise NotImplementedError

    def fresh(self) -> bool:
        """Whether current() would succeed: the tensor held is unchanged, or the tensor this stands for
        and what rebuild() reads are."""
        return self.whole.unchanged() if self.whole is not None else self.unchanged() and self._fresh()

    def _fresh(self) -> bool:
        """fresh() of the form itself (no tensor held)."""
        return True

    def current(self, keep: bool = False) -> Tensor:
        """The saved tensor: the one restored for pending unpacks, else rebuilt (counts no unpack),
        and with `keep`, kept for the pending unpacks (those of a backward that is about to need it)."""
        if self.restored is not None:
            return self.restored
        if self.whole is not None:
            t = self.whole.restore()
        else:
            if not self.unchanged():
                _changed(self.saved(), self.counter.version, self.saved_version,
                         "relu_ext.save_compact rebuilds it for backward")
            if self.stream is not None:  # (else nothing to order: see streams.py)
                STREAMS.after(self.stream, self._reads())
            t = self.rebuild()
        if keep and self.pending > 0:
            self.restored = t
        return t

    def live(self) -> Tensor:
        """The saved tensor while packing, to verify a recipe that reads this with: what is held
        now; else, the form being exact, the tensor itself while the forward still holds it
        unchanged (a residual block's input, read by its output's recipe: no pass to rebuild it);
        else rebuilt from what its sources hold now; nothing is kept for backward."""
        if self.whole is not None:
            return self.whole.restore()
        t = self.saved()
        if t is not None and t._version == self.saved_version:
            return t.detach()
        if self.stream is not None:
            STREAMS.after(self.stream, self._reads())
        return self._live()

    def _live(self) -> Tensor:
        """live() of the form itself (no tensor held)."""
        return self.current()

    def gathered(self, indices: Tensor, size: Any, stride: Any) -> Tensor:
        """live()'s elements at max-pool `indices` (see _gathered), to verify a Pooled recipe with."""
        if self.whole is not None:
            return _gathered(self.whole.restore(), indices, size, stride)
        return self._gather(indices, size, stride)

    def _gather(self, indices: Tensor, size: Any, stride: Any) -> Tensor:
        """gathered() of the form itself (no tensor held)."""
        return _gathered(self.live(), indices, size, stride)

    def again(self) -> _Shared:
        """This, for one more node that saved it (and will unpack it)."""
        self.pending += 1
        return self

    def restore(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout."""
        t = self.current()
        self.pending -= 1
        self.restored = t if self.pending > 0 else None
        return t

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting): the form's, and the tensor while held."""
        return self._held() + (() if self.whole is None else self.whole.held())

    def _held(self) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def _reads(self) -> tuple[Tensor, ...]:
        """The tensors rebuild() reads itself (a source's form orders its own reads)."""
        return self._held()


class Compacted(_Shared):
    """A saved tensor as its kept elements and a bitmap of where they are: the bitmap of its nonzero
    elements, or its node's own mask (relu_ext's), which then costs nothing more.

    Made in steps, each waiting for a value from the device (see _Shared.hold and ``checked``): the
    count of kept elements, which sizes the values and says whether they save enough; then, with
    the node's mask, whether it restores the tensor (not where the tensor holds -0.0, or changed
    after the node), else the nonzero bitmap's count again. Where those values are on the host at
    once (the CPU), in one step instead (``now``)."""

    __slots__ = ("values", "mask", "shared", "ends", "limit", "size", "stride")
    kind = "compacted"
    missed_as = "unsupported"  # (changed in place before it was compacted)

    def __init__(self, t: Tensor, mask: Tensor | None, limit: float) -> None:
        # (Made with autograd off, see hooks._Packer._form: the ops below record nothing, `t` undetached.)
        super().__init__(t, 0)
        self.shared = mask is not None
        self.limit = limit  # the most bytes it may hold
        self.values: Tensor | None = None
        self.ends: Tensor | None = None
        self.size, self.stride = t.size(), t.stride()
        if Deferred.at_once(t):
            self.mask = mask  # (None: now() makes the bitmap)
        else:
            self.mask = mask if mask is not None else _ops.nonzero_mask(t)
            self.ends = _ops.compact_count(t, self.mask)

    @classmethod
    def at_once(cls, t: Tensor, values: Tensor, mask: Tensor, shared: bool, nbytes: int) -> Compacted:
        """`t` as the C++ path compacted it at once (csrc/compact/hooks.cpp; as ``now`` would): `values` by
        `mask`, its node's where `shared`, `nbytes` in all."""
        form = cls.__new__(cls)
        _Shared.__init__(form, t, nbytes)
        form.values, form.mask, form.shared, form.ends = values, mask, shared, None
        form.limit, form.size, form.stride = nbytes, t.size(), t.stride()
        return form

    def now(self, t: Tensor) -> bool:
        """Compact `t` at once (where Deferred.at_once: no count made), by its node's mask where that
        restores it, else by its own bitmap: whether that saves enough."""
        values, self.mask, self.shared = _C.compact_now(t, self.mask)
        cost = values.nbytes + (0 if self.shared else self.mask.nbytes)
        if cost > self.limit:
            return False
        self.values, self.nbytes = values, cost
        return True

    @property
    def count(self) -> Tensor:
        """The first step's check (on the device): the number of kept elements."""
        assert self.ends is not None
        return self.ends[-1:]

    def _step(self, check: Deferred) -> bool | str | Deferred:
        """The next step once `check` is back (see _Shared.checked): compacting the tensor held."""
        assert self.whole is not None
        y = self.whole.tensor
        if not self.whole.unchanged():
            return self.missed_as
        if self.values is None:  # the count is back
            assert self.ends is not None
            kept = check.ints()[0]
            cost = kept * y.element_size() + (0 if self.shared else self.mask.nbytes)
            if cost > self.limit:
                return "too_few_zeros"
            self.values = y.new_empty((kept,))
            missed = _ops.compact_into(y, self.mask, self.ends, self.values)
            self.ends, self.nbytes = None, cost
            return Deferred(missed == 0) if self.shared else True
        if check.flag():
            return True
        # Its node's mask does not restore it: its own bitmap, counted again.
        self.shared, self.values = False, None
        self.mask = _ops.nonzero_mask(y)
        self.ends = _ops.compact_count(y, self.mask)
        return Deferred(self.count)

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout (values sized from this mask's count)."""
        return _C.expand(self.values, self.mask, self.size, self.stride)

    def _held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting)."""
        return (self.mask,) if self.values is None else (self.values, self.mask)


class _Dense:
    """A tensor saved as it is, with the version it had (the check PyTorch makes without hooks)."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: Tensor) -> None:
        # Detached: the same data and version counter, without the grad_fn, so that
        # a saved output does not hold its own node (a cycle Python cannot free).
        self.tensor, self.version = tensor.detach(), tensor._version

    def again(self) -> _Dense:
        """This, for one more node that saved it: the same, as it holds no count."""
        return self

    def restore(self) -> Tensor:
        _check_version(self.tensor, self.version, "checked by relu_ext.save_compact, which saved it as it was")
        return self.tensor

    def unchanged(self) -> bool:
        """Whether the tensor is at the version it was saved at."""
        return self.tensor._version == self.version

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
    missed_as = "not_replayed"

    def __init__(self, t: Tensor, x: Tensor | _Shared, alpha: Tensor, beta: Tensor, act: str, args: list[float],
                 second: tuple[Tensor | _Shared, Tensor, Tensor] | None = None) -> None:
        x2, alpha2, beta2 = second if second is not None else (None, None, None)
        super().__init__(t, sum(t.nbytes for t in (alpha, beta, alpha2, beta2) if t is not None),
                         1 + sum(s.depth for s in (x, x2) if isinstance(s, _Shared)))
        self.x, self.alpha, self.beta, self.act, self.args = x, alpha, beta, act, args
        self.x2, self.alpha2, self.beta2 = x2, alpha2, beta2
        self.version = x._version if isinstance(x, Tensor) else None
        self.version2 = x2._version if isinstance(x2, Tensor) else None

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout (the BatchNorm input's)."""
        return self._make(live=False)

    def _live(self) -> Tensor:
        """The saved tensor while packing (see _Shared.live)."""
        return self._make(live=True)

    def _gather(self, indices: Tensor, size: Any, stride: Any) -> Tensor:
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
        return _C.bn_act_rebuild(x, self.alpha, self.beta, self.act, self.args, x2, self.alpha2, self.beta2)

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

    def _fresh(self) -> bool:
        """Whether rebuild() would succeed: the tensors it reads are at the versions they had."""
        return all(s.fresh() if isinstance(s, _Shared) else s is None or s._version == v
                   for s, v in ((self.x, self.version), (self.x2, self.version2)))

    def _held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive beyond what the graph holds anyway (for memory accounting)."""
        return tuple(t for t in (self.alpha, self.beta, self.alpha2, self.beta2) if t is not None)

    def _reads(self) -> tuple[Tensor, ...]:
        """The tensors rebuild() reads itself: its terms, and its sources that are tensors."""
        return self._held() + tuple(s for s in (self.x, self.x2) if isinstance(s, Tensor))


class Concatenated(_Shared):
    """A saved concatenation (DenseNet's ``torch.cat`` of a block's features, saved by the next
    BatchNorm) kept as pieces along its dimension: the pieces of the concatenation before it, which
    it begins with (shared, not copied), and a copy of what it adds. The first of a chain is kept
    as it is. Rebuilt in backward in one pass; a chain of n holds one concatenation's bytes, not n."""

    __slots__ = ("pieces", "version", "dim", "inputs", "size", "stride")
    kind = "concatenated"

    def __init__(self, t: Tensor, dim: int, prev: Concatenated | None) -> None:
        # Detached: the same data and version counter, without the grad_fn (see _Dense).
        start = 0 if prev is None else prev.size[dim]
        piece = t.detach() if prev is None else t.narrow(dim, start, t.shape[dim] - start).clone()
        super().__init__(t, 0 if prev is None else piece.nbytes)
        self.pieces = (piece,) if prev is None else (*prev.pieces, piece)
        self.version = t._version if prev is None else prev.version  # (of the first piece, the tensor itself)
        self.dim, self.inputs, self.size, self.stride = dim, _inputs(t), t.size(), t.stride()

    def extends(self, t: Tensor, dim: int) -> Tensor | None:
        """Whether `t` begins with this concatenation: None where its inputs (nodes) do not begin
        with this one's, else whether its elements do, bit for bit (a bool tensor on its device, not
        read: see _same_bits_later). Compared with the pieces, whether or not this one's own check
        has come back: they are what the next one would share."""
        inputs = _inputs(t)
        if dim != self.dim or len(inputs) <= len(self.inputs) or self.size[dim] >= t.shape[dim] or not self._fresh():
            return None
        if any(a is not b or i != j for (a, i), (b, j) in zip(self.inputs, inputs)):
            return None
        lengths = [piece.shape[dim] for piece in self.pieces]
        parts = t.split([*lengths, t.shape[dim] - self.size[dim]], dim)
        return _same_bits_later(list(zip(parts, self.pieces)))

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

    def kept_as_is(self) -> bool:
        """The first of a chain: the concatenation itself (the next one's first piece)."""
        return len(self.pieces) == 1

    def _fresh(self) -> bool:
        """Whether rebuild() would succeed: the first piece is at the version it had."""
        return self.pieces[0]._version == self.version

    def _live(self) -> Tensor:
        """The saved tensor: the concatenation itself (verified equal to this) while it is alive and
        unchanged, else rebuilt."""
        t = self.saved()
        return t if t is not None and self.unchanged() else self.rebuild()

    def _held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting; the pieces are shared along a chain)."""
        return self.pieces


# Integer types a saved integer tensor may be kept in, narrowest first.
_NARROWER = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32)


class Narrowed(_Shared):
    """A saved integer tensor (max-pool indices, gather indices) kept in the narrowest integer
    type that holds all its values, and widened back for backward, bit for bit, in its own layout.

    Until the context exits it holds the tensor itself: only then is it known whether the graph
    is its only holder (max-pool indices: yes; a user's token ids: no, and a narrowed copy would
    add bytes, not save them). ``measure()`` starts reading its range then, and ``settle()``
    decides once the range has come back (``measured()``)."""

    __slots__ = ("tensor", "dtype", "narrow", "range")
    kind = "narrowed"

    def __init__(self, t: Tensor) -> None:
        super().__init__(t, t.nbytes)
        self.tensor: Tensor | None = t
        self.dtype, self.narrow = t.dtype, None
        self.range: Deferred | None = None

    def measure(self) -> None:
        """Start reading the tensor's smallest and largest value (see settle)."""
        if self.tensor is not None and self.tensor._version == self.saved_version:
            with STREAMS.on(self.stream):
                self.range = Deferred(torch.stack(torch.aminmax(self.tensor)))

    def measured(self) -> bool:
        """Whether settle() would not wait: the range is back, or none was measured."""
        return self.range is None or self.range.done()

    def settle(self) -> bool:
        """Keep the narrowed copy instead of the tensor where that is exact and frees it; whether it did."""
        t, measured = self.tensor, self.range
        self.range = None
        if t is None or measured is None or t._version != self.saved_version:  # (changed: restore() raises PyTorch's error)
            return False
        lo, hi = measured.ints()
        bits = torch.iinfo(t.dtype).bits
        fits = [d for d in _NARROWER if torch.iinfo(d).bits < bits and torch.iinfo(d).min <= lo and hi <= torch.iinfo(d).max]
        if not fits:
            return False
        with STREAMS.on(self.stream):
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
            _check_version(self.tensor, self.saved_version, "checked by relu_ext.save_compact, which saved it as it was")
            return self.tensor
        assert self.narrow is not None
        return self.narrow.to(self.dtype)

    def _fresh(self) -> bool:
        """Whether rebuild() would succeed: the tensor, until settled, is at the version it had."""
        return self.tensor is None or self.tensor._version == self.saved_version

    def _live(self) -> Tensor:
        """The saved tensor (not widened again while the tensor itself is held)."""
        return self.tensor if self.tensor is not None else self.current()

    def _held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting)."""
        return (self.tensor,) if self.tensor is not None else (self.narrow,)


class TwoValued(_Shared):
    """A saved floating-point tensor that no node made, of +0 and one other bit pattern (CPU
    dropout's noise), as the bitmap of its nonzero elements and that pattern, rebuilt for backward
    bit for bit in its own layout. A bool tensor (CUDA dropout's mask) likewise, on any device, with
    no pattern to keep: bits packed and unpacked with PyTorch's own ops (_bool_bits), so no host sync.

    Made when the tensor is saved, so the tensor is freed as soon as nothing else holds it (the
    step's peak falls too); where something does, the bitmap adds 1/32 of its bytes (float32)
    (changed in place since: see _Shared.unchanged)."""

    __slots__ = ("mask", "value", "size", "stride")
    kind = "two_valued"

    def __init__(self, mask: Tensor, value: Tensor | None, t: Tensor) -> None:
        super().__init__(t, mask.nbytes + (0 if value is None else value.nbytes))
        self.mask, self.value, self.size, self.stride = mask, value, t.size(), t.stride()

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout."""
        if self.value is None:
            return _bools_of(self.mask, self.size, self.stride)
        return _ops.binary_expand(self.mask, self.value, self.size, self.stride)

    def _held(self) -> tuple[Tensor, ...]:
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
        super().__init__(t, 0, 1 + (x.depth if isinstance(x, _Shared) else 0))
        self.x, self.indices, self.size, self.stride = x, indices, t.size(), t.stride()
        self.version = x._version if isinstance(x, Tensor) else None
        self.iversion = indices._version if isinstance(indices, Tensor) else None

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout (the pool's backward, next, reads the same two:
        kept for it)."""
        return self._make(live=False)

    def _live(self) -> Tensor:
        """The saved tensor while packing (see _Shared.live)."""
        return self._make(live=True)

    def _make(self, live: bool) -> Tensor:
        why = "relu_ext.save_compact rebuilds a max-pool output from this tensor, which changed after the forward"
        x, indices = ((s.live() if live else s.current(keep=True)) if isinstance(s, _Shared) else _checked(s, v, why)
                      for s, v in ((self.x, self.version), (self.indices, self.iversion)))
        return _gathered(x, indices, self.size, self.stride)

    def _fresh(self) -> bool:
        """Whether rebuild() would succeed: the tensors it reads are at the versions they had."""
        return all(s.fresh() if isinstance(s, _Shared) else s._version == v
                   for s, v in ((self.x, self.version), (self.indices, self.iversion)))

    def _held(self) -> tuple[Tensor, ...]:
        """Nothing the graph does not hold anyway (for memory accounting)."""
        return ()

    def _reads(self) -> tuple[Tensor, ...]:
        """The tensors rebuild() reads itself: its sources that are tensors."""
        return tuple(s for s in (self.x, self.indices) if isinstance(s, Tensor))


class Chain(NamedTuple):
    """A Remade's op: `op` run on `inputs`, each the index of one of the form's sources, or a Chain
    itself (an output no node keeps, made again on the way: GPT-2's tanh of a polynomial of its
    input; under autocast, the LayerNorm output whose cast a Linear keeps)."""

    op: Any
    inputs: tuple[int | Chain | None, ...]  # (None: an input the op was given as None: LayerNorm's bias)

    def __call__(self, *sources: Any) -> Tensor:
        return self.op(*(sources[i] if isinstance(i, int) else None if i is None else i(*sources)
                         for i in self.inputs))

    def ops(self) -> int:
        """How many ops it runs (passes over a tensor)."""
        return 1 + sum(i.ops() for i in self.inputs if isinstance(i, Chain))


class Remade(_Shared):
    """A saved tensor (kept by a later node) as the ops that made it and their inputs, which the graph
    keeps anyway (saved by the op's own node or another, in the form this context saved them: as they
    are, compacted, rebuilt, remade: a chain; or a parameter), run again in backward. The same ops on
    the same inputs give the same bits (verified when saved). The nodes that keep its inputs run
    their backward after the later node's, so its inputs are there when this is rebuilt. It holds
    nothing the graph does not, but `own`: a scalar it found (``1.0 + tanh(x)``: an add's node does
    not keep the number).

    An op whose CPU bits depend on how its work is split among threads (graph._Remake.by_split: GELU,
    SiLU) is run again with the forward's thread count (``threads``: OpenMP's count is per thread, and
    backward may run on another thread), and its result is checked against the sum of the forward's
    bits (``fingerprint``): a rebuild that differs (an OpenMP runtime that gave it fewer threads)
    raises an error instead of giving other gradients."""

    __slots__ = ("op", "sources", "versions", "threads", "fingerprint", "op_name", "own", "recent")
    kind = "remade"

    def __init__(self, t: Tensor, op: Any, sources: list[Tensor | _Shared | None], by_split: bool = False,
                 own: tuple[Tensor, ...] = ()) -> None:
        ops = op.ops() if isinstance(op, Chain) else 1
        super().__init__(t, sum(o.nbytes for o in own), ops + sum(s.depth for s in sources if isinstance(s, _Shared)))
        self.op, self.sources, self.own = op, tuple(sources), own  # (a source None: an input given as None)
        self.recent: Tensor | None = None  # its value as verified, while packing (recipes.Recent)
        self.op_name = _op_name(op)
        self.versions = tuple(s._version if isinstance(s, Tensor) else None for s in sources)
        pinned = by_split and t.device.type == "cpu"
        self.threads = torch.get_num_threads() if pinned else None
        self.fingerprint = _bits_sum(t.detach()) if pinned else None

    def rebuild(self) -> Tensor:
        """The saved tensor, bit for bit, in its own layout (a source rebuilt for it is kept for the
        nodes that saved it, which unpack it next)."""
        t = self._make(live=False)
        if self.fingerprint is not None and _bits_sum(t) != self.fingerprint:
            raise RuntimeError(
                f"relu_ext.save_compact: remaking a saved tensor with {self.op} on {self.threads} threads gave other "
                "bits than the forward's (the OpenMP runtime ran it on fewer threads: OMP_DYNAMIC or a thread "
                "limit?). Use save_compact(recompute=False), or run backward with the forward's thread count.")
        return t

    def _live(self) -> Tensor:
        """The saved tensor while packing (see _Shared.live): the value verified, where still held."""
        return self.recent if self.recent is not None else self._make(live=True)

    def _make(self, live: bool) -> Tensor:
        why = ("relu_ext.save_compact remakes a tensor from this one, which changed after that tensor was saved; "
               "save_compact(recompute=False) keeps such tensors as they are")
        args = [(s.live() if live else s.current(keep=True)) if isinstance(s, _Shared)
                else None if s is None else _checked(s, v, why) for s, v in zip(self.sources, self.versions)]
        return run_as_forward(self.op, args, self.threads)

    def _fresh(self) -> bool:
        """Whether rebuild() would succeed: the tensors it reads are at the versions they had."""
        return all(s.fresh() if isinstance(s, _Shared) else s is None or s._version == v
                   for s, v in zip(self.sources, self.versions))

    def _held(self) -> tuple[Tensor, ...]:
        """What it holds that the graph does not (for memory accounting): the scalars it found."""
        return self.own

    def _reads(self) -> tuple[Tensor, ...]:
        """The tensors rebuild() reads itself: its sources that are tensors."""
        return tuple(s for s in self.sources if isinstance(s, Tensor))


class Widened(Remade):
    """A cast to a wider floating-point type whose input no node kept when the cast's output was saved
    (HF's RMSNorm in a bfloat16 model: the residual stream cast to float32, kept by its ``pow``), as
    that cast of a copy in the input's dtype, which it holds (``own``: half the bytes, from bfloat16
    to float32). A node saved later may keep the input itself as it is (T5's RMSNorm: its ``mul``
    keeps the residual stream it cast): then the copy holds the same bytes twice. So, as Narrowed,
    it is decided again when the context exits: ``measure()`` compares the copy with what the cast's
    input node keeps (``edge``; graph._kept), and ``settle()``, once that comparison is back, reads
    that tensor instead of the copy where the two hold the same bits, and holds nothing."""

    __slots__ = ("edge", "same", "kept")

    def __init__(self, t: Tensor, op: Any, copy: Tensor, edge: tuple[Any, int]) -> None:
        super().__init__(t, op, [copy], own=(copy,))
        self.edge = edge  # (the node that made the cast's input, its output_nr)
        self.same: Deferred | None = None  # (the comparison, from measure() to settle())
        self.kept: _Dense | None = None

    def measure(self) -> None:
        """Start comparing the copy with the cast's input, where a node of this context keeps that as it
        is, unchanged, in the copy's layout."""
        node, output_nr = self.edge
        kept = None if node is None or not self.own else _kept(node, output_nr)
        if not isinstance(kept, _Dense) or not kept.unchanged():
            return
        x, copy = kept.tensor, self.own[0]
        if _like(x, copy) and x.device == copy.device:
            with STREAMS.on(self.stream):
                self.same, self.kept = Deferred(_same_bits_later([(copy, x)])), kept

    def measured(self) -> bool:
        """Whether settle() would not wait: the comparison is back, or none was started."""
        return self.same is None or self.same.done()

    def settle(self) -> bool:
        """Read the cast's input instead of the copy where the two hold the same bits, this form is exact
        (its own check back: no tensor held) and the input unchanged; whether it does now."""
        same, kept = self.same, self.kept
        self.same = self.kept = None
        if same is None or kept is None or not same.flag() or self.whole is not None or not kept.unchanged():
            return False
        # (At the version its node saved it at: changed in place later, the rebuild raises PyTorch's error.)
        self.sources, self.versions, self.own, self.nbytes = (kept.tensor,), (kept.version,), (), 0
        return True


# The eps values LayerNorms use (PyTorch's default and GPT-2's, ViT's, BERT's, others), which a
# LayerNorm's node does not keep: tried in this order (RemadeNorm).
LAYER_NORM_EPS = (1e-5, 1e-6, 1e-12, 1e-8, 1e-7)


class EpsByWeight:
    """The eps each LayerNorm weight's outputs were last found to be made with, by the weight's memory (a
    parameter stays where it is from step to step): the eps a RemadeNorm tries first for the weight's
    next output, without the probe of every eps (about twenty small ops). A guess, which the form's
    check confirms; one that misses is forgotten (the next output probes again)."""

    # The most weights remembered (past it, all are forgotten: models come and go in one process).
    LIMIT = 4096

    def __init__(self) -> None:
        self.eps: dict[tuple[Any, ...], float] = {}

    @staticmethod
    def _key(weight: Tensor | _Shared | None) -> tuple[Any, ...] | None:
        return None if not isinstance(weight, Tensor) else (weight.data_ptr(), weight.shape, weight.dtype, weight.device)

    def get(self, weight: Tensor | _Shared | None) -> float | None:
        """The eps noted for `weight`'s LayerNorm, else None."""
        key = self._key(weight)
        return None if key is None else self.eps.get(key)

    def note(self, weight: Tensor | _Shared | None, eps: float) -> None:
        """Note that `weight`'s LayerNorm made an output with `eps`."""
        key = self._key(weight)
        if key is not None:
            if len(self.eps) >= self.LIMIT:
                self.eps.clear()
            self.eps[key] = eps

    def forget(self, weight: Tensor | _Shared | None) -> None:
        """Forget what was noted for `weight` (an eps tried for it missed)."""
        key = self._key(weight)
        if key is not None:
            self.eps.pop(key, None)


EPS_BY_WEIGHT = EpsByWeight()


class LayerNormOf:
    """PyTorch's LayerNorm as an op of its input, weight and bias (a chain's op, or a RemadeNorm's): its
    `output` (0: the output; 2: rstd), with `eps` (None until a RemadeNorm's steps set it)."""

    __slots__ = ("shape", "eps", "output")

    def __init__(self, shape: tuple[int, ...], eps: float | None = None, output: int = 0) -> None:
        self.shape, self.eps, self.output = shape, eps, output

    def __call__(self, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        assert self.eps is not None
        return torch.native_layer_norm(x, self.shape, weight, bias, self.eps)[self.output]


class RemadeNorm(Remade):
    """A tensor remade through PyTorch's LayerNorm (`norm`) of an input, weight and bias that its node
    keeps: the LayerNorm's output itself (kept by the next layers; its op is `norm`), or, where values
    reach the host later (CUDA), a chain through one (under autocast a Linear keeps the cast of its
    output). The node does not keep its eps: made in steps, as Compacted is, each waiting for a value
    from the device: which of LAYER_NORM_EPS give the node's rstd on the row where eps weighs most (the
    check the form is made with), then whether each of those in turn gives the tensor, bit for bit (in
    bfloat16 several may give that rstd). A LayerNorm computes each row on its own, so its bits do not
    depend on how the rows are split among threads."""

    __slots__ = ("norm", "untried", "rstd")

    def __init__(self, t: Tensor, op: Any, sources: list[Tensor | _Shared | None], norm: LayerNormOf,
                 by_split: bool = False, rstd: Tensor | None = None) -> None:
        super().__init__(t, op, sources, by_split)
        self.norm = norm
        if op is norm:
            self.op_name = "layer_norm"
        self.untried: list[float] | None = None  # (None: the probe's check is not back)
        # Given (a LayerNorm output whose weight's last output was remade): its node's rstd, for the
        # probe it falls back to where that output's eps (norm.eps, tried first) misses.
        self.rstd = rstd
        if rstd is not None:
            self.untried = []

    def _step(self, check: Deferred) -> bool | str | Deferred:
        """The next step once `check` is back (see _Shared.checked): the next eps to try, or done. (A
        LayerNorm output's own form, made with the eps its weight's last output had, starts with that
        eps tried on the whole tensor and nothing untried.)"""
        if self.untried is None:  # the probe is back: the eps that give the node's rstd there
            self.untried = [eps for eps, hit in zip(LAYER_NORM_EPS, check.ints()) if hit]
        elif check.flag():  # an eps gives the output
            if self.op is self.norm:
                EPS_BY_WEIGHT.note(self.sources[1], self.norm.eps)
            return True
        elif self.rstd is not None:  # the weight's last eps missed: forgotten, and the probe as for any
            EPS_BY_WEIGHT.forget(self.sources[1])
            rstd, self.rstd, self.untried = self.rstd, None, None
            return Deferred(_eps_probes(self.norm.shape, list(self.sources), rstd))
        assert self.whole is not None
        if not self.untried or not self.whole.unchanged():
            return self.missed_as
        self.norm.eps = self.untried.pop(0)
        now, t = self._make(live=True), self.whole.tensor
        if not _like(now, t):
            return self.missed_as
        return Deferred(_same_bits_later([(now, t)]))


def _eps_probes(shape: tuple[int, ...], sources: list[Tensor | _Shared | None], rstd: Tensor) -> Tensor:
    """Which eps of LAYER_NORM_EPS give a LayerNorm's rstd on the row with the largest (where eps weighs
    most; a LayerNorm of that row alone is that row's): a bool tensor on its device, not read."""
    x, weight, bias = (s.live() if isinstance(s, _Shared) else s for s in sources)
    rstd = rstd.reshape(-1)
    at = torch.where(rstd.isnan(), torch.zeros_like(rstd), rstd).argmax().reshape(1)
    row = x.reshape(-1, *shape).index_select(0, at)
    probes = torch.cat([run_as_forward(LayerNormOf(shape, eps, output=2), [row, weight, bias]).reshape(1)
                        for eps in LAYER_NORM_EPS])
    bits = _INTS[rstd.element_size()]
    return probes.view(bits).eq(rstd.index_select(0, at).view(bits))


def _op_name(op: Any) -> str | None:
    """An op's short name for the report: ``mul`` for ``aten.mul.Tensor`` (bound arguments aside)."""
    op = op.op if isinstance(op, Chain) else op
    op = getattr(op, "func", op)  # (functools.partial)
    name = getattr(op, "_opname", None)  # (an OpOverload's)
    return name if name is not None else getattr(op, "__name__", None)


def run_as_forward(op: Any, args: list[Any], threads: int | None = None) -> Tensor:
    """op(*args) as the forward ran it: with `threads` intra-op threads (None: as they are), and
    autocast off (a node records its op after autocast's casts, and backward may run under autocast)."""
    device = next(a.device.type for a in args if isinstance(a, Tensor))
    off = torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext()
    with _threads(threads), off:
        return op(*args)


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """Run what follows with `count` intra-op threads in this thread (None: as they are)."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _bits_sum(t: Tensor) -> int:
    """The sum of dense CPU `t`'s bytes as 64-bit words from its first element, modulo 2**64: a fingerprint
    that a change of one element's bits always changes (changes of several could cancel out; Remade),
    in one pass (the elements' bits summed by tensor ops, widened to int64, took three to five times as long)."""
    return _C.bits_sum(t)


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
        return self._of(base)

    def live(self) -> Tensor | None:
        """The view as it is now, while packing (its output's form's _Shared.live), not unpacked; None
        where that form's tensor changed, or is laid out otherwise."""
        base = self.inner.live() if self.inner.fresh() else None
        return None if base is None or base.stride() != self.base_stride else self._of(base)

    def _of(self, base: Tensor) -> Tensor:
        """The view of `base`, the output in its own layout."""
        return base.as_strided(self.size, self.stride, base.storage_offset())

    def held(self) -> tuple[Tensor, ...]:
        """The tensors this keeps alive (for memory accounting): the output's form's."""
        return self.inner.held()

