"""``save_compact``: the saved-tensor hooks, and the pack hook that decides each saved tensor's form (``_Packer``)."""

from __future__ import annotations

import functools
import numbers
import threading
import weakref
from collections import deque
from typing import Any, Callable

import torch
from torch import Tensor

from .. import _C
from .bits import _is_dense
from .deferred import Deferred
from .forms import Compacted, Narrowed, Widened, _Dense, _Shared, _ViewOf
from .graph import (_BN_NODES, _KEPT, _REMAKE, COMPACTS, _after_batchnorm, _mostly_zeros, _node_name, _note_kept,
                    _zeros_by_a_factor)
from .recipes import _MIN_NUMEL, FORMS_BY_NODE, Made, Recent, Row, _plain_dense
from .stats import _Stats

# The default pending_bytes on a GPU, as a fraction of its memory: several layers' outputs at
# training sizes (enough for the device to stay ahead of the host), small beside a step's
# activations. On the CPU checks are back at once; only tests' stand-in events wait there.
_PENDING_SHARE = 32
_CPU_PENDING_BYTES = 256 << 20


# The nodes whose outputs the pack hook's Python path decides (_Packer._pack): rows of the table and remade
# ops; _C.NativePacker keeps other nodes' outputs as they are (and compacts those of COMPACTS' nodes it can).
_PYTHON_NODES = frozenset(node for node in (*FORMS_BY_NODE, *_REMAKE) if node is not None)


