"""Type stub for relu_ext._C, the pybind11 module built from csrc/core/module.cpp.

The ops themselves are reached as ``torch.ops.relu_ext.*``.
"""

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

with_cuda: bool
"""True when the CUDA kernels were compiled into this build (``build_info()["cuda"]``),
GPU or not; ``relu_ext.cuda_available()`` also asks torch for a GPU."""

def cpu_isa() -> str:
    """CPU kernel set in use: 'avx512', 'avx2' or 'scalar'."""

def set_cpu_isa(name: str) -> None:
    """Choose the CPU kernel set: 'auto' (best this CPU has), 'avx512', 'avx2' or 'scalar'."""

def cuda_unroll() -> int:
    """Rows per warp and loop iteration of the CUDA vector kernels (1, 2 or 4).
    Raises RuntimeError in a build without CUDA kernels."""

def set_cuda_unroll(rows: int) -> None:
    """Choose the CUDA kernels' unroll: 1, 2 or 4 (ValueError otherwise). For
    tests and tuning. Raises RuntimeError in a build without CUDA kernels."""

def cuda_waves() -> int:
    """Grid cap of the CUDA kernels in waves of resident blocks (0: no cap).
    Raises RuntimeError in a build without CUDA kernels."""

def set_cuda_waves(waves: int) -> None:
    """Cap the CUDA kernels' grids at `waves` times the blocks that fit on the
    device at once: 0 (no cap) to 64 (ValueError otherwise). For tests and
    tuning. Raises RuntimeError in a build without CUDA kernels."""

def relu(input: Tensor, inplace: bool = False) -> Tensor:
    """relu_ext.relu for plain tensors in eager mode (the relu_ext::relu / relu_ op)."""

def act(name: str, input: Tensor, inplace: bool, a0: float, a1: float) -> Tensor:
    """relu_ext's family functions for plain tensors in eager mode: the
    relu_ext::<name> (or <name>_, returning input) op with its Scalar
    arguments in schema order (the unused ones ignored)."""

def same_bits(a: Tensor, b: Tensor) -> bool:
    """Whether two CPU tensors of the same sizes and dtype hold the same bits, whatever their
    strides (save_compact's check of a concatenation's pieces). RuntimeError otherwise."""

def compact_now(y: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, bool]:
    """relu_ext::compact of CPU `y` by `mask` where that restores `y`, else by relu_ext::nonzero_mask(y),
    through the C++ dispatcher (save_compact's pack hook): (values, the mask used, whether it is
    `mask`). ValueError for a tensor on another device; the ops' errors otherwise."""

def expand(values: Tensor, mask: Tensor, size: Sequence[int], stride: Sequence[int]) -> Tensor:
    """relu_ext::expand(values, mask, size, stride, False) through the C++ dispatcher (save_compact's
    unpack hook): the tensor `values` and `mask` were compacted from, laid out as size / stride."""

