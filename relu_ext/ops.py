"""Python side of the relu_ext ops: fake kernels, autograd, and the drop-in API.

The native ops (schema in csrc/bindings.cpp) are:

- ``relu(x) -> y`` and ``relu_(x)``: inference, no mask is written;
- ``relu_fwd(x) -> (y, mask)`` and ``relu_fwd_(x) -> mask``: training;
- ``relu_bwd(grad, mask) -> grad_in``.

``mask`` holds one bit per element (``ceil(n / 8)`` uint8 bytes): bit ``k`` is
``!(y <= 0)`` for the ``k``-th element of ``y`` in memory order. Backward saves
only that mask, so an fp32 activation costs 1 bit instead of 32.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from . import _C

_ops = torch.ops.relu_ext

# Devices this build has kernels for; "meta" runs the fake kernels (shape
# inference, models built on the meta device).
_KERNEL_DEVICES = frozenset({"cpu", "meta"} | ({"cuda"} if _C.with_cuda else set()))


def cuda_available() -> bool:
    """True when the CUDA kernels were compiled into this build."""
    return bool(_C.with_cuda)


def build_info() -> dict[str, Any]:
    """How this extension was built and what it runs with."""
    return {
        "cuda": bool(_C.with_cuda),
        "cuda_arch_list": _C.cuda_arch_list or None,
        "cpu_isa": _C.cpu_isa(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }


def _mask_numel(x: Tensor) -> Any:
    return (x.numel() + 7) // 8


@torch.library.register_fake("relu_ext::relu")
def _relu_fake(x: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.register_fake("relu_ext::relu_")
def _relu_inplace_fake(x: Tensor) -> None:
    return None


@torch.library.register_fake("relu_ext::relu_fwd")
def _relu_fwd_fake(x: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty((_mask_numel(x),), dtype=torch.uint8)


@torch.library.register_fake("relu_ext::relu_fwd_")
def _relu_fwd_inplace_fake(x: Tensor) -> Tensor:
    return x.new_empty((_mask_numel(x),), dtype=torch.uint8)


@torch.library.register_fake("relu_ext::relu_bwd")
def _relu_bwd_fake(grad: Tensor, mask: Tensor) -> Tensor:
    torch._check(
        grad.device == mask.device,
        lambda: f"relu_ext::relu_bwd: grad is on {grad.device} but mask is on {mask.device}; both must be on the same device",
    )
    torch._check(mask.dtype == torch.uint8, lambda: f"relu_ext::relu_bwd: mask has dtype {mask.dtype}; expected uint8")
    torch._check(
        mask.dim() == 1 and mask.numel() == _mask_numel(grad),
        lambda: f"relu_ext::relu_bwd: mask has shape {tuple(mask.shape)} but grad has {grad.numel()} elements",
    )
    return torch.empty_like(grad)


def _like_strides(t: Tensor, stride: Sequence[int]) -> Tensor:
    """``t`` with the given strides (a copy only when they differ).

    The mask follows the forward output's memory order, so the incoming
    gradient (e.g. an expanded one from ``.sum().backward()``) must be laid out
    the same way before the kernel walks it.
    """
    if tuple(t.stride()) == tuple(stride):
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def _grad_from_mask(ctx: Any, grad: Tensor) -> Tensor:
    """Backward of every mask-saving path: ``ctx`` holds the mask and the strides it follows."""
    (mask,) = ctx.saved_tensors
    return _ops.relu_bwd(_like_strides(grad, ctx.stride), mask)


def _mask_order_strides(x: Tensor) -> tuple[int, ...]:
    """Strides whose memory order the mask of an op on ``x`` follows (see dense() in bindings.cpp)."""
    return tuple(torch.empty_like(x, device="meta").stride())


# relu_fwd: save only the mask (and the output's strides, plain ints).
def _fwd_setup_context(ctx: Any, inputs: tuple[Tensor], output: tuple[Tensor, Tensor]) -> None:
    y, mask = output
    ctx.save_for_backward(mask)
    ctx.stride = tuple(y.stride())


def _fwd_backward(ctx: Any, grad_y: Tensor, grad_mask: Tensor | None) -> Tensor:
    return _grad_from_mask(ctx, grad_y)


torch.library.register_autograd("relu_ext::relu_fwd", _fwd_backward, setup_context=_fwd_setup_context)


# relu_bwd is linear in grad: its own gradient is the same masked select, which
# makes double backward (e.g. gradient penalties) work.
def _bwd_setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(inputs[1])
    ctx.stride = tuple(output.stride())


def _bwd_backward(ctx: Any, grad_grad_in: Tensor) -> tuple[Tensor, None]:
    return _grad_from_mask(ctx, grad_grad_in), None


torch.library.register_autograd("relu_ext::relu_bwd", _bwd_backward, setup_context=_bwd_setup_context)


class _ReLUInplace(torch.autograd.Function):
    """In-place training path. register_autograd refuses mutating ops, hence a Function."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        mask = _ops.relu_fwd_(x)
        ctx.mark_dirty(x)
        ctx.save_for_backward(mask)
        ctx.stride = _mask_order_strides(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> Tensor:
        return _grad_from_mask(ctx, grad_y)


def _check(input: Tensor) -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"relu_ext.relu: expected a Tensor, got {type(input).__name__}")
    if input.layout != torch.strided:
        raise RuntimeError(f"relu_ext.relu: input has layout {input.layout}; relu_ext supports strided (dense) tensors only")
    if input.device.type not in _KERNEL_DEVICES:
        hint = (
            " This build has no CUDA kernels (torch without CUDA, no nvcc at build time, or "
            "RELU_EXT_FORCE_CPU=1); rebuild relu_ext where nvcc is available."
            if input.device.type == "cuda"
            else ""
        )
        raise RuntimeError(
            f"relu_ext.relu: input is on {input.device}, but this relu_ext build has kernels for "
            f"{', '.join(sorted(_KERNEL_DEVICES - {'meta'}))} only.{hint}"
        )


@torch.fx.wrap
def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """Drop-in for ``torch.nn.functional.relu``: same values, gradients and ``inplace`` semantics.

    When a gradient is needed, backward keeps a 1-bit-per-element mask instead of
    the output. ``inplace=True`` overwrites ``input`` (and errors on a leaf that
    requires grad, as PyTorch does).
    """
    _check(input)
    needs_grad = torch.is_grad_enabled() and input.requires_grad
    if inplace:
        if needs_grad:
            return _ReLUInplace.apply(input)
        _ops.relu_(input)
        return input
    if needs_grad:
        return _ops.relu_fwd(input)[0]
    return _ops.relu(input)


class ReLU(torch.nn.ReLU):
    """Drop-in for ``torch.nn.ReLU`` (a subclass: same constructor, repr, state_dict, pickling).

    Args:
        inplace: overwrite the input, as ``nn.ReLU(inplace=True)`` does.
    """

    def forward(self, input: Tensor) -> Tensor:
        return relu(input, inplace=self.inplace)
