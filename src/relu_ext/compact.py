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

Recompute (on by default): an activation output whose input is a BatchNorm
output (``NativeBatchNormBackward0``, or cuDNN's ``CudnnBatchNormBackward0``;
training or eval) is kept as a recipe instead: a reference to the
BatchNorm's input, which its node keeps anyway, and a few numbers per
channel, from which it is rebuilt in backward exactly as PyTorch's kernels on
that device computed it (``relu_ext::bn_terms`` / ``bn_act_rebuild``:
csrc/replay_cpu.cpp on the CPU; on CUDA, csrc/relu_cuda_kernels.cuh replays
PyTorch's own CUDA transform, which cuDNN's output may not match). It is
verified bit for bit against the real tensor when packed (``bn_act_verify``;
on CUDA one host sync); what misses is compacted or kept as it is. After a
residual add (``relu(bn(c) + identity)``) the recipe also holds the add's
other input: a second BatchNorm's input and terms, or
what this context saved of ``identity`` for another node (see ``_replayed``).
The BatchNorm's saved tensors are read without unpacking them
(``SavedTensor.data``), and only when they are plain tensors or this
context's own dense ones (or concatenations), so no other hook runs and
nothing is held twice.

Also with recompute: a concatenation that begins with the one this context
kept before it (DenseNet: each layer's ``torch.cat`` of the block's
features, saved by its BatchNorm) is kept as that one's pieces, shared,
plus a copy of what it adds, verified bit for bit when packed
(``Concatenated``), and a max-pool output kept by the next layer as the
pool's input at its indices, both kept by the pool's node (``Pooled``).
And always: an integer tensor that only the graph holds
(max-pool indices) is kept in the narrowest integer type that holds its
values, decided when the context exits (``Narrowed``); and a floating-point
tensor that no node made, of +0 and one other bit pattern (CPU dropout's
noise, 0 and 1 / (1 - p), 4 bytes an element), as the bitmap of its nonzero
elements and that pattern, from when it is saved (``TwoValued``,
``relu_ext::binary_mask`` / ``binary_expand``); a bool tensor that no node
made (CUDA dropout's mask, 1 byte an element) likewise, on the CPU and CUDA.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from . import _C

_RELU_NODES = frozenset({"ReluBackward0", "ReluExtBackward0"})
# BatchNorm nodes whose output the replay rebuilds: PyTorch's kernels (CPU, CUDA), and cuDNN's,
# which the CUDA replay matches where its verification says so.
_BN_NODES = frozenset({"NativeBatchNormBackward0", "CudnnBatchNormBackward0"})


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


def _activation_of(fn: Any) -> tuple[str, list[float]] | None:
    """The op and Scalar arguments of the activation whose node is `fn`, as the
    replay takes them, or None (another node, or PyTorch's ThresholdBackward0,
    which does not keep ``value``)."""
    name = fn.name()
    if name in _RELU_NODES:
        return "relu", []
    hit = _FAMILY_NODES.get(name)
    if hit is None:
        return None
    act, ours = hit
    args = fn._saved_args[: len(act.params)] if ours else tuple(getattr(fn, f"_saved_{p}", None) for p in act.params)
    if any(a is None for a in args):
        return None
    return act.name, [float(a) for a in args]


def _after_batchnorm(fn: Any) -> bool:
    """Whether `fn` is an activation node whose input is a BatchNorm output the replay takes, or
    a residual add (``AddBackward0``, alpha 1) of one and another tensor (see ``_replayed``)."""
    if fn.name() not in _RELU_NODES and fn.name() not in _FAMILY_NODES:
        return False
    prev = fn.next_functions[0][0] if fn.next_functions else None
    if prev is None:
        return False
    if prev.name() in _BN_NODES:
        return True
    return prev.name() == "AddBackward0" and any(f is not None and f.name() in _BN_NODES for f, _ in prev.next_functions)


_MIN_NUMEL = 4096  # below this the hooks' own cost outweighs what they save


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


# Node metadata key: output_nr -> a weak reference to what this context saved
# for that output of the node (a _Dense or _Shared): a residual add's other
# input (_kept_output). (Not the tensor: its Python object may be gone.)
_KEPT = "relu_ext.save_compact.kept"


def _note_kept(t: Tensor, packed: Any) -> None:
    t.grad_fn.metadata.setdefault(_KEPT, {})[t.output_nr] = weakref.ref(packed)


class Replayed(_Shared):
    """A saved activation output as a recipe: the BatchNorm input it was computed from
    (held by the BatchNorm's node anyway), the BatchNorm's per-channel terms, the activation;
    after a residual add, also the add's other input with its terms: a second BatchNorm's
    input, or (terms 1 and -0.0: added as it is) a tensor that other nodes keep as it is or
    compacted or rebuilt in one pass (rebuilt for this rebuild, then dropped)."""

    __slots__ = ("x", "version", "alpha", "beta", "act", "args", "x2", "version2", "alpha2", "beta2")

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

    def __init__(self, t: Tensor, dim: int, prev: Concatenated | None) -> None:
        # Detached: the same data and version counter, without the grad_fn (see _Dense).
        start = 0 if prev is None else prev.size[dim]
        piece = t.detach() if prev is None else t.narrow(dim, start, t.shape[dim] - start).clone()
        super().__init__(0 if prev is None else piece.nbytes)
        self.pieces = (piece,) if prev is None else (*prev.pieces, piece)
        self.version = t._version if prev is None else prev.version  # (of the first piece, the tensor itself)
        self.dim, self.inputs, self.size, self.stride = dim, t.grad_fn.next_functions, t.size(), t.stride()
        self.source, self.source_version = weakref.ref(t), t._version  # (verified equal to this, see live())

    def extends(self, t: Tensor, dim: int) -> bool:
        """Whether `t` begins with this concatenation: the same inputs (nodes) first, then more,
        and bit for bit the same elements."""
        inputs = t.grad_fn.next_functions
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


def _concatenation(t: Tensor, dim: int, chains: dict[tuple[Any, ...], Any]) -> Concatenated:
    """`t` (a concatenation along `dim`) in pieces: the last concatenation kept of the same other sizes,
    where `t` begins with it, and what `t` adds; else the first of a new chain."""
    key = (dim, t.dtype, t.device, t.shape[:dim] + t.shape[dim + 1:])
    ref = chains.get(key)
    prev = None if ref is None else ref()
    packed = Concatenated(t, dim, prev if prev is not None and prev.extends(t, dim) else None)
    chains[key] = weakref.ref(packed)
    return packed


def _rebuildable(t: Tensor) -> str | None:
    """The node name of a tensor kept as a recipe of what other nodes keep where its node is
    ``torch.cat``'s or ``max_pool2d``'s: a plain dense floating-point tensor on the CPU or CUDA
    (where its verification costs one host sync, as a compaction's size does); else None."""
    fn = t.grad_fn
    name = None if fn is None else fn.name()
    if name not in ("CatBackward0", "MaxPool2DWithIndicesBackward0") or not t.is_floating_point():
        return None
    return name if _plain_dense(t) else None


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(pairs: list[tuple[Tensor, Tensor]]) -> bool:
    """Whether the two tensors of each pair (same sizes and dtype, any strides) hold the same bits:
    NaN payloads and the sign of zero count. A memcmp on the CPU; elsewhere _same_bits_on_device."""
    if all(a.device.type == "cpu" for a, _ in pairs):
        return all(_C.same_bits(a, b) for a, b in pairs)
    return _same_bits_on_device(pairs)


def _same_bits_on_device(pairs: list[tuple[Tensor, Tensor]]) -> bool:
    """_same_bits with tensor ops: the pairs compared as integers of their width (bits, not values),
    on their device, with one host sync for all of them."""
    if not pairs:
        return True
    if any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device for a, b in pairs):
        raise ValueError("relu_ext: _same_bits compares tensors of the same shape, dtype and device")
    differ = [a.view(_INTS[a.element_size()]).ne(b.view(_INTS[b.element_size()])).any() for a, b in pairs]
    return not bool(torch.stack(differ).any())