class save_compact(torch.autograd.graph.saved_tensors_hooks):
    """Keep activation outputs saved for backward small: rebuilt from their BatchNorm, or compacted; bit for bit.

    Saved-tensor hooks, like :class:`torch.autograd.graph.save_on_cpu`: put it around the forward
    pass of a training step. An output of ReLU or the family (PyTorch's or relu_ext's) that some
    node saves is kept once, however many nodes save it: *replayed* where its input is a BatchNorm
    output (CPU or CUDA): a reference to the BatchNorm's input, which its node keeps anyway, and a
    few numbers per channel, verified bit for bit when saved and rebuilt in backward; else
    *compacted* where mostly zeros (ReLU, ReLU6, Hardtanh with ``min_val=0``, Threshold with
    ``value=0``, Hardsigmoid, a dropout of such an output): nonzero values plus a bitmap. A
    concatenation that begins with the previous one kept (DenseNet's) is kept as its pieces plus
    what it adds (*concatenated*, with recompute), a max-pool output as the pool's input at its
    indices (*pooled*, with recompute), a ``mul``, ``div``, LayerNorm, GELU or SiLU output as that op
    and the inputs its node keeps, a widening cast as the cast of a copy in its input's dtype
    (*remade*, with recompute; a view of it with all its elements, as a Linear keeps, too), an
    integer tensor only the graph holds (max-pool indices) in the narrowest type that holds it
    (*narrowed*, at the exit), and one of +0 and one other value that no node made (dropout's noise,
    a bool tensor) as a bitmap (*two_valued*). Data changed in place after the forward gives PyTorch's
    in-place error, whether it lives or was freed since: never new data, nor old data silently.

    ``with`` gives the context, which counts what its hooks did (over all its blocks; each distinct
    tensor once): ``replayed``, ``replay_misses`` (recipes that failed their check; then compacted
    or kept), ``compacted``, ``concatenated``, ``pooled``, ``remade``, ``narrowed``, ``two_valued``, ``kept``
    and ``kept_by_reason`` (``not_activation``, ``not_replayed``, ``too_small`` (under 4096
    elements), ``too_few_zeros``, ``unsupported``), ``bytes_saved_for_backward`` (what the graph
    would hold without the hooks), ``bytes_held`` (what it holds with them; a relu_ext mask or a
    BatchNorm input held anyway is not counted), ``report()`` in words (what is held outside the
    graph apart) and ``repr()``. Details: docs/save_compact.md.

    Args:
        min_saving (float): compact a tensor only if that saves at least this
            fraction of its bytes. Default: ``0.1``.
        recompute (bool): keep activation outputs after a BatchNorm as
            recipes, concatenations in pieces, max-pool outputs as their
            input at their indices. Default: ``True``.
        pending_bytes (int, optional): bytes held as they are while checks run on the device
            (docs/save_compact.md). Default: ``None``, 1/32 of the GPU's memory.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        >>> with relu_ext.save_compact() as sc:
        ...     loss = model(torch.randn(64, 256)).sum()
        >>> loss.backward()
        >>> sc.compacted, sc.kept, sc.kept_by_reason["not_activation"]
        (1, 2, 2)
        >>> print(sc.report())
        relu_ext.save_compact: 2 tensors saved for backward, 128.00 KiB, held in 97.93 KiB (76.5%)
          compacted: 1 tensor, 64.00 KiB held in 33.93 KiB
          kept as they are: 1 tensor, 64.00 KiB: 1 not an activation output
          held outside the graph: 1 tensor, 10.00 KiB (parameters, buffers, inputs and views of them)

    (The ReLU's output, saved by its node and by the second Linear, is compacted once.)
    """

    def __init__(self, min_saving: float = 0.1, recompute: bool = True, pending_bytes: int | None = None) -> None:
        if isinstance(min_saving, bool) or not isinstance(min_saving, numbers.Real):
            raise TypeError(f"relu_ext.save_compact: min_saving must be a number, got {type(min_saving).__name__}")
        if not 0.0 <= min_saving < 1.0:
            raise ValueError(f"relu_ext.save_compact: min_saving must be in [0, 1), got {min_saving}")
        if pending_bytes is not None and (isinstance(pending_bytes, bool) or not isinstance(pending_bytes, int)
                                          or pending_bytes < 0):
            raise ValueError(f"relu_ext.save_compact: pending_bytes must be None or an int >= 0, got {pending_bytes!r}")
        self.min_saving = min_saving
        self.recompute = bool(recompute)
        self._stats = _Stats()
        self._packer = _Packer(min_saving, self.recompute, self._stats, pending_bytes)
        super().__init__(self._packer.pack, self._packer.unpack)

    def __enter__(self) -> save_compact:
        super().__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        super().__exit__(*args)
        self._packer.exit()

    @property
    def compacted(self) -> int:
        """Distinct tensors saved for backward that were kept compacted."""
        return self._settled().count["compacted"]

    @property
    def replayed(self) -> int:
        """Distinct tensors saved for backward that were kept as recipes (rebuilt from their BatchNorm)."""
        return self._settled().count["replayed"]

    @property
    def replay_misses(self) -> int:
        """Recipes that failed their bit-for-bit check when saved (those tensors were compacted or kept)."""
        return self._settled().replay_misses

    @property
    def concatenated(self) -> int:
        """Distinct concatenations saved for backward (DenseNet's) kept as pieces shared with the one before."""
        return self._settled().count["concatenated"]

    @property
    def pooled(self) -> int:
        """Distinct max-pool outputs saved for backward kept as recipes (the pool's input at its indices)."""
        return self._settled().count["pooled"]

    @property
    def remade(self) -> int:
        """Distinct tensors saved for backward kept as the ops that made them (mul, add, div, casts, GELU,
        SiLU, tanh, ..., LayerNorm) and their inputs, which the graph keeps anyway; run again in backward."""
        return self._settled().count["remade"]

    @property
    def remade_by_op(self) -> dict[str, int]:
        """``remade`` by the op that made each tensor (its last op, for a chain): ``{"mul": 2, ...}``."""
        return dict(self._settled().ops)

    @property
    def narrowed(self) -> int:
        """Distinct integer tensors saved for backward (max-pool indices, ...) kept in a narrower integer type."""
        return self._settled().count["narrowed"]

    @property
    def two_valued(self) -> int:
        """Distinct floating-point tensors saved for backward that no node made, of +0 and one other value
        (CPU dropout's noise), kept as a bitmap and that value."""
        return self._settled().count["two_valued"]

    @property
    def kept(self) -> int:
        """Distinct tensors saved for backward as they are (``kept_by_reason`` says why)."""
        return self._settled().kept

    @property
    def kept_by_reason(self) -> dict[str, int]:
        """``kept`` by reason: ``not_activation``, ``unsupported``, ``too_small``, ``too_few_zeros``."""
        return dict(self._settled().kept_by_reason)

    @property
    def bytes_saved_for_backward(self) -> int:
        """Bytes of the distinct tensors saved for backward: what the graph would hold without the hooks."""
        return sum(self._settled().nbytes.values())

    @property
    def bytes_held(self) -> int:
        """Bytes the graph holds for them: tensors kept as they are, the compacted ones' values and bitmaps,
        the recipes' per-channel terms, the concatenations' own pieces, the narrowed integer tensors, the
        two-valued tensors' bitmaps."""
        return sum(self._settled().held.values())

    def report(self) -> str:
        """What the hooks did, in words (see the class documentation)."""
        return self._settled().report()

    def _settled(self) -> _Stats:
        """The counts, once every check the hooks hold has come back (reading them waits for those)."""
        self._packer.settle()
        return self._stats

    def __repr__(self) -> str:
        fields = {**self._settled().counts(), "bytes_saved_for_backward": self.bytes_saved_for_backward,
                  "bytes_held": self.bytes_held}
        return (f"<relu_ext.save_compact min_saving={self.min_saving} recompute={self.recompute} "
                + " ".join(f"{name}={value}" for name, value in fields.items()) + ">")


