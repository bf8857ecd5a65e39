"""Op-level selective activation checkpointing, as torchtitan applies it: what a user picks instead of
save_compact() to hold less, bit for bit (the same ops run again on the same inputs). The memory
section's ``sac nn.ReLU`` configuration: each block of the model (every item of a list of two or more
modules of one class: a transformer's layers, a ResNet stage's blocks) runs under
``torch.utils.checkpoint`` with a policy that saves the outputs of matrix products, convolutions and
attention (``SAVED``) and recomputes everything else in backward.

What such a model holds is not all saved through saved-tensor hooks (the policy's saved outputs are
kept by the checkpoint's own dispatch mode), so its held bytes are counted from the allocator
(``allocated_bytes``): what the forward leaves allocated.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# The ops whose outputs the policy saves (torchtitan's: matmuls and attention), as data.
SAVED = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten.convolution.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
})


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save what SAVED lists, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """A block run under selective checkpointing (see the module's documentation)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.block, *args, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, _policy), **kwargs)


def selective(model: nn.Module) -> nn.Module:
    """`model` with each of its blocks checkpointed, in place. A transformers model checkpoints its own
    layers (gradient_checkpointing_enable, which also stops its key-value cache, state a recomputation
    would see changed), with this policy. Any other: in every nn.ModuleList or nn.Sequential, the items
    of a class that two or more of them share (and that hold parameters) run as Checkpointed (not again
    inside one). A model with no such blocks runs whole as one Checkpointed."""
    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": functools.partial(create_selective_checkpoint_contexts, _policy)})
        return model
    return model if _wrap(model) else Checkpointed(model)


def _wrap(module: nn.Module) -> int:
    """selective() below `module` (itself included): how many blocks it wrapped."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return sum(_wrap(child) for child in module.children())
    kinds = [type(child) for child in module]
    wrapped = 0
    for i, child in enumerate(module):
        if kinds.count(type(child)) >= 2 and any(True for _ in child.parameters()):
            module[i] = Checkpointed(child)
            wrapped += 1
        else:
            wrapped += _wrap(child)
    return wrapped


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=None)
def _mallinfo2() -> Any:
    """glibc's mallinfo2, or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _Mallinfo2
    return fn


def allocated_bytes() -> int | None:
    """Bytes the C allocator has handed out and not taken back (glibc: every arena's blocks in use and
    its mmapped blocks), where tensors on the CPU live; None without glibc's mallinfo2."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return info.uordblks + info.hblkhd