def _cat_dim(t: Tensor) -> int:
    dim = t.grad_fn._saved_dim
    return (dim - 2**64 if dim >= 2**63 else dim) % t.dim()  # (kept as an unsigned integer)


# Integer types a saved integer tensor may be kept in, narrowest first.
_NARROWER = (torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32)


class Narrowed(_Shared):
    """A saved integer tensor (max-pool indices, gather indices) kept in the narrowest integer
    type that holds all its values, and widened back for backward, bit for bit, in its own layout.

    Until the context exits it holds the tensor itself: only then is it known whether the graph
    is its only holder (max-pool indices: yes; a user's token ids: no, and a narrowed copy would
    add bytes, not save them). ``settle()`` decides then."""

    __slots__ = ("tensor", "version", "dtype", "narrow")

    def __init__(self, t: Tensor) -> None:
        super().__init__(t.nbytes)
        self.tensor: Tensor | None = t
        self.version, self.dtype, self.narrow = t._version, t.dtype, None

    def settle(self) -> bool:
        """Keep the narrowed copy instead of the tensor where that is exact and frees it; whether it did."""
        t = self.tensor
        if t is None or t._version != self.version:  # (changed in place: restore() raises PyTorch's error)
            return False
        lo, hi = (int(v) for v in torch.aminmax(t))
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
        return TwoValued(mask, value, t) if bool(ok) else None

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