class _Unpack:
    """A context's own unpack hook: the graph holds it and recipes tell this context's saved forms by
    it (``SavedTensor.unpack_hook is``), so each context has one, and it holds its packer weakly (the
    graph would otherwise keep the packer's state alive): each unpack resolves the checks that have
    come back (_Packer.poll), under the packer's lock: backward unpacks on a thread per device."""

    __slots__ = ("packer",)

    def __init__(self, packer: _Packer) -> None:
        self.packer = weakref.ref(packer)

    def __call__(self, packed: Any) -> Tensor:
        owner = self.packer()
        if owner is None:
            return packed.restore()
        with owner.lock:
            owner.poll()
            return packed.restore()


class _Packer:
    """A save_compact's pack hook (``pack``), its unpack hook (``unpack``), and what the pack hook keeps
    between calls; ``exit()`` when the context exits."""

    def __init__(self, min_saving: float, recompute: bool, stats: _Stats, budget: int | None = None) -> None:
        self.min_saving, self.recompute, self.stats = min_saving, recompute, stats
        # Held by every entry point (pack, unpack, exit, settle): autograd's engine runs backward, so
        # the unpack hooks, on a thread per device, and a form's fields and the queues below are
        # read and changed together. Reentrant: a rebuild may read other forms.
        self.lock = threading.RLock()
        self.unpack: Callable[[Any], Tensor] = _Unpack(self)
        # Saved by several nodes (a ReLU output and the conv after it), a tensor is
        # compacted, or counted as kept, once: tensor -> _Cached.
        self.cache = _ByTensor()
        # Integer tensors to narrow when the context exits (settle()): id -> its Narrowed,
        # which holds the tensor until then (so the id stays its own).
        self.ints: dict[int, Narrowed] = {}
        # The last concatenation kept in pieces, by its dimension and its other sizes (recipes._chain_key).
        self.chains: dict[tuple[Any, ...], weakref.ref] = {}
        # The last remade forms that hold their value as verified, while the forward packs.
        self.recent = Recent()
        # Forms whose check has not come back, oldest first, each with the bytes of the tensor it holds
        # until then, and those bytes in all.
        self.waiting: deque[_Check] = deque()
        self.waiting_bytes = 0
        self.budget = budget  # (None: by device, _pending_bytes)
        # The Widened forms made (weakly): decided again when the context exits.
        self.widened: list[weakref.ref] = []
        # Forms decided after the exit, whose value is on its way, oldest first: Narrowed tensors (their
        # range), Widened forms (their copy compared with the cast's input, where a node keeps that).
        self.after_exit: deque[Narrowed | Widened] = deque()
        # Tensors saved as they are that no node made and nothing marks as held elsewhere (buffers,
        # inputs), weakly, with their bytes: held outside the graph if alive when the block exits.
        self.unmade: list[tuple[weakref.ref, int]] = []
        # The tensors no form takes (most of them: parameters, buffers, masks, a convolution's output),
        # kept and counted in one C++ call; their counts join the stats when read (settle) and at the exit.
        # And the outputs of ReLU and its like that its rows would compact at once (the CPU's), kept and
        # counted as they would (_AtOnce).
        self.native = _C.NativePacker(_Dense, self.cache.entries, _MIN_NUMEL, _PYTHON_NODES, self.recent,
                                      _KEPT if recompute else None, COMPACTS, _BN_NODES, Deferred,
                                      1 - min_saving, _AtOnce(stats, self.cache))

    def pack(self, t: Tensor) -> Any:
        """The pack hook: `t` in the form it is kept in until backward unpacks it. Under CUDA-graph
        capture, as it is: a check could not come back before the graph is replayed."""
        if t.is_cuda and _capturing():
            return _Dense(t)
        with self.lock:
            self.poll()
            packed = self.native.keep(t)
            return self._pack_view(t) if packed is None else packed

    def _pack_view(self, t: Tensor) -> Any:
        """pack(), under the lock, for what the C++ path leaves: a view saved as its base where it stands for it."""
        base = t._base
        if base is None:
            return self._pack(t)
        fn = base.grad_fn
        if fn is None and base.requires_grad:
            return self._of_leaf(t, base)
        if _alias(t, base):
            t = base  # (FSDP2 passes a module's inputs through a Function that returns views of them)
        elif _node_name(fn) in FORMS_BY_NODE and _whole_view(t, base):
            # (A Linear on a 3-D tensor keeps a 2-D view of it: kept as that tensor, in its form.)
            packed = self._pack(base)
            return _ViewOf(packed, t, base) if not isinstance(packed, _Dense) else self._as_is(t)
        return self._pack(t)

    def _of_leaf(self, t: Tensor, base: Tensor) -> _Dense:
        """View `t` of a leaf that requires grad (a parameter: a Linear keeps its ``weight.t()``), saved as
        it is and counted as that leaf, once however many views of it are saved: the graph holds the
        leaf's storage, which is held outside it anyway. No row takes such a tensor."""
        if self.cache.get(base) is None and not self.native.counted(base):
            self._count_kept(base, "not_activation")
            self.cache.put(base, _Cached(base._version, _Dense(base), True))
        return self._as_is(t)

    def _as_is(self, t: Tensor) -> _Dense:
        """View `t`, counted as its base, saved as it is: noted on its node, as any tensor saved as it is
        (a later recipe may read it)."""
        dense = _Dense(t)
        if self.recompute and t.grad_fn is not None:
            _note_kept(t, dense)
        return dense

    def _pack(self, t: Tensor) -> Any:
        """`t`, no view standing for its base, in its form: each form made once per tensor and version,
        and a tensor saved again (by another node) at the same version asked nothing more."""
        hit = self.cache.get(t)
        if hit is not None and hit.version == t._version:
            return hit.packed.again()
        fn = t.grad_fn
        node = _node_name(fn)
        if self.recent.forms and node is not None and node not in _REMAKE:
            self.recent.forget()  # (a tensor of another op: the chains the values served are done)
        if node is None and _narrowable(t):
            return self._narrowed(t)
        rows = FORMS_BY_NODE.get(node)
        packed = self._form(t, rows) if rows is not None else None
        if packed is None:
            # (Changed in place and saved again: counted once as it is, however many versions.)
            counted = (hit is not None and hit.kept) or self.native.counted(t)
            packed = self._kept(t, fn, rows=rows is not None, counted=counted)
        # (A form of another version: a second form, counted again.)
        self.cache.put(t, _Cached(t._version, packed, isinstance(packed, _Dense) or (hit is not None and hit.kept)))
        return packed.again()

    def _kept(self, t: Tensor, fn: Any, rows: bool, counted: bool) -> _Dense:
        """`t` saved as it is (`rows`: some row takes its node), counted unless `counted` already."""
        why = _why_kept(t, self.recompute) if rows else "not_activation"
        if not counted:
            zeros = why is None and (_mostly_zeros(fn) or _zeros_by_a_factor(fn))  # (why None: `fn` is a node)
            self._count_kept(t, why or ("too_few_zeros" if zeros else "not_replayed"))
        dense = _Dense(t)
        if self.recompute and fn is not None and why in (None, "not_activation"):
            _note_kept(t, dense)
        return dense

    def _narrowed(self, t: Tensor) -> Narrowed:
        """Integer `t` as a Narrowed, one per tensor and version: narrowed, or not, when the context exits."""
        packed = self.ints.get(id(t))
        if packed is None or packed.saved_version != t._version:
            packed = self.ints[id(t)] = Narrowed(t)
            self.stats.keep("not_activation", t.nbytes)  # (until settled)
        return packed.again()

    def _count_kept(self, t: Tensor, why: str) -> None:
        """Count `t`, saved as it is for `why` (once however many nodes save it: see _pack)."""
        base = t._base
        if base is None:
            base = t
        # Held outside the graph: a leaf that requires grad (a parameter), a view of one; and what
        # no node made that something else still holds when the block exits (a frozen parameter, a
        # buffer, the step's input: see exit). What the step made without autograd (BatchNorm's
        # saved mean) only the graph holds by then.
        nbytes = t.nbytes
        outside = why == "not_activation" and base.grad_fn is None
        leaf = outside and base.requires_grad
        self.stats.keep(why, nbytes, leaf)
        if outside and not leaf:
            self.unmade.append((weakref.ref(base), nbytes))

    def _form(self, t: Tensor, rows: tuple[Row, ...]) -> _Shared | None:
        """`t` in the form of the first of `rows` (those of FORMS that take its node) that applies to it,
        can be made and whose check does not fail at once; None: saved as it is. A row's applies() is
        asked only when the rows before it made nothing (most replays need no compaction's), and grad
        mode is turned off once one applies (most saved tensors no row applies to)."""
        grad = None
        try:
            for row in rows:
                if not row.applies(t, self.recompute):
                    continue
                if grad is None:
                    grad = torch.is_grad_enabled()
                    torch._C._set_grad_enabled(False)  # (what torch.no_grad() does, without its Python calls: see docs/performance.md)
                made = row.make(t, self)
                if made is not None and self._verify(made, t):
                    if self.recompute and t.grad_fn is not None:
                        _note_kept(t, made.form)
                    return made.form
            return None
        finally:
            if grad is not None:
                torch._C._set_grad_enabled(grad)

    def _verify(self, made: Made, t: Tensor) -> bool:
        """Every form's check, one path: a form exact as made is counted; else it holds `t` itself and
        its check starts, resolved at once where its value is back (on the CPU, always; a form made in
        steps takes each step), else held until it is (resolve). False: missed at once."""
        form, flag = made
        if flag is None:
            self._count(form, t.nbytes)
            return True
        form.hold(t)
        check = Deferred(flag)
        while check.done():
            outcome = form.checked(check)
            if not isinstance(outcome, Deferred):
                return self._decided(form, outcome, t.nbytes)
            check = outcome
        self._hold(form, check, t.nbytes, t.device)
        return True

    def _decided(self, form: _Shared, outcome: bool | str, nbytes: int) -> bool:
        """`form`'s last check came back with `outcome` (True: exact; else why it missed): drop the tensor
        it held where exact, and count it; whether it was."""
        form.resolved(outcome is True)
        if outcome is True:
            self._count(form, nbytes)
            return True
        self.stats.replay_misses += form.kind == "replayed"
        if form.op_name is not None:
            self.stats.op_misses[form.op_name] += 1
        return False

    def _count(self, form: _Shared, nbytes: int) -> None:
        """Count a tensor of `nbytes` bytes kept as `form` (the first concatenation of a chain: as it is)."""
        if form.kept_as_is():
            self.stats.keep(form.missed_as, nbytes)
        else:
            self.stats.add(form.kind, nbytes, form.nbytes, form.op_name)

    def _hold(self, form: _Shared, check: Deferred, nbytes: int, device: torch.device) -> None:
        """Let `form` stand for its tensor, of `nbytes` bytes on `device`, as that tensor until `check`
        comes back; past the budget of bytes held so, wait for the oldest such checks, never for this
        one (waiting for the newest work would drain the device's whole queue: a synchronization)."""
        newest = _Check(form, check, nbytes)
        self.waiting.append(newest)
        self.waiting_bytes += nbytes
        self.poll()
        budget = self.budget if self.budget is not None else _pending_bytes(device)
        while self.waiting_bytes > budget and self.waiting and self.waiting[0] is not newest and not _capturing():
            self.resolve()

    def poll(self) -> None:
        """Resolve the checks that have come back, oldest first, without waiting: the first one that
        has not stops the rest (a device's queue runs in order). Not under CUDA-graph capture."""
        if not (self.waiting or self.after_exit) or _capturing():  # (the first: every pack and unpack asks)
            return
        while self.waiting and self.waiting[0].check.done():
            self.resolve()
        self._settle(wait=False)

    def resolve(self) -> None:
        """Resolve the oldest check held, waiting for it: drop the tensor its form held where the form is
        exact, else keep the tensor; count it either way. A form made in steps goes to the back with
        its next step's check."""
        held = self.waiting.popleft()
        outcome = held.form.checked(held.check)
        if isinstance(outcome, Deferred):
            held.check = outcome
            self.waiting.append(held)
            return
        self.waiting_bytes -= held.nbytes
        if outcome is True and not held.form.whole.unchanged():
            outcome = "unsupported"  # (changed in place meanwhile: kept as it is, backward raises PyTorch's error)
        if not self._decided(held.form, outcome, held.nbytes):
            self.stats.keep(outcome, held.nbytes)

    def settle(self) -> None:
        """Wait for every check held, and for the values of the forms decided after the exit (before counts
        are read)."""
        with self.lock:
            while self.waiting:
                self.resolve()
            self._settle(wait=True)
            self.stats.keep_many("not_activation", *self.native.take())

    def exit(self) -> None:
        """When the context exits: resolve what has come back; count what is held outside the graph; start
        narrowing the integer tensors only the graph holds now, and comparing the widened casts' copies with
        their input (their values read later, see _settle); forget the chains."""
        with self.lock:
            self._exit()

    def _exit(self) -> None:
        """exit(), under the lock."""
        self.poll()
        for ref, nbytes in self.unmade:
            if ref() is not None:  # (the graph holds a detached copy's object, not this one)
                self.stats.held_outside(1, nbytes)
        self.unmade.clear()
        self.stats.keep_many("not_activation", *self.native.take())
        self.stats.held_outside(*self.native.outside())
        # Under CUDA-graph capture the integer tensors and the widened copies stay as they are: their
        # values would come back at the graph's replay.
        if not _capturing():
            forms = [*self.ints.values(), *filter(None, (ref() for ref in self.widened))]
            with torch.no_grad():
                for form in forms:
                    form.measure()
            self.after_exit.extend(forms)
            self._settle(wait=False)
        self.ints.clear()
        self.widened.clear()
        self.chains.clear()
        self.recent.forget()

    def _settle(self, wait: bool) -> None:
        """Settle the forms decided after the exit whose value has come back (with `wait`, all of them):
        narrow the integer tensors (counted as kept until then), let the widened casts read their input."""
        if not self.after_exit:
            return
        with torch.no_grad():
            while self.after_exit and (wait or self.after_exit[0].measured()):
                form = self.after_exit.popleft()
                held = form.nbytes
                if not form.settle():
                    continue
                if isinstance(form, Narrowed):
                    full = form.narrow.numel() * form.dtype.itemsize
                    self.stats.moved("not_activation", form.kind, full, form.nbytes)
                else:
                    self.stats.freed(form.kind, held)


