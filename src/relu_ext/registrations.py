"""How the relu_ext ops behave under PyTorch's tracers and transforms, registered at import.

- Fake kernels: output shapes and layouts, for torch.compile, torch.export and
  the meta device.
- vmap rules. They are here, not in C++, because functorch's C++ headers need
  a JSON library that torch does not ship. The public ops (``relu``,
  ``hardtanh``, ... and their in-place forms) are element-wise and run on the
  whole batch at once; the mask ops run sample by
  sample, so that each sample's mask is exactly that sample's own mask (in its
  own memory order, which is what the backward node expects).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from . import _C  # loads the native library: the ops must exist first

_ops = torch.ops.relu_ext


def _mask_numel(x: Tensor) -> Any:
    return (x.numel() + 7) // 8


@torch.library.register_fake("relu_ext::compact")
def _compact_fake(y: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    kept = torch.library.get_ctx().new_dynamic_size()  # how many bits are set: known only from the data
    return y.new_empty((kept,)), y.new_empty((), dtype=torch.int64)


@torch.library.register_fake("relu_ext::compact_count")
def _compact_count_fake(y: Tensor, mask: Tensor) -> Tensor:
    # (The device's tiling: one entry on the CPU, one per 2048 elements on CUDA; csrc/compact/kernels.cuh.)
    entries = 1 if y.device.type == "cpu" else max(1, (y.numel() + 2047) // 2048)
    return y.new_empty((entries,), dtype=torch.int64)


@torch.library.register_fake("relu_ext::compact_into")
def _compact_into_fake(y: Tensor, mask: Tensor, ends: Tensor, values: Tensor) -> Tensor:
    return y.new_empty((), dtype=torch.int64)


@torch.library.register_fake("relu_ext::expand")
def _expand_fake(values: Tensor, mask: Tensor, size: list[int], stride: list[int], check: bool = True) -> Tensor:
    return values.new_empty_strided(size, stride)


@torch.library.register_fake("relu_ext::nonzero_mask")
def _nonzero_mask_fake(y: Tensor) -> Tensor:
    return y.new_empty((_mask_numel(y),), dtype=torch.uint8)


@torch.library.register_fake("relu_ext::binary_mask")
def _binary_mask_fake(y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return y.new_empty((_mask_numel(y),), dtype=torch.uint8), y.new_empty(()), y.new_empty((), dtype=torch.bool)


@torch.library.register_fake("relu_ext::binary_expand")
def _binary_expand_fake(mask: Tensor, value: Tensor, size: list[int], stride: list[int]) -> Tensor:
    return value.new_empty_strided(size, stride)


@torch.library.register_fake("relu_ext::bn_terms")
def _bn_terms_fake(weight: Tensor | None, bias: Tensor | None, mean: Tensor, var: Tensor, training: bool, eps: float,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    opmath = torch.float64 if dtype == torch.float64 else torch.float32
    shape = (2, *mean.shape) if mean.device.type == "cuda" else mean.shape  # (CUDA's terms: 2 rows; csrc/compact/ops.cpp)
    return mean.new_empty(shape, dtype=opmath), mean.new_empty(shape, dtype=opmath)


@torch.library.register_fake("relu_ext::bn_act_verify")
def _bn_act_verify_fake(x: Tensor, alpha: Tensor, beta: Tensor, act: str, args: list[float], y: Tensor,
                        x2: Tensor | None = None, alpha2: Tensor | None = None, beta2: Tensor | None = None) -> Tensor:
    return x.new_empty((), dtype=torch.bool)


@torch.library.register_fake("relu_ext::bn_act_rebuild")
def _bn_act_rebuild_fake(x: Tensor, alpha: Tensor, beta: Tensor, act: str, args: list[float], x2: Tensor | None = None,
                         alpha2: Tensor | None = None, beta2: Tensor | None = None) -> Tensor:
    return x.new_empty_strided(x.shape, x.stride())


def _per_sample(batch_size: int, fn: Callable[[int], Any]) -> list[Any]:
    return [fn(b) for b in range(batch_size)]


def _sample_shape(x: Tensor, bdim: int) -> list[int]:
    return [s for d, s in enumerate(x.shape) if d != bdim]


def _stacked_masks(masks: list[Tensor], x: Tensor, bdim: int) -> Tensor:
    if masks:
        return torch.stack(masks)
    n = 1
    for s in _sample_shape(x, bdim):
        n *= s
    return x.new_empty((0, (n + 7) // 8), dtype=torch.uint8)  # an empty batch: no sample to run


# --- the activations (the C++ table: relu and the family), generated per op -------------


def _register_activation(name: str) -> None:
    """Fake kernels and vmap rules for relu_ext::<name> and its in-place and training ops."""
    op = f"relu_ext::{name}"
    fwd, fwd_, bwd = getattr(_ops, f"{name}_fwd"), getattr(_ops, f"{name}_fwd_"), getattr(_ops, f"{name}_bwd")
    public, public_ = getattr(_ops, name), getattr(_ops, f"{name}_")

    def output(x: Tensor) -> Tensor:  # in the layout the C++ kernel gives it (PyTorch's)
        return x.new_empty_strided(x.shape, _C.output_strides(name, x))

    torch.library.register_fake(op)(lambda x, *args: output(x))
    torch.library.register_fake(f"{op}_")(lambda x, *args: None)
    torch.library.register_fake(f"{op}_fwd")(
        lambda x, *args: (output(x), x.new_empty((_mask_numel(x),), dtype=torch.uint8))
    )
    torch.library.register_fake(f"{op}_fwd_")(lambda x, *args: x.new_empty((_mask_numel(x),), dtype=torch.uint8))

    def bwd_fake(grad: Tensor, mask: Tensor, *args: Any) -> Tensor:
        torch._check(grad.device == mask.device, lambda: f"{op}_bwd: grad is on {grad.device} but mask is on {mask.device}; both must be on the same device")
        torch._check(mask.dtype == torch.uint8, lambda: f"{op}_bwd: mask has dtype {mask.dtype}; expected uint8")
        torch._check(
            mask.dim() == 1 and mask.numel() == _mask_numel(grad),
            lambda: f"{op}_bwd: mask has shape {tuple(mask.shape)} but grad has {grad.numel()} elements",
        )
        return torch.empty_like(grad)

    torch.library.register_fake(f"{op}_bwd")(bwd_fake)

    # Element-wise: the public ops run on the whole batch; the mask ops per sample.
    # Either input of the backward may be batched: jacrev, for one, runs one
    # unbatched forward and vmaps the backward over many gradients.
    def public_vmap(info: Any, in_dims: tuple, x: Tensor, *args: Any) -> tuple[Tensor, int | None]:
        return public(x, *args), in_dims[0]

    def public_inplace_vmap(info: Any, in_dims: tuple, x: Tensor, *args: Any) -> tuple[None, None]:
        public_(x, *args)
        return None, None

    def fwd_vmap(info: Any, in_dims: tuple, x: Tensor, *args: Any) -> tuple[tuple[Tensor, Tensor], tuple[int, int]]:
        d = in_dims[0]
        results = _per_sample(info.batch_size, lambda b: fwd(x.select(d, b), *args))
        # Laid out as PyTorch's batch rule gives it: the op on the whole batch, its dimension where it was.
        y = output(x)
        for b, r in enumerate(results):
            y.select(d, b).copy_(r[0])
        return (y, _stacked_masks([r[1] for r in results], x, d)), (d, 0)

    def fwd_inplace_vmap(info: Any, in_dims: tuple, x: Tensor, *args: Any) -> tuple[Tensor, int]:
        d = in_dims[0]
        masks = _per_sample(info.batch_size, lambda b: fwd_(x.select(d, b), *args))
        return _stacked_masks(masks, x, d), 0

    def bwd_vmap(info: Any, in_dims: tuple, grad: Tensor, mask: Tensor, *args: Any) -> tuple[Tensor, int]:
        gd, md = in_dims[0], in_dims[1]
        out = _per_sample(
            info.batch_size,
            lambda b: bwd(grad if gd is None else grad.select(gd, b),
                          mask if md is None else mask.select(md, b).contiguous(), *args),
        )
        if not out:
            return (grad.unsqueeze(0)[:0] if gd is None else grad.movedim(gd, 0)).clone(), 0
        # Laid out as PyTorch's batch rule gives it: the op on the whole batch, batch dimension first, over
        # grad and the tensor the backward reads, whose layout each sample's grad_in has (a stand-in:
        # its batch dimension orders nothing, as when that tensor is not batched).
        g = grad.movedim(gd, 0) if gd is not None else grad.unsqueeze(0).expand(info.batch_size, *grad.shape)
        size = (info.batch_size, *out[0].shape)
        result = grad.new_empty_strided(size, _C.backward_strides(name, size, g.stride(), (0, *out[0].stride())))
        for b, o in enumerate(out):
            result[b].copy_(o)
        return result, 0

    torch.library.register_vmap(op)(public_vmap)
    torch.library.register_vmap(f"{op}_")(public_inplace_vmap)
    torch.library.register_vmap(f"{op}_fwd")(fwd_vmap)
    torch.library.register_vmap(f"{op}_fwd_")(fwd_inplace_vmap)
    torch.library.register_vmap(f"{op}_bwd")(bwd_vmap)


for _name in _C.install_targets():  # the table's names, declared once (csrc/activations/activations.h)
    _register_activation(_name)
