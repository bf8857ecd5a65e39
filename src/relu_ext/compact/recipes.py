"""``save_compact()``'s table of forms (``FORMS``), and how each is made from a saved tensor: recipes
read from the graph (``Replayed``, ``Pooled``, ``Concatenated`` chains), compaction, bitmaps.

A row says when it applies to a tensor (cheap: the tensor's kind and its node) and makes the form
with the flag, on the tensor's device, that says whether the form is exact (``Made``). The pack
hook (hooks._Packer._form) tries the rows that apply in order and keeps the first form whose check
does not fail at once; it owns everything else: the check, holding the tensor until the check is
back, the fallback to the next row, the counts. Adding a form is one class (forms.py) and one row.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from typing import Any, Callable, NamedTuple, Protocol

import torch
from torch import Tensor

from .. import _C
from .bits import _bool_bits, _like, _same_bits_later
from .deferred import Deferred
from .forms import (EPS_BY_WEIGHT, LAYER_NORM_EPS, Chain, Compacted, Concatenated, LayerNormOf, Pooled, Remade,
                    RemadeNorm, Replayed, TwoValued, Widened, _Dense, _eps_probes, _gathered, _Shared, _ViewOf,
                    run_as_forward)
from .graph import (_CAST, _CAT, _FIND, _LAYER_NORM, _MAX_POOL, _REMAKE, _SOFTMAX, ACTIVATION_NODES, REMAKE_VIEWS,
                    _activation_of, _after_batchnorm, _batchnorm_inputs, _bn_bias, _bn_eps, _bn_training, _cast_from,
                    _cast_input, _cat_dim, _inputs, _is_batchnorm, _kept, _layer_norm_saved, _leaf, _mostly_zeros,
                    _node_inputs, _node_key, _note_eps, _noted_eps, _raw_saved, _relu_ext_mask, _remake_of, _Saved,
                    _softmax_scores, _zeros_by_a_factor, PRODUCTS)

_ops = torch.ops.relu_ext
_MIN_NUMEL = 4096  # below this the hooks' own cost outweighs what they save


class Packing(Protocol):
    """What a row's ``make`` reads of the pack hook (hooks._Packer)."""

    unpack: Callable[[Any], Tensor]  # its unpack hook: what tells this context's saved forms apart
    chains: dict[tuple[Any, ...], weakref.ref]  # the last concatenation kept, by _chain_key
    recent: Recent  # the last remade forms holding their value as verified
    widened: list[weakref.ref]  # the Widened forms made, decided again when the context exits
    min_saving: float


class Made(NamedTuple):
    """A form made from a saved tensor, and the check that it restores the tensor bit for bit: a
    flag on the tensor's device (read later, see deferred.py), or None where it is exact as made."""

    form: _Shared
    flag: Tensor | None


class Row(NamedTuple):
    """A row of the table of forms: the `nodes` whose outputs it takes (their names; None: tensors no
    node made), ``applies(t, recompute)`` among those, and ``make(t, packer)``: the form and its
    check, or None where it cannot be made. A form declares its ``kind`` (what it is counted as)
    and ``missed_as`` (why a tensor whose check failed is kept)."""

    form: type[_Shared]
    nodes: frozenset[str | None]
    applies: Callable[[Tensor, bool], bool]
    make: Callable[[Tensor, Packing], "Made | None"]


def _extended(t: Tensor, packer: Packing) -> Made | None:
    """`t` (a concatenation) in pieces: the last concatenation kept of the same dimension and other
    sizes, where `t` begins with it by the graph, and what `t` adds; checked by its data."""
    dim = _cat_dim(t)
    ref = packer.chains.get(_chain_key(t, dim))
    prev = None if ref is None else ref()
    same = None if prev is None else prev.extends(t, dim)
    if same is None:
        return None
    return _chained(t, Concatenated(t, dim, prev), packer, same)


def _chain_start(t: Tensor, packer: Packing) -> Made:
    """`t` (a concatenation) as the first of a chain: kept as it is, the next one's first piece."""
    return _chained(t, Concatenated(t, _cat_dim(t), None), packer, None)


