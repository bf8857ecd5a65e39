"""Tensor-bit helpers of ``save_compact()``: comparing tensors bit for bit, bool tensors as bitmaps, layouts."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _C
from .deferred import Deferred

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# The CPU's two answers, made once (no check's value ever changes: see Deferred): a bool tensor made
# per check costs an allocation with cold caches inside a step.
_SAME, _DIFFERENT = torch.tensor(True, device="cpu"), torch.tensor(False, device="cpu")


def _same_bits_later(pairs: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Whether the two tensors of each pair (same sizes and dtype, any strides) hold the same bits, NaN
    payloads and the sign of zero counting: a bool tensor on the pairs' device, not read (the pack hook
    reads it through a Deferred). A memcmp on the CPU, elsewhere _same_bits_on_device."""
    if all(a.device.type == "cpu" for a, _ in pairs):
        return _SAME if all(_C.same_bits(a, b) for a, b in pairs) else _DIFFERENT
    return _same_bits_on_device(pairs)


def _same_bits_on_device(pairs: list[tuple[Tensor, Tensor]]) -> Tensor:
    """_same_bits_later with tensor ops: the pairs compared as integers of their width (bits, not values),
    on their device, into one bool tensor there."""
    if not pairs:
        return torch.tensor(True)
    if any(a.shape != b.shape or a.dtype != b.dtype or a.device != b.device for a, b in pairs):
        raise ValueError("relu_ext: _same_bits_later compares tensors of the same shape, dtype and device")
    differ = [a.view(_INTS[a.element_size()]).ne(b.view(_INTS[b.element_size()])).any() for a, b in pairs]
    return ~torch.stack(differ).any()


def _like(x: Tensor | None, t: Tensor) -> bool:
    """Whether `x` is a tensor of `t`'s dtype, shape and strides (a recipe's source for `t`)."""
    return x is not None and x.dtype == t.dtype and x.shape == t.shape and x.stride() == t.stride()


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


def _is_dense(t: Tensor) -> bool:
    """Whether `t`'s elements fill a block of memory exactly once, in any order of dimensions."""
    if t.is_contiguous():  # (the common case, asked of most saved tensors: at once)
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True