@functools.lru_cache(maxsize=None)
def _pending_bytes(device: torch.device) -> int:
    """save_compact's default pending_bytes for tensors on `device`."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // _PENDING_SHARE
    return _CPU_PENDING_BYTES


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph: then nothing may ask the device anything
    or wait for it (an event query or synchronize would end the capture in an error), and no check
    made now could come back before the graph is replayed."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class _ByTensor:
    """A map from live tensors (their Python objects, by identity) to values. It does not hold the
    tensors: an entry, with its value, goes when its tensor is freed. What torch's
    WeakTensorKeyDictionary does, without a Python key object per lookup: the pack hook asks it of
    every saved tensor."""

    __slots__ = ("entries", "me", "__weakref__")

    def __init__(self) -> None:
        self.entries: dict[int, tuple[weakref.ref, Any]] = {}
        self.me = weakref.ref(self)  # (what each entry's callback finds this by: no cycle)

    def get(self, t: Tensor) -> Any:
        """The value put for `t` while it lives, else None."""
        entry = self.entries.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def put(self, t: Tensor, value: Any) -> None:
        """Map `t` to `value` until `t` is freed."""
        key = id(t)
        self.entries[key] = (weakref.ref(t, functools.partial(_ByTensor._drop, self.me, key)), value)

    @staticmethod
    def _drop(owner: weakref.ref, key: int, ref: weakref.ref) -> None:
        """A tensor's weak reference `ref` died: drop its entry (not a newer one under its id)."""
        by_tensor = owner()
        entry = None if by_tensor is None else by_tensor.entries.get(key)
        if entry is not None and entry[0] is ref:
            by_tensor.entries.pop(key, None)