def _chained(t: Tensor, packed: Concatenated, packer: Packing, flag: Tensor | None) -> Made:
    """`packed`, now the last concatenation of its chain (a later row replaces it where it misses)."""
    packer.chains[_chain_key(t, packed.dim)] = weakref.ref(packed)
    return Made(packed, flag)


def _chain_key(t: Tensor, dim: int) -> tuple[Any, ...]:
    """The concatenations a chain may hold: the same dimension, dtype, device and other sizes."""
    return (dim, t.dtype, t.device, t.shape[:dim] + t.shape[dim + 1:])


def _source(saved: _Saved, unpack: Any) -> Tensor | _Shared | None:
    """What a node saved, as a recipe may read it: a tensor, or this context's own form of it, still
    fresh; without unpacking it. None for what other hooks packed."""
    x = _peek(saved, unpack)
    if x is not None:
        return x.detach()
    data = saved.data
    if saved.unpack_hook is unpack and isinstance(data, _Shared) and data.fresh():
        return data
    return None


def _pooled(t: Tensor, packer: Packing) -> Made | None:
    """`t` (a max_pool2d output, N x C x h x w) as a recipe: the pool's input at its indices."""
    if t.dim() != 4:
        return None
    x, indices = (_source(_raw_saved(t.grad_fn, name), packer.unpack) for name in ("self", "result1"))
    if x is None or indices is None:
        return None
    at = indices.live() if isinstance(indices, _Shared) else indices
    if at.shape != t.shape or (isinstance(x, Tensor) and (x.dim() != 4 or x.dtype != t.dtype)):
        return None
    now = x.gathered(at, t.size(), t.stride()) if isinstance(x, _Shared) else _gathered(x, at, t.size(), t.stride())
    if now.dtype != t.dtype:
        return None
    return Made(Pooled(x, indices, t), _same_bits_later([(now, t)]))


# Elements of a softmax remade from a copy checked at a time when saved (_softmax_widened).
_CHECK_BLOCK = 1 << 18

# The most ops a remade chain runs (each a pass over a tensor in backward).
_MAX_OPS = 8


class _Chaining:
    """The inputs of a remade tensor (see _remade), found by walking the graph from its node: the
    sources the chain reads (each once), and whether any op's bits depend on the split of its work."""

    def __init__(self, packer: Packing, find: bool = False) -> None:
        self.packer = packer
        self.find = find  # (whether the ops of graph._FIND may run too: a chain run only when saved)
        self.sources: list[Tensor | _Shared] = []
        self.by_split = False
        self.ops_left = _MAX_OPS
        # A LayerNorm in the chain whose eps its form's steps find (where values reach the host later),
        # and the check they start with: which eps give its rstd (_eps_probes).
        self.steps_norm: LayerNormOf | None = None
        self.probe: Tensor | None = None

    def chain(self, fn: Any, top: bool = True) -> Chain | None:
        """Node `fn`'s op on its inputs, each a source (what its node saved; else another node's saved
        output, or a parameter) or, where the graph keeps none, remade itself from its own node; None
        where an input is neither, but at the `top`, where one that needs no gradient is -1 (a Python
        number given to an add, which _with_scalar finds; or a tensor, whose guess then misses)."""
        self.ops_left -= 1
        if self.ops_left < 0:
            return None
        remake = _remake_of(fn)
        if remake is None:
            return None
        op, saved, by_split = remake
        self.by_split |= by_split
        inputs: list[int | Chain] = []
        for s, (prev, output_nr) in zip(saved, _node_inputs(fn, len(saved))):
            source = _source(s, self.packer.unpack)
            if source is None and self.find and s.unpack_hook is self.packer.unpack and isinstance(s.data, _ViewOf):
                source = s.data.live()  # (a matmul's k.T: read now, as the chain runs only now)
            if source is None and prev is not None:
                source = _kept_source(prev, output_nr)
                source = _leaf(prev) if source is None else source
            if source is not None:
                inputs.append(self.index(source))
            elif prev is not None and output_nr == 0 and (prev.name() in _REMAKE or self.find and prev.name() in _FIND):
                sub = self.chain(prev, top=False)
                if sub is None:
                    return None
                inputs.append(sub)
            elif prev is not None and output_nr == 0 and prev.name() == _LAYER_NORM:
                norm = self.norm(prev)
                if norm is None:
                    return None
                inputs.append(norm)
            elif top and prev is None:  # (an input with a gradient's edge is a tensor, not a number)
                inputs.append(-1)
            else:
                return None
        return Chain(op, tuple(inputs))

    def norm(self, fn: Any) -> Chain | None:
        """A LayerNorm's output that no node keeps (under autocast, a Linear keeps its cast): PyTorch's
        LayerNorm of what its node keeps, with an eps of LAYER_NORM_EPS that gives its rstd (_eps_probes):
        where that is on the host at once (the CPU), the first; else (CUDA) found by the form's steps
        (RemadeNorm), one LayerNorm a chain. None where no eps gives it, or a second one would wait."""
        self.ops_left -= 1
        read = _norm_sources(fn, self.packer)
        if self.ops_left < 0 or read is None:
            return None
        shape, sources, rstd = read
        at_once = Deferred.at_once(rstd)
        if not at_once and self.steps_norm is not None:
            return None
        if at_once:
            eps = _noted_eps(fn)
            if eps is None:
                hits = Deferred(_eps_probes(shape, sources, rstd)).ints()
                if 1 not in hits:
                    return None
                eps = LAYER_NORM_EPS[hits.index(1)]
                _note_eps(fn, eps)
            norm = LayerNormOf(shape, eps)
        else:
            norm = self.steps_norm = LayerNormOf(shape)
            self.probe = _eps_probes(shape, sources, rstd)
        return Chain(norm, tuple(None if s is None else self.index(s) for s in sources))

    def index(self, source: Tensor | _Shared) -> int:
        """`source`'s index among the chain's sources (added where it is new)."""
        for i, s in enumerate(self.sources):
            if s is source:
                return i
        self.sources.append(source.detach() if isinstance(source, Tensor) else source)
        return len(self.sources) - 1

    def live(self) -> list[Tensor]:
        """The sources as they are now (a form's, rebuilt from what it holds), to verify with."""
        return [s.live() if isinstance(s, _Shared) else s for s in self.sources]