def _memory_order(t: Tensor) -> Tensor:
    """Dense `t`'s elements as a 1-D view in the order they lie in memory."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _bool_bits(t: Tensor) -> Tensor:
    """Dense bool `t` as a bitmap in memory order (element i: bit i % 8 of byte i // 8, as
    relu_ext's masks), on t's device: each group of 8 bytes shifted into one. A byte other than 0
    and 1 (a bool made by viewing other bytes) counts as True."""
    flat = _memory_order(t).view(torch.uint8) != 0  # one 0/1 byte per element, whatever the bytes held
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(8, dtype=torch.uint8, device=t.device)
    return (flat.view(torch.uint8).view(-1, 8) << shifts).sum(1, dtype=torch.uint8)


def _bools_of(bits: Tensor, size: torch.Size, stride: tuple[int, ...]) -> Tensor:
    """The bool tensor of _bool_bits' bitmap, in layout (size, stride)."""
    out = torch.empty_strided(size, stride, dtype=torch.bool, device=bits.device)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    unpacked = (bits.unsqueeze(1) >> shifts) & 1
    _memory_order(out).copy_(unpacked.view(-1)[: out.numel()].view(torch.bool))
    return out


class Pooled(_Shared):
    """A saved max-pool output (kept by the next layer) as a recipe: the pool's input and indices,
    which the pool's node keeps anyway (in the form this context saved them: as they are, compacted,
    rebuilt, narrowed), gathered in backward. A max-pool output is its input at the indices, bit for
    bit (verified when saved)."""

    __slots__ = ("x", "version", "indices", "iversion", "size", "stride")

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


def _source(saved: Any, unpack: Any) -> Tensor | _Shared | None:
    """What a node saved, as a recipe may read it: a tensor, or this context's own form of it, still
    fresh; without unpacking it. None for what other hooks packed."""
    x = _peek(saved, unpack)
    if x is not None:
        return x.detach()
    data = saved.data
    if saved.unpack_hook is unpack and isinstance(data, _Shared) and data.fresh():
        return data
    return None


def _pooled(t: Tensor, unpack: Any) -> Pooled | None:
    """`t` (a max_pool2d output, N x C x h x w) as a verified recipe, or None."""
    if t.dim() != 4:
        return None
    fn = t.grad_fn
    x, indices = _source(fn._raw_saved_self, unpack), _source(fn._raw_saved_result1, unpack)
    if x is None or indices is None:
        return None
    at = indices.live() if isinstance(indices, _Shared) else indices
    if at.shape != t.shape or (isinstance(x, Tensor) and (x.dim() != 4 or x.dtype != t.dtype)):
        return None
    now = x.gathered(at, t.size(), t.stride()) if isinstance(x, _Shared) else _gathered(x, at, t.size(), t.stride())
    if now.dtype != t.dtype or not _same_bits([(now, t)]):
        return None
    return Pooled(x, indices, t)


def _peek(saved: Any, unpack: Any) -> Tensor | None:
    """The tensor a node saved, read without unpacking it: a tensor saved with no hooks,
    or one this context saved as it is; None for anything else (compacted, or packed
    by other hooks, whose unpacking could run code or copy data)."""
    hook = saved.unpack_hook
    data = saved.data
    if hook is None:
        return data
    if hook is unpack and isinstance(data, _Dense) and data.tensor._version == data.version:
        return data.tensor
    return None


def _like(x: Tensor | None, t: Tensor) -> bool:
    return x is not None and x.dtype == t.dtype and x.shape == t.shape and x.stride() == t.stride()


def _bn_source(bn: Any, t: Tensor, unpack: Any) -> tuple[Tensor | _Shared, Tensor, Tensor, Tensor] | None:
    """The input of BatchNorm node `bn` (laid out as `t`), its terms for `t`'s dtype, and the input
    again as a tensor, to verify with; or None. The input is a tensor, or a concatenation this context
    keeps in pieces (DenseNet's), which the recipe then rebuilds for its own rebuild, and drops."""
    saved = bn._raw_saved_input
    source = x = _peek(saved, unpack)
    if x is None and saved.unpack_hook is unpack and isinstance(saved.data, Concatenated) and saved.data.fresh():
        source, x = saved.data, saved.data.live()
    if not _like(x, t):
        return None  # (t is dense, so x is too)
    # The statistics it normalized with: in training the saved mean and invstd; in eval the running
    # ones, except where the kernel saved what it used (PyTorch's CUDA kernel: their copy and invstd).
    from_saved = bool(bn._saved_training)
    if not from_saved and t.is_cuda:
        invstd = _peek(bn._raw_saved_result2, unpack)
        from_saved = invstd is not None and invstd.numel() == t.shape[1]
    names = ("result1", "result2") if from_saved else ("running_mean", "running_var")
    mean, var = (_peek(getattr(bn, f"_raw_saved_{n}"), unpack) for n in names)
    has_weight = bn._raw_saved_weight.data is not None  # (affine=False: none)
    weight = _peek(bn._raw_saved_weight, unpack) if has_weight else None
    if mean is None or var is None or (has_weight and weight is None):
        return None
    bias_fn = bn.next_functions[2][0] if len(bn.next_functions) > 2 else None
    bias = getattr(bias_fn, "variable", None)  # an AccumulateGrad's parameter; else none (or frozen: verified)
    if bias_fn is not None and bias is None:
        return None  # a bias computed in the graph (FSDP's views of its flat parameter), which no node keeps
    eps = bn._saved_eps if bn.name() == "NativeBatchNormBackward0" else bn._saved_epsilon
    alpha, beta = _ops.bn_terms(
        None if weight is None else weight.detach(), None if bias is None else bias.detach(), mean.detach(),
        var.detach(), from_saved, float(eps), t.dtype)
    return (x.detach() if source is x else source), alpha, beta, x.detach()


def _kept_output(fn: Any, output_nr: int, t: Tensor) -> tuple[Tensor | _Shared, Tensor, Tensor, Tensor] | None:
    """Output `output_nr` of node `fn` where this context saved it for another node: as it is
    (a ResNet's max-pool output, kept by the next conv), or compacted or replayed in one pass
    (a block's output, kept by the next block's conv). What the recipe reads, the terms that
    add it as it is, and the tensor to verify with: what the recipe's rebuild will read."""
    ref = fn.metadata.get(_KEPT, {}).get(output_nr)
    packed = None if ref is None else ref()
    if isinstance(packed, _Dense) and packed.tensor._version == packed.version:
        source = now = packed.tensor
    elif isinstance(packed, _Shared) and packed.depth == 1 and packed.fresh():  # (else: the in-place error, in backward)
        source, now = packed, packed.live()
    else:
        return None
    if not _like(now, t):
        return None
    # Terms that add it as it is (x * 1 + -0.0 is x, -0.0 included; a NaN payload the check sees).
    opmath = torch.float64 if t.dtype == torch.float64 else torch.float32
    zero, one = (torch.full((t.shape[1],), v, dtype=opmath, device=t.device) for v in (0.0, 1.0))
    alpha, beta = _ops.bn_terms(None, torch.full_like(zero, -0.0), zero, one, True, 0.0, t.dtype)
    return source, alpha, beta, now


def _replayed(t: Tensor, unpack: Any) -> tuple[Replayed | None, bool]:
    """`t` (an activation output after a BatchNorm, or after a residual add of one) as a
    verified recipe, or None; and whether a recipe was tried and missed verification.

    A residual add ``out += identity`` (torchvision's BasicBlock and Bottleneck) replays
    where ``identity`` is a BatchNorm output too (the downsample's), or a tensor this
    context saved for another node (``_kept_output``): as it is (stage 1's max-pool
    output), or the previous block's output, compacted or a recipe rebuilt in one pass,
    which the rebuild makes again and drops. Not longer chains: rebuilt in backward order,
    each would rebuild its predecessors again, or hold them all. So in a stage's blocks
    two recipes alternate with a compacted output."""
    act = _activation_of(t.grad_fn)
    if act is None or t.dim() < 2:
        return None, False
    prev = t.grad_fn.next_functions[0][0]
    second = None  # the add's other input: what the recipe reads, its terms, what verification reads
    if prev.name() in _BN_NODES:
        first = _bn_source(prev, t, unpack)
    else:  # AddBackward0 (see _after_batchnorm)
        if prev._saved_alpha != 1:
            return None, False
        (a, a_nr), (b, b_nr) = prev.next_functions
        if a is None or a.name() not in _BN_NODES:
            (a, a_nr), (b, b_nr) = (b, b_nr), (a, a_nr)  # (the sum is symmetric)
        if b is None:
            return None, False
        first = _bn_source(a, t, unpack)
        second = _bn_source(b, t, unpack) if b.name() in _BN_NODES else _kept_output(b, b_nr, t)
        if second is None:
            return None, False
    if first is None:
        return None, False
    check = () if second is None else (second[3], *second[1:3])
    if not bool(_ops.bn_act_verify(first[3], *first[1:3], act[0], act[1], t.detach(), *check)):
        return None, True
    return Replayed(*first[:3], act[0], act[1], None if second is None else second[:3]), False


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
    "not_replayed": "not rebuilt from its BatchNorm (and not mostly zeros)",
    "unsupported": "unsupported type",
    "too_small": "too small",
    "too_few_zeros": "too few zeros",
}