class _AtOnce:
    """What the C++ path (_C.NativePacker) calls with a tensor it compacted at once, as the compaction row would
    have (recipes._compacted, Compacted.now): its form, counted (_Packer._count), cached and returned for one
    node (_Packer._pack); the C++ path notes it on the tensor's node (_Packer._form's note). Holds no
    packer: the C++ path, which holds this, is not seen by Python's garbage collector."""

    __slots__ = ("stats", "cache")

    def __init__(self, stats: _Stats, cache: _ByTensor) -> None:
        self.stats, self.cache = stats, cache

    def __call__(self, t: Tensor, values: Tensor, mask: Tensor, shared: bool, nbytes: int) -> Compacted:
        form = Compacted.at_once(t, values, mask, shared, nbytes)
        self.stats.add(form.kind, t.nbytes, nbytes, None)
        self.cache.put(t, _Cached(t._version, form, False))
        return form.again()


class _Cached:
    """What the pack hook made of a tensor, for the nodes that save it again: the tensor's `version`
    then, what it was `packed` as, and whether it was counted as `kept` as it is (once, however many
    versions: a tensor saved as it is holds its storage once, whatever it went through)."""

    __slots__ = ("version", "packed", "kept")

    def __init__(self, version: int, packed: Any, kept: bool) -> None:
        self.version, self.packed, self.kept = version, packed, kept