def _remade(t: Tensor, packer: Packing) -> Made | None:
    """`t` (an output of an op of graph._REMAKE) as that op, and the ops of graph._REMAKE that made its
    inputs where the graph keeps none (a chain: GPT-2's tanh of a polynomial of its input), run again
    on inputs the graph keeps: where they give `t`'s dtype, shape and strides. An add of a Python
    number (``1.0 + tanh(x)``), which its node does not keep, has it found (_with_scalar)."""
    key = _node_key(t.grad_fn)
    twin = None if key is None else packer.recent.twin(key)
    if twin is not None:
        return _twin(t, twin, key, packer)
    found = _Chaining(packer)
    chain = found.chain(t.grad_fn)
    if chain is None:
        return None
    if found.steps_norm is not None:  # (its eps found in steps, see _Chaining.norm; no number to find too)
        if -1 in chain.inputs:
            return None
        return Made(RemadeNorm(t, chain, found.sources, found.steps_norm, found.by_split), found.probe)
    live = found.live()
    own: tuple[Tensor, ...] = ()
    if -1 in chain.inputs:
        number = _with_scalar(chain, live, t)
        if number is None:
            return None
        chain = Chain(chain.op, tuple(found.index(number) if i == -1 else i for i in chain.inputs))
        live, own = live + [number], (number,)
    now = run_as_forward(chain, live)
    if now.dtype != t.dtype or now.shape != t.shape or now.stride() != t.stride() or now.device != t.device:
        return None
    form = Remade(t, chain, found.sources, found.by_split, own)
    flag = _same_bits_later([(now, t.detach())])
    packer.recent.remember(form, now, None if own else key)
    return Made(form, flag)


def _widened(t: Tensor, packer: Packing) -> Made | None:
    """`t`, a cast to a wider floating-point type whose input no node keeps (HF's RMSNorm in a bfloat16
    model: the residual stream cast to float32, kept by its ``pow`` and ``mul``), as that cast of a copy
    in the input's dtype, which the form holds (``own``: half the bytes, from bfloat16 or float16 to
    float32): exact where the copy cast again gives `t` bit for bit (the check when saved; a NaN's
    payload may not come back)."""
    narrow = t.detach().to(_cast_from(t.grad_fn))
    cast = functools.partial(_REMAKE[_CAST].op, dtype=t.dtype)
    now = run_as_forward(cast, [narrow])
    if not _like(now, t):  # (on t's device: the copy is t's)
        return None
    form = Widened(t, cast, narrow, _node_inputs(t.grad_fn, 1)[0])
    packer.recent.remember(form, now, None)
    packer.widened.append(weakref.ref(form))  # (decided again when the context exits: Widened)
    return Made(form, _same_bits_later([(now, t.detach())]))


