"""Making ``save_compact()``'s forms of saved tensors: recipes read from the graph and verified bit for
bit when packed (``Replayed``, ``Pooled``, ``Concatenated`` chains), and compaction."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

from .bits import _same_bits_later
from .deferred import Deferred
from .forms import Compacted, Concatenated, Pooled, Replayed, _Dense, _gathered, _Shared
from .graph import (_activation_of, _batchnorm_inputs, _bn_bias, _bn_eps, _bn_training, _is_batchnorm, _kept,
                    _raw_saved, _relu_ext_mask, _Saved)

_ops = torch.ops.relu_ext


def _concatenation(t: Tensor, dim: int, chains: dict[tuple[Any, ...], Any]) -> tuple[Concatenated, Deferred | None]:
    """`t` (a concatenation along `dim`) in pieces: the last concatenation kept of the same other sizes,
    where `t` begins with it, and what `t` adds; else the first of a new chain. And the check that `t`
    begins with it, where it has not come back yet (see _Shared.hold)."""
    key = (dim, t.dtype, t.device, t.shape[:dim] + t.shape[dim + 1:])
    ref = chains.get(key)
    prev = None if ref is None else ref()
    same = None if prev is None else prev.extends(t, dim)
    check = None if same is None else Deferred(same)
    exact = None if check is None else check.now()
    if exact is not None:
        check = None
    packed = Concatenated(t, dim, prev if same is not None and exact is not False else None)
    chains[key] = weakref.ref(packed)
    return packed, check


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


def _pooled(t: Tensor, unpack: Any) -> tuple[Pooled | None, Deferred | None]:
    """`t` (a max_pool2d output, N x C x h x w) as a recipe, or None; and its check, where it has not
    come back yet (see _Shared.hold)."""
    if t.dim() != 4:
        return None, None
    x, indices = (_source(_raw_saved(t.grad_fn, name), unpack) for name in ("self", "result1"))
    if x is None or indices is None:
        return None, None
    at = indices.live() if isinstance(indices, _Shared) else indices
    if at.shape != t.shape or (isinstance(x, Tensor) and (x.dim() != 4 or x.dtype != t.dtype)):
        return None, None
    now = x.gathered(at, t.size(), t.stride()) if isinstance(x, _Shared) else _gathered(x, at, t.size(), t.stride())
    if now.dtype != t.dtype:
        return None, None
    check = Deferred(_same_bits_later([(now, t)]))
    exact = check.now()
    if exact is False:
        return None, None
    return Pooled(x, indices, t), check if exact is None else None


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


def _like(x: Tensor | None, t: Tensor) -> bool:
    """Whether `x` is a tensor of `t`'s dtype, shape and strides (a recipe's source for `t`)."""
    return x is not None and x.dtype == t.dtype and x.shape == t.shape and x.stride() == t.stride()


def _bn_source(bn: Any, t: Tensor, unpack: Any) -> tuple[Tensor | _Shared, Tensor, Tensor, Tensor] | None:
    """The input of BatchNorm node `bn` (laid out as `t`), its terms for `t`'s dtype, and the input
    again as a tensor, to verify with; or None. The input is a tensor, or a concatenation this context
    keeps in pieces (DenseNet's), which the recipe then rebuilds for its own rebuild, and drops."""
    saved = _raw_saved(bn, "input")
    source = x = _peek(saved, unpack)
    if x is None and saved.unpack_hook is unpack and isinstance(saved.data, Concatenated) and saved.data.fresh():
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
    alpha, beta = _ops.bn_terms(
        None if weight is None else weight.detach(), None if bias is None else bias.detach(), mean.detach(),
        var.detach(), from_saved, _bn_eps(bn), t.dtype)
    return (x.detach() if source is x else source), alpha, beta, x.detach()


def _kept_output(fn: Any, output_nr: int, t: Tensor) -> tuple[Tensor | _Shared, Tensor, Tensor, Tensor] | None:
    """Output `output_nr` of node `fn` where this context saved it for another node: as it is
    (a ResNet's max-pool output, kept by the next conv), or compacted or replayed in one pass
    (a block's output, kept by the next block's conv). What the recipe reads, the terms that
    add it as it is, and the tensor to verify with: what the recipe's rebuild will read."""
    packed = _kept(fn, output_nr)
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


def _replayed(t: Tensor, unpack: Any) -> tuple[Replayed | None, Deferred | None, bool]:
    """`t` (an activation output after a BatchNorm, or after a residual add of one) as a
    recipe, or None; its check, where it has not come back yet (see _Shared.hold); and whether
    a recipe was tried and missed verification.

    A residual add ``out += identity`` (torchvision's BasicBlock and Bottleneck) replays
    where ``identity`` is a BatchNorm output too (the downsample's), or a tensor this
    context saved for another node (``_kept_output``): as it is (stage 1's max-pool
    output), or the previous block's output, compacted or a recipe rebuilt in one pass,
    which the rebuild makes again and drops. Not longer chains: rebuilt in backward order,
    each would rebuild its predecessors again, or hold them all. So in a stage's blocks
    two recipes alternate with a compacted output."""
    act = _activation_of(t.grad_fn)
    if act is None or t.dim() < 2:
        return None, None, False
    inputs = _batchnorm_inputs(t.grad_fn)
    if inputs is None:
        return None, None, False
    bn, other = inputs  # other: a residual add's other input (node, output_nr)
    first = _bn_source(bn, t, unpack)
    second = None  # the add's other input: what the recipe reads, its terms, what verification reads
    if other is not None:
        b, b_nr = other
        second = _bn_source(b, t, unpack) if _is_batchnorm(b) else _kept_output(b, b_nr, t)
        if second is None:
            return None, None, False
    if first is None:
        return None, None, False
    also = () if second is None else (second[3], *second[1:3])
    check = Deferred(_ops.bn_act_verify(first[3], *first[1:3], act[0], act[1], t.detach(), *also))
    exact = check.now()
    if exact is False:
        return None, None, True
    return (Replayed(t, *first[:3], act[0], act[1], None if second is None else second[:3]),
            check if exact is None else None, False)


def _compacted(t: Tensor, min_saving: float) -> tuple[Compacted | None, Deferred | None]:
    """`t` compacted, or None when that would save less than `min_saving` of its bytes; or, where a step's
    value has not come back yet, the form that holds `t` until it has, and that step's check."""
    packed = Compacted(t, _relu_ext_mask(t), (1 - min_saving) * t.nbytes)  # relu_ext's own mask: no second bitmap
    packed.hold(t)
    check = packed.counted()
    while check.done():
        outcome = packed.checked(check)
        if not isinstance(outcome, Deferred):
            packed.resolved(outcome is True)
            return (packed if outcome is True else None), None
        check = outcome
    return packed, check