class _Check:
    """A form's check on its way to the host (see _Shared.checked), with the bytes of the tensor the
    form holds until then. The form is held here, not weakly: its counts need it, and its graph may
    be gone first (a step that raised); it goes at the next resolution."""

    __slots__ = ("form", "check", "nbytes")

    def __init__(self, form: _Shared, check: Deferred, nbytes: int) -> None:
        self.form, self.check, self.nbytes = form, check, nbytes


def _why_kept(t: Tensor, recompute: bool) -> str | None:
    """Why `t` is saved as it is (a key of ``stats._REASONS``), or None when it is a plain
    dense floating-point output of ReLU or the family worth keeping smaller: mostly
    zeros (compaction; or a product with such an output: dropout after a ReLU), or, with
    `recompute`, after a BatchNorm (a recipe): the rows of those forms apply to no other
    (recipes._zeros_mostly, recipes._zeros_of_a_factor, recipes._after_a_batchnorm).
    The pack hook asks it of a tensor kept as it is, for the reason it counts, and of a
    view's base (_pack_view): cheapest checks first."""
    fn = t.grad_fn
    if fn is None or not (_mostly_zeros(fn) or _zeros_by_a_factor(fn) or (recompute and _after_batchnorm(fn))):
        return "not_activation"
    if (
        type(t) is not torch.Tensor
        or not t.is_floating_point()
        or t.layout != torch.strided
        or not (t.is_cpu or t.is_cuda)
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
    return t.shape == base.shape and t.stride() == base.stride() and _stands_for(t, base)


def _whole_view(t: Tensor, base: Tensor) -> bool:
    """Whether view `t` has every element of its dense `base`, in another shape or order: the same
    block of memory (offset and size), both dense. It holds the base's bits, always, and shares its
    version counter; saved as the base's form and made again from it (_ViewOf)."""
    return _stands_for(t, base) and t.numel() == base.numel() and _is_dense(t) and _is_dense(base)


def _narrowable(t: Tensor) -> bool:
    """Whether `t` is an integer tensor that may be kept narrower (see Narrowed)."""
    return (
        t.dtype in (torch.int64, torch.int32, torch.int16)
        and not t._is_view()  # (its base's storage may be held elsewhere)
        and _plain_dense(t)
    )