def _softmax_widened(t: Tensor, packer: Packing) -> Made | None:
    """`t`, a float32 softmax of narrower attention scores, plus a mask or not (HF's eager attention in a
    bfloat16 model: ``softmax(q @ k.T * scale + mask, dim=-1, dtype=torch.float32)``, kept by its node),
    whose input no node keeps, as that softmax of a copy of its input in the input's dtype, which the
    form holds (``own``: half the bytes). The scores are found by running again, once, the ops that
    made them from what their nodes keep (the matmul, graph._FIND, and the scale); a mask, which no
    node keeps, is guessed from `t`: -inf where `t` is 0, nothing where it is not. Exact where the
    softmax of the copy gives `t` bit for bit (the check when saved; a mask of other values misses)."""
    read = _softmax_scores(t.grad_fn)
    if read is None:
        return None
    dim, cast, scores_node, masked = read
    if dim not in (-1, t.dim() - 1):
        return None  # (over the last dim each row is one thread's, in one loop: its bits do not depend on the split)
    found = _Chaining(packer, find=True)
    chain = found.chain(scores_node, top=False)
    if chain is None:
        return None
    live = found.live()
    copy = run_as_forward(chain, live)
    if copy.shape != t.shape or copy.dtype != _cast_from(cast) or not (copy.is_contiguous() and t.is_contiguous()):
        return None
    if any(copy.untyped_storage().data_ptr() == s.untyped_storage().data_ptr() for s in live):
        copy = copy.clone()  # (the chain ended in a view of what it reads, a tensor a node keeps: filled below)
    softmax = Chain(functools.partial(torch.ops.aten._softmax.default, dim=dim, half_to_float=False),
                    (Chain(functools.partial(_REMAKE[_CAST].op, dtype=t.dtype), (0,)),))
    # On the CPU, filled and checked a block of rows at a time: the whole tensor's cast and softmax, made
    # while the forward holds its own, raised a step's peak by up to twice the softmax's bytes. Each row
    # is its own there (one thread's, one loop), so a block's bits are the whole's; the rebuild, of the
    # whole, is also checked against the forward's fingerprint (by_split), which a change would raise.
    # CUDA's kernel may pick its variant by a block's alignment: checked whole there.
    rows, out = copy.view(-1, copy.shape[-1]), t.detach().view(-1, t.shape[-1])
    blocks = t.device.type == "cpu"
    step = max(1, _CHECK_BLOCK // rows.shape[1]) if blocks else rows.shape[0]
    flags = []
    for i in range(0, rows.shape[0], step):
        block, expected = rows[i:i + step], out[i:i + step]
        if masked:
            block.masked_fill_(expected == 0, float("-inf"))
        flags.append(_same_bits_later([(run_as_forward(softmax, [block]), expected)]))
    flag = flags[0] if len(flags) == 1 else torch.stack(flags).all()
    return Made(Remade(t, softmax, [copy], by_split=blocks, own=(copy,)), flag)


# A twin's op: its twin's value as it is (a view of it).
_AS_TWIN = Chain(torch.ops.aten.alias.default, (0,))


def _twin(t: Tensor, twin: Remade, key: tuple[Any, ...], packer: Packing) -> Made | None:
    """`t`, made by the same op from the same inputs as `twin`, a recent remade form (_node_key: under
    autocast, each of attention's q, k and v Linears casts the same LayerNorm output again), as that
    form: not run again when saved, nor in backward, where the twin's rebuild (or the tensor it holds
    where its check missed), kept for its own unpack, serves this one's. Checked against what the twin
    gives back: the tensor it holds while its check is out or after it missed, else its value as
    verified: exact however the twin was found."""
    first = twin.whole.tensor if twin.whole is not None else twin.recent
    if first is None or not twin.fresh() or not _like(first, t) or first.device != t.device:
        return None
    form = Remade(t, _AS_TWIN, [twin])
    form.op_name = twin.op_name
    packer.recent.remember(form, t.detach(), key)
    return Made(form, _same_bits_later([(first.detach(), t.detach())]))


class Recent:
    """The last remade forms that hold their value as verified (``Remade.recent``), oldest first: each
    until `size` later forms do, or forget() (the pack hook's, at a tensor of an op outside the table,
    and at the exit). A form made of them in the same chain of ops (GPT-2's ``1.0 + tanh``, then their
    product) reads them instead of running their ops again: values the forward had just made and
    eager PyTorch held too; a form made by the same ops from the same inputs is their twin (_twin)."""

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self.forms: deque[Remade] = deque()
        self.keys: deque[tuple[Any, ...] | None] = deque()  # (each form's _node_key)

    def remember(self, form: Remade, value: Tensor, key: tuple[Any, ...] | None) -> None:
        """Let `form`, made as `key` says (None: no twin may read it), hold `value`, its value."""
        form.recent = value
        self.forms.append(form)
        self.keys.append(key)
        if len(self.forms) > self.size:
            self.forms.popleft().recent = None
            self.keys.popleft()

    def twin(self, key: tuple[Any, ...]) -> Remade | None:
        """The newest form held that was made as `key` says, if any (see _twin)."""
        for form, known in zip(reversed(self.forms), reversed(self.keys)):
            if known == key:
                return form
        return None

    def forget(self) -> None:
        """Drop every value held."""
        while self.forms:
            self.forms.popleft().recent = None
        self.keys.clear()


# The elements among which _with_scalar reads the number an add was given.
_GUESS_FROM = 65536


def _with_scalar(chain: Chain, live: list[Tensor], t: Tensor) -> Tensor | None:
    """For `chain`, an add of `t`'s shape and a Python number that its node did not keep (``1.0 + x``;
    alpha 1; the number's input -1): the number, in `t`'s dtype, on its device (no wait for it), read
    where the other input is smallest, `t` there where adding the other input to it gives `t` there
    again (the other input too small to round the sum), else `t` less it there. A guess: the check
    when saved confirms it, or the tensor is kept. None where `chain` is not such an add."""
    op, (a, b) = chain.op, chain.inputs if len(chain.inputs) == 2 else (None, None)
    if getattr(op, "func", None) is not _REMAKE["AddBackward0"].op or op.keywords["alpha"] != 1 or -1 not in (a, b):
        return None
    known = b if a == -1 else a
    if known == -1:
        return None
    x = live[known] if isinstance(known, int) else run_as_forward(known, live)
    if x.shape != t.shape or x.dtype != t.dtype:
        return None
    flat, out = x.reshape(-1), t.detach().reshape(-1)
    head = flat[:_GUESS_FROM]  # (enough elements to find a small one; argmin over all costs a pass)
    at = torch.where(head.isnan(), torch.full_like(head, float("inf")), head.abs()).argmin().reshape(1)
    x_there, out_there = flat.index_select(0, at), out.index_select(0, at)
    less = (out_there.double() - x_there.double()).to(t.dtype)
    again = run_as_forward(op, [x_there, out_there] if a == known else [out_there, x_there])
    return torch.where(_same_bits_later([(again, out_there)]), out_there, less).reshape(())


def _norm_sources(fn: Any, packer: Packing) -> tuple[tuple[int, ...], list[Tensor | _Shared | None], Tensor] | None:
    """What LayerNorm node `fn` keeps, as a recipe reads it: its normalized shape, its input, weight and
    bias (None: none), and its rstd; None where what it keeps is not readable (other hooks', changed)."""
    shape, *saved, rstd_saved = _layer_norm_saved(fn)
    sources: list[Tensor | _Shared | None] = []
    for s in saved:
        source = None if s.data is None and s.unpack_hook is None else _source(s, packer.unpack)
        if source is None and s.data is not None:
            return None  # (kept by other hooks, or changed)
        sources.append(source)
    rstd = _peek(rstd_saved, packer.unpack)
    if sources[0] is None or rstd is None or rstd.numel() == 0:
        return None
    return shape, sources, rstd


def _layer_norm(t: Tensor, packer: Packing) -> Made | None:
    """`t` (a LayerNorm output) as PyTorch's LayerNorm of its input, weight and bias, which its node
    keeps, made in steps (RemadeNorm): checked first by which eps of LAYER_NORM_EPS gives its node's
    rstd on the row with the largest (_eps_probes); or, where its weight's last output was remade,
    by that output's eps, on the whole tensor (EPS_BY_WEIGHT)."""
    read = _norm_sources(t.grad_fn, packer)
    if read is None:
        return None
    shape, sources, rstd = read
    norm = LayerNormOf(shape)
    norm.eps = EPS_BY_WEIGHT.get(sources[1])
    if norm.eps is None:
        return Made(RemadeNorm(t, norm, sources, norm), _eps_probes(shape, sources, rstd))
    form = RemadeNorm(t, norm, sources, norm, rstd=rstd)  # (its weight's last eps first: RemadeNorm._step)
    now = run_as_forward(norm, [s.live() if isinstance(s, _Shared) else s for s in sources])
    if not _like(now, t):
        return None
    return Made(form, _same_bits_later([(now, t.detach())]))


def _peek(saved: _Saved, unpack: Any) -> Tensor | None:
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


def _bn_source(bn: Any, t: Tensor, unpack: Any) -> tuple[Tensor | _Shared, Tensor, Tensor, Tensor] | None:
    """The input of BatchNorm node `bn` (laid out as `t`), its terms for `t`'s dtype, and the input
    again as a tensor, to verify with; or None. The input is a tensor, or a concatenation this context
    keeps in pieces (DenseNet's) or a remade op's output, which the recipe then rebuilds for its own
    rebuild, and keeps for the BatchNorm's node."""
    saved = _raw_saved(bn, "input")
    source = x = _peek(saved, unpack)
    if x is None and saved.unpack_hook is unpack and isinstance(saved.data, (Concatenated, Remade)) and saved.data.fresh():
        source, x = saved.data, saved.data.live()
    if not _like(x, t):
        return None  # (t is dense, so x is too)
    # The statistics it normalized with: in training the saved mean and invstd; in eval the running
    # ones, except where the kernel saved what it used (PyTorch's CUDA kernel: their copy and invstd).
    from_saved = _bn_training(bn)
    if not from_saved and t.is_cuda:
        invstd = _peek(_raw_saved(bn, "result2"), unpack)
        from_saved = invstd is not None and invstd.numel() == t.shape[1]
    names = ("result1", "result2") if from_saved else ("running_mean", "running_var")
    mean, var = (_peek(_raw_saved(bn, n), unpack) for n in names)
    saved_weight = _raw_saved(bn, "weight")
    has_weight = saved_weight.data is not None  # (affine=False: none)
    weight = _peek(saved_weight, unpack) if has_weight else None
    if mean is None or var is None or (has_weight and weight is None):
        return None
    bias, readable = _bn_bias(bn)  # a parameter; else none (or frozen: verified)
    if not readable:
        return None  # a bias computed in the graph (FSDP's views of its flat parameter), which no node keeps
    alpha, beta = _C.bn_terms(
        None if weight is None else weight.detach(), None if bias is None else bias.detach(), mean.detach(),
        var.detach(), from_saved, _bn_eps(bn), t.dtype)
    return (x.detach() if source is x else source), alpha, beta, x.detach()


def _kept_source(fn: Any, output_nr: int) -> Tensor | _Shared | None:
    """Output `output_nr` of node `fn` where this context saved it for another node and it is as it was
    then: the tensor (saved as it is), or this context's form of it; else None (the in-place error
    comes in backward)."""
    packed = _kept(fn, output_nr)
    if isinstance(packed, _Dense) and packed.unchanged():
        return packed.tensor
    if isinstance(packed, _Shared) and packed.fresh():
        return packed
    return None


def _kept_output(fn: Any, output_nr: int, t: Tensor) -> tuple[Tensor | _Shared, Tensor, Tensor, Tensor] | None:
    """Output `output_nr` of node `fn` where this context saved it for another node: as it is
    (a ResNet's max-pool output, kept by the next conv), or compacted or replayed in one pass
    (a block's output, kept by the next block's conv). What the recipe reads, the terms that
    add it as it is, and the tensor to verify with: what the recipe's rebuild will read."""
    source = _kept_source(fn, output_nr)
    if source is None or (isinstance(source, _Shared) and source.depth != 1):
        return None
    now = source.live() if isinstance(source, _Shared) else source
    if not _like(now, t):
        return None
    # Terms that add it as it is (x * 1 + -0.0 is x, -0.0 included; a NaN payload the check sees).
    opmath = torch.float64 if t.dtype == torch.float64 else torch.float32
    zero, one = (torch.full((t.shape[1],), v, dtype=opmath, device=t.device) for v in (0.0, 1.0))
    alpha, beta = _C.bn_terms(None, torch.full_like(zero, -0.0), zero, one, True, 0.0, t.dtype)
    return source, alpha, beta, now


def _replayed(t: Tensor, packer: Packing) -> Made | None:
    """`t` (an activation output after a BatchNorm, or after a residual add of one) as a recipe.

    A residual add ``out += identity`` (torchvision's BasicBlock and Bottleneck) replays
    where ``identity`` is a BatchNorm output too (the downsample's), or a tensor this
    context saved for another node (``_kept_output``): as it is (stage 1's max-pool
    output), or the previous block's output, compacted or a recipe rebuilt in one pass,
    which the rebuild makes again and drops. Not longer chains: rebuilt in backward order,
    each would rebuild its predecessors again, or hold them all. So in a stage's blocks
    two recipes alternate with a compacted output."""
    act = _activation_of(t.grad_fn)
    if act is None or t.dim() < 2:
        return None
    inputs = _batchnorm_inputs(t.grad_fn)
    if inputs is None:
        return None
    bn, other = inputs  # other: a residual add's other input (node, output_nr)
    first = _bn_source(bn, t, packer.unpack)
    second = None  # the add's other input: what the recipe reads, its terms, what verification reads
    if other is not None:
        b, b_nr = other
        second = _bn_source(b, t, packer.unpack) if _is_batchnorm(b) else _kept_output(b, b_nr, t)
        if second is None:
            return None
    if first is None:
        return None
    also = () if second is None else (second[3], *second[1:3])
    flag = _C.bn_act_verify(first[3], *first[1:3], act[0], act[1], t.detach(), *also)
    return Made(Replayed(t, *first[:3], act[0], act[1], None if second is None else second[:3]), flag)


def _compacted(t: Tensor, packer: Packing) -> Made | None:
    """`t` compacted (with relu_ext's own mask where its node has one: no second bitmap), made in steps
    (Compacted.checked), or at once where the count is on the host at once; missed where it would
    save less than min_saving of its bytes."""
    packed = Compacted(t, _relu_ext_mask(t), (1 - packer.min_saving) * t.nbytes)
    if packed.ends is None:
        return Made(packed, None) if packed.now(t) else None
    return Made(packed, packed.count)


def _two_valued(t: Tensor, packer: Packing) -> Made:
    """`t` (no node made it) as a bitmap and its one nonzero bit pattern, checked to have no second
    one; a bool tensor as its bits, exact as made."""
    if t.dtype == torch.bool:
        return Made(TwoValued(_bool_bits(t), None, t), None)
    mask, value, ok = _ops.binary_mask(t)
    return Made(TwoValued(mask, value, t), ok)


def _plain_dense(t: Tensor) -> bool:
    """Whether `t` is a plain strided tensor (no subclass) on the CPU or CUDA, of at least 4096
    elements, that fills a block of memory exactly once: what narrowing and bitmaps take."""
    return type(t) is torch.Tensor and _C.dense_at_least(t, _MIN_NUMEL)


def _worth_keeping_smaller(t: Tensor) -> bool:
    """Whether `t` is a plain dense floating-point tensor on the CPU or CUDA of 4096 elements or more:
    what the recipes, replays and compactions take (hooks._why_kept gives the reason of one that is not)."""
    return t.is_floating_point() and _plain_dense(t)


def _a_recipe_output(t: Tensor, recompute: bool) -> bool:
    """applies() of a recipe of what other nodes keep (a concatenation in pieces, a max-pool output as
    its input at its indices, an op's output remade from its inputs): with recompute, worth keeping
    smaller (the row's nodes say which outputs)."""
    return recompute and _worth_keeping_smaller(t)


def _after_a_batchnorm(t: Tensor, recompute: bool) -> bool:
    """applies() of a replay: an activation output whose input is a BatchNorm's, with recompute, worth
    keeping smaller."""
    return recompute and _after_batchnorm(t.grad_fn) and _worth_keeping_smaller(t)


def _zeros_mostly(t: Tensor, recompute: bool) -> bool:
    """applies() of a compaction: an activation output that is mostly zeros (ReLU, ...), worth keeping
    smaller."""
    return _mostly_zeros(t.grad_fn) and _worth_keeping_smaller(t)


def _zeros_of_a_factor(t: Tensor, recompute: bool) -> bool:
    """applies() of a compaction of a product with an activation output that is mostly zeros (dropout
    after a ReLU, which nothing remade: its noise times the ReLU's output, which no node keeps), worth
    keeping smaller."""
    return _zeros_by_a_factor(t.grad_fn) and _worth_keeping_smaller(t)


def _a_widening(t: Tensor, recompute: bool) -> bool:
    """applies() of a cast remade from a narrower copy (_widened): with recompute, a cast's output worth
    keeping smaller whose input has a floating-point type of fewer bytes."""
    return recompute and _worth_keeping_smaller(t) and _widens(t.grad_fn, t)


def _a_widening_softmax(t: Tensor, recompute: bool) -> bool:
    """applies() of a softmax remade from a narrower copy of its input (_softmax_widened): with
    recompute, a softmax output worth keeping smaller whose input is a cast from a floating-point type of
    fewer bytes."""
    if not (recompute and _worth_keeping_smaller(t)):
        return False
    cast = _cast_input(t.grad_fn)
    return cast is not None and _widens(cast, t)


def _widens(cast: Any, t: Tensor) -> bool:
    """Whether cast node `cast` made its output (of `t`'s dtype) from a floating-point type of fewer bytes."""
    source = _cast_from(cast)
    return source is not None and source.is_floating_point and source.itemsize < t.element_size()


_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _two_valued_candidate(t: Tensor, recompute: bool) -> bool:
    """applies() of a bitmap (see TwoValued): a plain dense tensor of at least 4096 elements that no
    node made, floating-point on the CPU (the kernels of binary_mask) or bool on the CPU or CUDA."""
    return (
        not t.requires_grad
        and ((t.dtype in _FLOATS and t.is_cpu) or t.dtype == torch.bool)
        and _plain_dense(t)
    )


# The table of forms, in the order the pack hook tries them (the first that applies and does not miss
# at once is kept). A concatenation that fails to extend the chain at once starts a new one; a replay
# that misses falls back to compaction. Integer tensors are narrowed at the exit instead (Narrowed).
FORMS = (
    Row(Concatenated, frozenset({_CAT}), _a_recipe_output, _extended),
    Row(Concatenated, frozenset({_CAT}), _a_recipe_output, _chain_start),
    Row(Pooled, frozenset({_MAX_POOL}), _a_recipe_output, _pooled),
    Row(Remade, frozenset(_REMAKE) - REMAKE_VIEWS, _a_recipe_output, _remade),
    Row(Widened, frozenset({_CAST}), _a_widening, _widened),
    Row(Remade, frozenset({_SOFTMAX}), _a_widening_softmax, _softmax_widened),
    Row(RemadeNorm, frozenset({_LAYER_NORM}), _a_recipe_output, _layer_norm),
    Row(Replayed, ACTIVATION_NODES, _after_a_batchnorm, _replayed),
    Row(Compacted, ACTIVATION_NODES, _zeros_mostly, _compacted),
    Row(Compacted, PRODUCTS, _zeros_of_a_factor, _compacted),
    Row(TwoValued, frozenset({None}), _two_valued_candidate, _two_valued),
)

FORMS_BY_NODE: dict[str | None, tuple[Row, ...]] = {
    node: tuple(row for row in FORMS if node in row.nodes) for row in FORMS for node in row.nodes}
"""The rows that take a node's outputs, in the table's order, by the node's name (None: no node): what
the pack hook looks up for each saved tensor (most take none)."""