def bn_terms(weight: Tensor | None, bias: Tensor | None, mean: Tensor, var: Tensor, training: bool, eps: float,
             dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """relu_ext::bn_terms through the C++ dispatcher, below autograd (save_compact's replay): a
    BatchNorm's per-channel (alpha, beta) for outputs of `dtype`."""

def bn_act_verify(x: Tensor, alpha: Tensor, beta: Tensor, act: str, args: Sequence[float], y: Tensor,
                  x2: Tensor | None = None, alpha2: Tensor | None = None, beta2: Tensor | None = None) -> Tensor:
    """relu_ext::bn_act_verify through the C++ dispatcher, below autograd (save_compact's pack hook)."""

def bn_act_rebuild(x: Tensor, alpha: Tensor, beta: Tensor, act: str, args: Sequence[float],
                   x2: Tensor | None = None, alpha2: Tensor | None = None, beta2: Tensor | None = None) -> Tensor:
    """relu_ext::bn_act_rebuild through the C++ dispatcher, below autograd (save_compact's unpack hook)."""

def dense_at_least(t: Tensor, numel: int) -> bool:
    """Whether `t` is a strided (not nested) CPU or CUDA tensor of at least `numel` elements that fills a
    block of memory exactly once, in any order of dimensions (save_compact's pack hook)."""

class VersionCounter:
    """A tensor's version counter, shared with its views; holds no data."""

    @property
    def version(self) -> int:
        """The counter's value now: ``t._version`` of every tensor that shares it."""

def version_counter(t: Tensor) -> VersionCounter:
    """`t`'s version counter (not its data): ``t._version``, read later, even after `t` is freed
    (save_compact's forms)."""

def bits_sum(t: Tensor) -> int:
    """The sum of a dense CPU tensor's bytes as 64-bit words from its first element, modulo 2**64, as
    an int64 (the fingerprint of a remade tensor's rebuild). RuntimeError for another tensor."""

def output_strides(name: str, x: Tensor) -> list[int]:
    """The strides of relu_ext::<name>(x)'s output: PyTorch's for its op (the
    fake kernels lay out their outputs so; symbolic while tracing)."""

def backward_strides(name: str, sizes: Sequence[int], grad: Sequence[int], self: Sequence[int]) -> list[int]:
    """The strides PyTorch's backward of relu_ext::<name> gives grad_in, for a grad and the tensor that
    backward reads (its input or output) of these sizes and strides, in its operand order (the vmap
    rules lay out a batch's grad_in so)."""

def install_targets() -> list[str]:
    """The aten ops install() can take over, by name: 'relu' and the family's."""

def install(ops: list[str]) -> None:
    """Register relu_ext's kernels for these aten ops and their in-place forms
    (idempotent; ValueError for an unknown name)."""

def uninstall(ops: list[str]) -> None:
    """Remove them: PyTorch's own kernels are back (idempotent)."""

def installed() -> list[str]:
    """The aten ops relu_ext's kernels run now."""

def set_recompute_probe(probe: Callable[[str, bool], bool]) -> None:
    """probe(op, installed): whether an autograd kernel of relu_ext (installed for
    aten's op, or relu_ext's own), recording a node under saved-tensor hooks,
    must run PyTorch's kernel for op (activation checkpointing, selective too)."""

class NativePacker:
    """save_compact's pack hook, its C++ path: the saved tensors no form takes, kept as they are
    (parameters and views of them, buffers, masks, outputs of ops the table has no row for), and the
    CPU compactions at once of ReLU's and its like's outputs: csrc/compact/hooks.cpp."""

    def __init__(self, dense: type, python_cache: dict[int, Any], min_numel: int, python_nodes: frozenset[str],
                 recent: Any, note: str | None, compacts: frozenset[str],
                 after: frozenset[str], deferred: type, share: float,
                 compacted: Callable[[Tensor, Tensor, Tensor, bool, int], Any]) -> None: ...

    def keep(self, t: Tensor) -> Any:
        """`t` kept as it is (a ``dense``) and counted once, or compacted (what ``compacted`` makes), or
        the form made of it before, again; None where the Python path decides."""

    def counted(self, t: Tensor) -> bool:
        """Whether keep() counted `t`."""

    def take(self) -> tuple[int, int, int, int]:
        """(tensors, bytes, leaves, leaves' bytes) counted since the last call."""

    def outside(self) -> tuple[int, int]:
        """(tensors, bytes) of those counted since the last call that no node made, need no gradient and
        something else still holds."""

class _MaskBackward:
    """A backward node's Python type (``y.grad_fn`` of a relu_ext output): the
    mask, and the op's Scalar arguments (as floats, schema order, 0.0 past the
    op's own)."""

    _saved_mask: Tensor
    _saved_args: tuple[float, float]
    next_functions: tuple[tuple[Any, int], ...]
    def __call__(self, *grads: Tensor) -> Any: ...
    def name(self) -> str: ...

def __getattr__(name: str) -> type[_MaskBackward]:
    """Each activation's node type, by its name (activation_table()'s second column, e.g. ReluExtBackward0)."""

def activation_table() -> list[tuple[str, str, list[str]]]:
    """The activation table (csrc/activations/activations.h): (op name, backward node name, names of its
    Scalar arguments in its registered schema) per trait, in order."""