class _Stats:
    """What a save_compact's pack hook did (kept apart from the context: the hook holds this, not the context)."""

    __slots__ = ("compacted", "replayed", "replay_misses", "concatenated", "pooled", "narrowed", "two_valued",
                 "two_valued_bytes", "two_valued_held", "kept_by_reason",
                 "compacted_bytes", "compacted_held", "replayed_bytes", "replayed_held", "concatenated_bytes",
                 "concatenated_held", "pooled_bytes", "narrowed_bytes", "narrowed_held", "kept_bytes")

    def __init__(self) -> None:
        self.compacted = self.replayed = self.replay_misses = self.concatenated = self.pooled = self.narrowed = 0
        self.two_valued = self.two_valued_bytes = self.two_valued_held = 0
        self.pooled_bytes = 0
        self.kept_by_reason = dict.fromkeys(_REASONS, 0)
        self.compacted_bytes = self.compacted_held = self.replayed_bytes = self.replayed_held = self.kept_bytes = 0
        self.concatenated_bytes = self.concatenated_held = self.narrowed_bytes = self.narrowed_held = 0

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
    """Keep activation outputs saved for backward small: rebuilt from their BatchNorm, or compacted; bit for bit.

    Saved-tensor hooks, like :class:`torch.autograd.graph.save_on_cpu`: put it
    around the forward pass of a training step. An output of ReLU or the family
    (PyTorch's or relu_ext's) that some node saves is kept once, however many
    nodes save it: *replayed* where its input is a BatchNorm output (CPU or
    CUDA): a reference to the BatchNorm's input, which its node keeps anyway,
    and a few numbers per channel, verified bit for bit when saved and rebuilt
    in backward; else *compacted* where mostly zeros (ReLU, ReLU6, Hardtanh with
    ``min_val=0``, Threshold with ``value=0``, Hardsigmoid): nonzero values
    plus a bitmap. A concatenation that begins with the previous one kept
    (DenseNet's) is kept as its pieces plus what it adds (*concatenated*,
    with recompute), a max-pool output as the pool's input at its indices
    (*pooled*, with recompute), an integer tensor only the graph holds (max-pool
    indices) in the narrowest type that holds it (*narrowed*, at the exit), and
    one of +0 and one other value that no node made (dropout's noise, a bool
    tensor) as a bitmap (*two_valued*). Data changed in place after the forward gives
    backward the values it had then or PyTorch's in-place error, never new data.

    ``with`` gives the context, which counts what its hooks did (over all its
    blocks; each distinct tensor once): ``replayed``, ``replay_misses`` (recipes
    that failed their check; then compacted or kept), ``compacted``,
    ``concatenated``, ``pooled``, ``narrowed``, ``two_valued``, ``kept``
    and ``kept_by_reason`` (``not_activation``, ``not_replayed``, ``too_small``
    (under 4096 elements), ``too_few_zeros``, ``unsupported``),
    ``bytes_saved_for_backward`` (what the graph would hold without the hooks),
    ``bytes_held`` (what it holds with them; a relu_ext mask or a BatchNorm
    input held anyway is not counted), ``report()`` in words and ``repr()``.
    Details: docs/save_compact.md.

    Args:
        min_saving (float): compact a tensor only if that saves at least this
            fraction of its bytes. Default: ``0.1``.
        recompute (bool): keep activation outputs after a BatchNorm as
            recipes, concatenations in pieces, max-pool outputs as their
            input at their indices. Default: ``True``.

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

    def __init__(self, min_saving: float = 0.1, recompute: bool = True) -> None:
        if not 0.0 <= min_saving < 1.0:
            raise ValueError(f"relu_ext.save_compact: min_saving must be in [0, 1), got {min_saving}")
        self.min_saving = min_saving
        self.recompute = recompute = bool(recompute)
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
        # Integer tensors to narrow when the context exits (settle()): id -> its Narrowed,
        # which holds the tensor until then (so the id stays its own).
        ints = self._ints = {}
        # The last concatenation kept in pieces, by its dimension and its other sizes (_concatenation).
        chains = self._chains = {}

        def pack(t: Tensor) -> Any:
            base = t._base
            if base is not None and _alias(t, base):
                t = base  # (FSDP2 passes a module's inputs through a Function that returns views of them)
            elif base is not None and _whole_view(t, base) and _why_kept(base, recompute) is None:
                # (A Linear on a 3-D activation output keeps a 2-D view of it: kept as the output.)
                packed = pack_tensor(base)
                return _Dense(t) if isinstance(packed, _Dense) else _ViewOf(packed, t, base)
            return pack_tensor(t)

        def pack_tensor(t: Tensor) -> Any:
            why = _why_kept(t, recompute)
            recipe = _rebuildable(t) if recompute and why == "not_activation" else None
            if why == "not_activation" and _narrowable(t):
                packed = ints.get(id(t))
                if packed is None or packed.version != t._version:
                    packed = ints[id(t)] = Narrowed(t)
                    stats.keep(why, t)  # (until settled)
                packed.pending += 1
                return packed
            if why == "not_activation" and _two_valued_candidate(t):
                hit = cache.get(t)
                if hit is None or hit[0] != t._version:
                    with torch.no_grad():
                        packed = TwoValued.of(t)
                    hit = cache[t] = (t._version, packed)
                    if packed is not None:
                        stats.two_valued += 1
                        stats.two_valued_bytes += t.nbytes
                        stats.two_valued_held += packed.nbytes
                if hit[1] is not None:
                    hit[1].pending += 1
                    return hit[1]
            if why is not None and recipe is None:
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
                dense = _Dense(t)
                if recompute and t.grad_fn is not None and why == "not_activation":
                    _note_kept(t, dense)
                return dense
            hit = cache.get(t)
            if hit is None or hit[0] != t._version:
                fn, packed, missed = t.grad_fn, None, False
                zeros = _mostly_zeros(fn)
                with torch.no_grad():
                    if recipe == "CatBackward0":
                        packed = _concatenation(t, _cat_dim(t), chains)
                    elif recipe is not None:
                        packed = _pooled(t, unpack)
                    elif recompute and _after_batchnorm(fn):
                        packed, missed = _replayed(t, unpack)
                    if packed is None and zeros:
                        packed = _compacted(t, min_saving)
                hit = (t._version, packed)
                cache[t] = hit  # counted again when changed in place: a second form is held
                if recompute and packed is not None:
                    _note_kept(t, packed)
                stats.replay_misses += missed
                if isinstance(packed, Replayed):
                    stats.replayed += 1
                    stats.replayed_bytes += t.nbytes
                    stats.replayed_held += packed.nbytes
                elif isinstance(packed, Pooled):
                    stats.pooled += 1
                    stats.pooled_bytes += t.nbytes
                elif isinstance(packed, Concatenated):
                    if len(packed.pieces) == 1:
                        stats.keep("not_activation", t)  # (the first of a chain: as it is)
                    else:
                        stats.concatenated += 1
                        stats.concatenated_bytes += t.nbytes
                        stats.concatenated_held += packed.nbytes
                elif packed is not None:
                    stats.compacted += 1
                    stats.compacted_bytes += t.nbytes
                    stats.compacted_held += packed.nbytes
                else:
                    stats.keep("not_activation" if recipe else "too_few_zeros" if zeros else "not_replayed", t)
            if hit[1] is None:
                dense = _Dense(t)
                if recompute:
                    _note_kept(t, dense)
                return dense
            hit[1].pending += 1
            return hit[1]

        def unpack(packed: Any) -> Tensor:
            return packed.restore()

        super().__init__(pack, unpack)

    def __enter__(self) -> save_compact:
        super().__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        st = self._stats
        with torch.no_grad():
            for packed in self._ints.values():
                if packed.settle():
                    full = packed.narrow.numel() * packed.dtype.itemsize
                    st.kept_by_reason["not_activation"] -= 1
                    st.kept_bytes -= full
                    st.narrowed += 1
                    st.narrowed_bytes += full
                    st.narrowed_held += packed.nbytes
        self._ints.clear()
        self._chains.clear()

    @property
    def compacted(self) -> int:
        """Distinct tensors saved for backward that were kept compacted."""
        return self._stats.compacted

    @property
    def replayed(self) -> int:
        """Distinct tensors saved for backward that were kept as recipes (rebuilt from their BatchNorm)."""
        return self._stats.replayed

    @property
    def replay_misses(self) -> int:
        """Recipes that failed their bit-for-bit check when saved (those tensors were compacted or kept)."""
        return self._stats.replay_misses

    @property
    def concatenated(self) -> int:
        """Distinct concatenations saved for backward (DenseNet's) kept as pieces shared with the one before."""
        return self._stats.concatenated

    @property
    def pooled(self) -> int:
        """Distinct max-pool outputs saved for backward kept as recipes (the pool's input at its indices)."""
        return self._stats.pooled

    @property
    def narrowed(self) -> int:
        """Distinct integer tensors saved for backward (max-pool indices, ...) kept in a narrower integer type."""
        return self._stats.narrowed

    @property
    def two_valued(self) -> int:
        """Distinct floating-point tensors saved for backward that no node made, of +0 and one other value
        (CPU dropout's noise), kept as a bitmap and that value."""
        return self._stats.two_valued

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
        st = self._stats
        return (st.compacted_bytes + st.replayed_bytes + st.concatenated_bytes + st.pooled_bytes + st.narrowed_bytes
                + st.two_valued_bytes + st.kept_bytes)

    @property
    def bytes_held(self) -> int:
        """Bytes the graph holds for them: tensors kept as they are, the compacted ones' values and bitmaps,
        the recipes' per-channel terms, the concatenations' own pieces, the narrowed integer tensors, the
        two-valued tensors' bitmaps."""
        st = self._stats
        return (st.compacted_held + st.replayed_held + st.concatenated_held + st.narrowed_held + st.two_valued_held
                + st.kept_bytes)

    def report(self) -> str:
        """What the hooks did, in words (see the class documentation)."""
        st, total, held = self._stats, self.bytes_saved_for_backward, self.bytes_held
        n = self.replayed + self.compacted + self.concatenated + self.pooled + self.narrowed + self.two_valued + self.kept
        share = f" ({100 * held / total:.1f}%)" if total else ""
        why = ", ".join(f"{k} {_REASONS[r]}" for r, k in st.kept_by_reason.items() if k)
        return "\n".join([
            f"relu_ext.save_compact: {n} tensor{'s' * (n != 1)} saved for backward, {_size(total)}, "
            f"held in {_size(held)}{share}",
            *([f"  replayed: {st.replayed} tensor{'s' * (st.replayed != 1)}, {_size(st.replayed_bytes)} held in "
               f"{_size(st.replayed_held)} (rebuilt from their BatchNorm's input); {st.replay_misses} verification "
               f"miss{'es' * (st.replay_misses != 1)}"] if st.replayed or st.replay_misses else []),
            f"  compacted: {st.compacted} tensor{'s' * (st.compacted != 1)}, {_size(st.compacted_bytes)} held in "
            f"{_size(st.compacted_held)}",
            *([f"  concatenations: {st.concatenated} tensor{'s' * (st.concatenated != 1)}, "
               f"{_size(st.concatenated_bytes)} held in {_size(st.concatenated_held)} (each the one before it, "
               f"shared, and what it adds)"] if st.concatenated else []),
            *([f"  max-pool outputs: {st.pooled} tensor{'s' * (st.pooled != 1)}, {_size(st.pooled_bytes)} held "
               f"in 0 B (gathered from the pool's input at its indices)"] if st.pooled else []),
            *([f"  narrowed: {st.narrowed} integer tensor{'s' * (st.narrowed != 1)}, {_size(st.narrowed_bytes)} "
               f"held in {_size(st.narrowed_held)} (max-pool indices and the like, in a narrower integer type)"]
              if st.narrowed else []),
            *([f"  two-valued: {st.two_valued} tensor{'s' * (st.two_valued != 1)}, {_size(st.two_valued_bytes)} "
               f"held in {_size(st.two_valued_held)} (zeros and one other value, such as dropout's noise or mask, "
               f"as a bitmap)"] if st.two_valued else []),
            f"  kept as they are: {self.kept} tensor{'s' * (self.kept != 1)}, {_size(st.kept_bytes)}"
            + (f": {why}" if why else ""),
        ])

    def __repr__(self) -> str:
        return (
            f"<relu_ext.save_compact min_saving={self.min_saving} recompute={self.recompute} replayed={self.replayed} "
            f"compacted={self.compacted} concatenated={self.concatenated} pooled={self.pooled} "
            f"narrowed={self.narrowed} two_valued={self.two_valued} kept={self.kept} "
            f"bytes_saved_for_backward={self.bytes_saved_for_backward} bytes_held={self.bytes_held}>"
        )


def _why_kept(t: Tensor, recompute: bool) -> str | None:
    """Why `t` is saved as it is (a key of ``_REASONS``), or None when it is a plain
    dense floating-point output of ReLU or the family worth keeping smaller: mostly
    zeros (compaction), or, with `recompute`, after a BatchNorm (a recipe). Cheapest
    checks first: the pack hook asks for every tensor."""
    fn = t.grad_fn
    if fn is None or not (_mostly_zeros(fn) or (recompute and _after_batchnorm(fn))):
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


def _stands_for(t: Tensor, base: Tensor) -> bool:
    """What a view needs to stand for its base: the same type, dtype and first element, and the same
    values for the same bits (not a negated or conjugated view, torch._neg_view or conj())."""
    return (type(t) is type(base) and t.dtype == base.dtype and t.storage_offset() == base.storage_offset()
            and t.is_neg() == base.is_neg() and t.is_conj() == base.is_conj())


def _alias(t: Tensor, base: Tensor) -> bool:
    """Whether view `t` has every element of its `base` where the base has it: the same bits, always,
    and the same version counter; saved as the base (a recipe or compaction of the base is one of it)."""
    return _stands_for(t, base) and t.shape == base.shape and t.stride() == base.stride()


def _whole_view(t: Tensor, base: Tensor) -> bool:
    """Whether view `t` has every element of its dense `base`, in another shape or order: the same
    block of memory (offset and size), both dense. It holds the base's bits, always, and shares its
    version counter; saved as the base's form and made again from it (_ViewOf)."""
    return _stands_for(t, base) and t.numel() == base.numel() and _is_dense(t) and _is_dense(base)


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


def _plain_dense(t: Tensor) -> bool:
    """Whether `t` is a plain strided tensor (no subclass) on the CPU or CUDA, of at least 4096
    elements, that fills a block of memory exactly once: what narrowing and bitmaps take."""
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type in ("cpu", "cuda")
            and t.numel() >= _MIN_NUMEL and _is_dense(t))


def _narrowable(t: Tensor) -> bool:
    """Whether `t` is an integer tensor that may be kept narrower (see Narrowed)."""
    return (
        t.dtype in (torch.int64, torch.int32, torch.int16)
        and not t._is_view()  # (its base's storage may be held elsewhere)
        and _plain_dense(t)
    )


_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _two_valued_candidate(t: Tensor) -> bool:
    """Whether `t` may be kept as a bitmap (see TwoValued): a plain dense tensor of at least 4096
    elements that no node made (an activation output is not), floating-point on the CPU (the
    kernels of binary_mask) or bool on the CPU or CUDA."""
    return (
        t.grad_fn is None
        and not t.requires_grad
        and ((t.dtype in _FLOATS and t.device.type == "cpu") or t.dtype == torch.bool)
        and _plain_dense(t)
    )


def _is_dense(t: Tensor) -> bool:
    """Whether `t`'s elements fill a block of memory exactly once, in any order of dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
