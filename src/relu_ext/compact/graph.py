"""Reading the autograd graph for ``save_compact()``: every read of PyTorch's private autograd attributes.

Nodes keep what they saved as ``_saved_<name>`` (a value) and ``_raw_saved_<name>`` (the
``SavedTensor``, with what a pack hook returned as ``data`` and its ``unpack_hook``); these and
node names are not public API, so they are read here only, each function saying which torch
versions it was checked on (those the tests run on). ``next_functions`` and ``metadata`` are
public, but walking the graph with them is read here too, so that one module follows the graph's
shape.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor

# BatchNorm nodes whose output the replay rebuilds: PyTorch's kernels (CPU, CUDA), and cuDNN's,
# which the CUDA replay matches where its verification says so.
_BN_NODES = frozenset({"NativeBatchNormBackward0", "CudnnBatchNormBackward0"})
# Nodes whose outputs are kept as recipes of what other nodes keep (recipes.FORMS).
_CAT, _MAX_POOL = "CatBackward0", "MaxPool2DWithIndicesBackward0"
# LayerNorm's node, whose output is remade by PyTorch's LayerNorm (forms.RemadeNorm).
_LAYER_NORM = "NativeLayerNormBackward0"
# A cast's node (``t.to(dtype)``, ``t.float()``): a widening one's output is remade from a copy in its
# input's dtype where no node keeps that input (recipes._widened).
_CAST = "ToCopyBackward0"


class _Remake(NamedTuple):
    """How an op's output is remade (forms.Remade): the op; for each of its tensor inputs, in the op's
    order, the name its node saves it as, or None where the node keeps no such input (a tanh keeps its
    output, an add nothing: that input comes from another node, or is remade itself); its other
    arguments as its node keeps them (passed as keywords); `output`: the keywords given its output's
    dtype or sizes, which its node does not keep (a cast, a mean, a view) but autograd records;
    `by_split`: whether its bits on the CPU depend on how the work is split among threads (its vector
    and scalar loops differ in last bits: a transcendental such as GELU's erf; a reduction's order),
    so that a rebuild runs with the forward's thread count. An IEEE add, multiply or divide, or a cast,
    is the same in every loop."""

    op: Any
    inputs: tuple[str | None, ...]
    args: tuple[str, ...] = ()
    output: tuple[str, ...] = ()  # ("dtype",), ("size",)
    by_split: bool = False


_aten = torch.ops.aten

# Nodes of ops whose output is remade from its inputs (forms.Remade), by the node's name.
_REMAKE: dict[str, _Remake] = {
    "MulBackward0": _Remake(_aten.mul.Tensor, ("self", "other")),
    "MulBackward1": _Remake(_aten.mul.Scalar, (None,), ("other",)),
    "EmbeddingBackward0": _Remake(_aten.embedding.default, (None, "indices"),
                                  ("padding_idx", "scale_grad_by_freq", "sparse")),
    "DivBackward0": _Remake(_aten.div.Tensor, ("self", "other")),
    "AddBackward0": _Remake(_aten.add.Tensor, (None, None), ("alpha",)),
    _CAST: _Remake(_aten._to_copy.default, (None,), output=("dtype",)),
    "ViewBackward0": _Remake(_aten.view.default, (None,), output=("size",)),
    "UnsafeViewBackward0": _Remake(_aten._unsafe_view.default, (None,), output=("size",)),
    "AliasBackward0": _Remake(_aten.alias.default, (None,)),
    "TransposeBackward0": _Remake(_aten.transpose.int, (None,), ("dim0", "dim1")),
    "TBackward0": _Remake(_aten.t.default, (None,)),
    "GeluBackward0": _Remake(_aten.gelu.default, ("self",), ("approximate",), by_split=True),
    "SiluBackward0": _Remake(_aten.silu.default, ("self",), by_split=True),
    "TanhBackward0": _Remake(_aten.tanh.default, (None,), by_split=True),
    "SigmoidBackward0": _Remake(_aten.sigmoid.default, (None,), by_split=True),
    "RsqrtBackward0": _Remake(_aten.rsqrt.default, (None,), by_split=True),
    "PowBackward0": _Remake(_aten.pow.Tensor_Scalar, ("self",), ("exponent",), by_split=True),
    "MeanBackward1": _Remake(_aten.mean.dim, (None,), ("dim", "keepdim"), output=("dtype",), by_split=True),
}
# Ops of a chain that is run only when a tensor is saved, to find a copy the form then holds (never in
# backward): attention scores' matmul (recipes._softmax_widened), which, remade in backward, would cost
# more per byte it saves than selective checkpointing pays.
_FIND: dict[str, _Remake] = {"BmmBackward0": _Remake(_aten.bmm.default, ("self", "mat2"))}
# A softmax's node: a float32 softmax of narrower scores (HF's eager attention) is remade from a copy
# of its input in the input's dtype (recipes._softmax_widened).
_SOFTMAX = "SoftmaxBackward0"

# Nodes of _REMAKE that make views: run inside a chain (the bfloat16 cast of a view of a LayerNorm
# output), never a form of their own (a saved view is its base's form, or as it is: hooks._pack_view).
REMAKE_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "AliasBackward0", "TransposeBackward0",
                          "TBackward0"})


def _activation_nodes() -> dict[str, tuple[Any, bool]]:
    """Node name -> (its activation, whether it is relu_ext's), from the activation table."""
    from ..activations import ACTIVATIONS

    nodes: dict[str, tuple[Any, bool]] = {}
    for act in ACTIVATIONS:
        nodes[act.node] = (act, True)
        nodes[act.torch_node] = (act, False)
    return nodes


_ACTIVATION_NODES = _activation_nodes()
ACTIVATION_NODES = frozenset(_ACTIVATION_NODES)  # (the names of the nodes of ReLU and the family)
# The nodes whose outputs are mostly zeros whatever their arguments (ReLU's, Hardsigmoid's; see _mostly_zeros):
# compacted at once on the CPU by the pack hook's C++ path (csrc/compact/hooks.cpp).
COMPACTS = frozenset(name for name, (act, _) in _ACTIVATION_NODES.items() if not act.params and act.zeros(()))
_RELU_EXT_NODE = next(name for name, (act, ours) in _ACTIVATION_NODES.items() if act.name == "relu" and ours)


def _activation_args(fn: Any, act: Any, ours: bool) -> tuple[Any, ...]:
    """The arguments node `fn` of activation `act` kept: relu_ext's nodes keep them all
    (``_saved_args``), PyTorch's some (``_saved_<param>``; one not kept is None).
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    return fn._saved_args if ours else tuple(getattr(fn, f"_saved_{p}", None) for p in act.params)


def _mostly_zeros(fn: Any) -> bool:
    """Whether outputs of `fn`'s op are mostly zeros: ReLU, and the family where
    its arguments say so (relu6 / hardtanh with min_val 0, threshold with value
    0, hardsigmoid). PyTorch's nodes keep some arguments (``_saved_min_val``),
    relu_ext's keep them all (``_saved_args``); an argument not kept counts as no.
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    hit = _ACTIVATION_NODES.get(fn.name())
    if hit is None:
        return False
    act, ours = hit
    return bool(act.zeros(_activation_args(fn, act, ours)))


# Nodes whose output is zero wherever one of its inputs is: a product, such as dropout's (its noise times
# its input on the CPU; torch.native_dropout's, which CUDA's dropout runs).
PRODUCTS = frozenset({"MulBackward0", "NativeDropoutBackward0"})


def _zeros_by_a_factor(fn: Any) -> bool:
    """Whether `fn` is a product's node (PRODUCTS) one of whose inputs is an output of an activation that
    is mostly zeros (_mostly_zeros): dropout after a ReLU, whose output is mostly zeros too.
    Checked on torch 2.11 and 2.15.0."""
    return fn.name() in PRODUCTS and any(node is not None and _mostly_zeros(node) for node, _ in fn.next_functions)


def _cast_from(fn: Any) -> torch.dtype | None:
    """The dtype of the input of cast node `fn` (_CAST), as its input's node records that output
    (``_input_metadata``); None where no node made the input. Checked on torch 2.11 and 2.15.0."""
    node, output_nr = fn.next_functions[0]
    meta = getattr(node, "_input_metadata", None) if node is not None else None
    return meta[output_nr].dtype if meta is not None and output_nr < len(meta) else None


def _activation_of(fn: Any) -> tuple[str, list[float]] | None:
    """The op and Scalar arguments of the activation whose node is `fn`, as the
    replay takes them, or None (another node, or PyTorch's ThresholdBackward0,
    which does not keep ``value``). Checked on torch 2.11, 2.14.1 and 2.15.0."""
    hit = _ACTIVATION_NODES.get(fn.name())
    if hit is None:
        return None
    act, ours = hit
    args = _activation_args(fn, act, ours)[: len(act.params)]
    if any(a is None for a in args):
        return None
    return act.name, [float(a) for a in args]


def _after_batchnorm(fn: Any) -> bool:
    """Whether `fn` is an activation node whose input is a BatchNorm output the replay takes, or
    a residual add (``AddBackward0``, alpha 1) of one and another tensor (see ``_replayed``).
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    if fn.name() not in _ACTIVATION_NODES:
        return False
    nexts = fn.next_functions  # (a new tuple each time it is read)
    prev = nexts[0][0] if nexts else None
    if prev is None:
        return False
    name = prev.name()
    if name in _BN_NODES:
        return True
    return name == "AddBackward0" and any(f is not None and f.name() in _BN_NODES for f, _ in prev.next_functions)


def _is_batchnorm(fn: Any) -> bool:
    """Whether `fn` is a BatchNorm node the replay takes. Checked on torch 2.11, 2.14.1 and 2.15.0."""
    return fn.name() in _BN_NODES


def _batchnorm_inputs(fn: Any) -> tuple[Any, tuple[Any, int] | None] | None:
    """For activation node `fn` after a BatchNorm (see _after_batchnorm): the BatchNorm's node, and
    after a residual add, the add's other input as (node, output_nr); None where the add scales
    (alpha other than 1) or its other input has no node. Checked on torch 2.11, 2.14.1 and 2.15.0."""
    prev = fn.next_functions[0][0]
    if prev.name() in _BN_NODES:
        return prev, None
    if prev._saved_alpha != 1:
        return None
    (a, a_nr), (b, b_nr) = prev.next_functions
    if a is None or a.name() not in _BN_NODES:
        (a, a_nr), (b, b_nr) = (b, b_nr), (a, a_nr)  # (the sum is symmetric)
    if b is None:
        return None
    return a, (b, b_nr)


def _node_name(fn: Any) -> str | None:
    """The name of node `fn` (``_CAT``, ``_MAX_POOL``, an activation's, ...), or None for no node (a
    tensor no node made). Checked on torch 2.11, 2.14.1 and 2.15.0."""
    return None if fn is None else fn.name()



def _layer_norm_saved(fn: Any) -> tuple[tuple[int, ...], _Saved, _Saved, _Saved, _Saved]:
    """What LayerNorm node `fn` saved, not unpacked: its normalized shape, input, weight and bias (no
    data: none), and rstd (``result2``); not its eps, which it does not keep.
    Checked on torch 2.11 and 2.15.0."""
    shape = tuple(fn._saved_normalized_shape)
    return (shape, *(_raw_saved(fn, name) for name in ("input", "weight", "bias", "result2")))


def _remake_of(fn: Any) -> tuple[Any, list[_Saved], bool] | None:
    """For a node of _REMAKE (or _FIND): its op (with the node's other arguments bound), what it saved of the op's
    tensor inputs, in the op's order, not unpacked (an input it did not save has no data), and the
    op's `by_split`; None where the output's dtype is not recorded (``_input_metadata``: the forward's
    outputs, whose gradients the node takes). Checked on torch 2.11 and 2.15.0."""
    entry = _REMAKE.get(fn.name()) or _FIND[fn.name()]
    kwargs = {name: _signed(getattr(fn, f"_saved_{name}")) for name in entry.args}
    if entry.output:
        outputs = getattr(fn, "_input_metadata", None)
        if not outputs:
            return None
        kwargs.update({name: outputs[0].dtype if name == "dtype" else list(outputs[0].shape) for name in entry.output})
    op = functools.partial(entry.op, **kwargs) if kwargs else entry.op
    saved = [_raw_saved(fn, name) if name is not None else _Saved(None, None) for name in entry.inputs]
    return op, saved, entry.by_split


def _cast_input(fn: Any) -> Any | None:
    """The cast's node (_CAST) that made node `fn`'s first input, else None. Checked on torch 2.11 and 2.15.0."""
    node, _ = fn.next_functions[0]
    return node if node is not None and node.name() == _CAST else None


def _softmax_scores(fn: Any) -> tuple[int, Any, Any, bool] | None:
    """For softmax node `fn` whose input is a widening cast of scores, or of scores plus a tensor that
    needs no gradient (an add with alpha 1: ``softmax(scores + mask, dim, dtype=torch.float32)``): the
    softmax's dim, the cast's node, the scores' node, and whether a mask was added; else None.
    Checked on torch 2.11 and 2.15.0."""
    cast = _cast_input(fn)
    if cast is None:
        return None
    node, output_nr = cast.next_functions[0]
    if node is None or output_nr != 0:
        return None
    if node.name() != "AddBackward0":
        return _signed(fn._saved_dim), cast, node, False
    known = [(prev, nr) for prev, nr in node.next_functions if prev is not None]
    if node._saved_alpha != 1 or len(node.next_functions) != 2 or len(known) != 1 or known[0][1] != 0:
        return None
    return _signed(fn._saved_dim), cast, known[0][0], True


def _node_key(fn: Any) -> tuple[Any, ...] | None:
    """Node `fn` of _REMAKE as what its output is made of: its name, its inputs' nodes (compared by
    identity: the key holds them, so a node keeps its Python object) and output numbers, and its other
    arguments; None where an input has no node (a tensor that needs no gradient, a number: other values
    could stand there). Checked on torch 2.11 and 2.15.0."""
    name = fn.name()
    entry = _REMAKE[name]
    edges = fn.next_functions
    if len(edges) != len(entry.inputs) or any(node is None for node, _ in edges):
        return None
    return name, edges, tuple(getattr(fn, f"_saved_{arg}") for arg in entry.args)


def _signed(value: Any) -> Any:
    """An argument a node kept, with dimensions as the op takes them: a node keeps a dimension, or a
    list of them, as unsigned integers (-1 as 2**64 - 1)."""
    if isinstance(value, tuple):
        return [_signed(v) for v in value]
    return value - 2**64 if isinstance(value, int) and value >= 2**63 else value


def _node_inputs(fn: Any, count: int = 0) -> tuple[tuple[Any, int], ...]:
    """The (node, output_nr) pairs of what made node `fn`'s inputs, in its op's order ((None, 0): an
    input that needs no gradient, such as a Python number), padded with (None, 0) to `count` inputs
    (an op's inputs that cannot have a gradient have no edge: embedding's indices, which come last).
    Checked on torch 2.11 and 2.15.0."""
    edges = fn.next_functions
    return edges + ((None, 0),) * (count - len(edges))


def _leaf(fn: Any) -> Tensor | None:
    """The tensor of node `fn` where it is a leaf's (an AccumulateGrad: a parameter, or an input that
    requires grad; the graph holds it), else None. Checked on torch 2.11 and 2.15.0."""
    return getattr(fn, "variable", None)


def _cat_dim(t: Tensor) -> int:
    """The dimension `t`, a ``torch.cat`` output, was concatenated along.
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    dim = t.grad_fn._saved_dim
    return (dim - 2**64 if dim >= 2**63 else dim) % t.dim()  # (kept as an unsigned integer)


def _inputs(t: Tensor) -> tuple[tuple[Any, int], ...]:
    """The (node, output_nr) pairs of what made `t`'s inputs (a concatenation's pieces'), compared
    by identity (see _node_inputs)."""
    return _node_inputs(t.grad_fn)


def _relu_ext_mask(t: Tensor) -> Tensor | None:
    """The mask relu_ext's ReLU node saved for `t`, its output; None where another node made `t`.
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    fn = t.grad_fn
    return fn._saved_mask if fn.name() == _RELU_EXT_NODE else None


class _Saved(NamedTuple):
    """What a node saved, not unpacked: a tensor (no hooks), or what a pack hook returned, and that hook's unpack."""

    data: Any
    unpack_hook: Any


def _raw_saved(fn: Any, name: str) -> _Saved:
    """What node `fn` saved as `name` (``input``, ``weight``, ``result1``, ... of a BatchNorm node;
    ``self`` and ``result1`` of a max-pool's), without unpacking it: so no hook runs and nothing is
    copied. Checked on torch 2.11, 2.14.1 and 2.15.0."""
    saved = getattr(fn, f"_raw_saved_{name}")
    return _Saved(saved.data, saved.unpack_hook)


def _bn_training(bn: Any) -> bool:
    """Whether BatchNorm node `bn` normalized with its batch's statistics.
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    return bool(bn._saved_training)


def _bn_eps(bn: Any) -> float:
    """BatchNorm node `bn`'s eps (PyTorch's kernels keep ``eps``, cuDNN's ``epsilon``).
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    return float(bn._saved_eps if bn.name() == "NativeBatchNormBackward0" else bn._saved_epsilon)


def _bn_bias(bn: Any) -> tuple[Tensor | None, bool]:
    """BatchNorm node `bn`'s bias, read from the graph: the parameter (an AccumulateGrad's), or
    None (no bias, or a frozen one, which verification checks); and False where the bias is
    computed in the graph (FSDP's views of its flat parameter), which no node keeps.
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    bias_fn = bn.next_functions[2][0] if len(bn.next_functions) > 2 else None
    bias = _leaf(bias_fn)
    return bias, bias_fn is None or bias is not None


# Node metadata key: output_nr -> a weak reference to what this context saved
# for that output of the node (a _Dense or _Shared): a residual add's other
# input (_kept_output). (Not the tensor: its Python object may be gone.)
_KEPT = "relu_ext.save_compact.kept"


def _note_kept(t: Tensor, packed: Any) -> None:
    """Note on `t`'s node what this context saved for `t` (see _kept). The pack hook's C++ path
    (csrc/compact/hooks.cpp, NativePacker::note) writes the same entry for the tensors it takes.
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    t.grad_fn.metadata.setdefault(_KEPT, {})[t.output_nr] = weakref.ref(packed)


# Node metadata key: the eps a LayerNorm node's rstd was found to have been made with (recipes'
# chains through it: a second chain through the same node, the cast of its output for another
# Linear, probes no more).
_EPS = "relu_ext.save_compact.eps"


def _note_eps(fn: Any, eps: float) -> None:
    """Note on LayerNorm node `fn` the eps its rstd was found to have been made with.
    Checked on torch 2.11 and 2.15.0."""
    fn.metadata[_EPS] = eps


def _noted_eps(fn: Any) -> float | None:
    """What _note_eps noted on node `fn`, else None. Checked on torch 2.11 and 2.15.0."""
    return fn.metadata.get(_EPS)


def _kept(fn: Any, output_nr: int) -> Any:
    """What _note_kept noted for output `output_nr` of node `fn`, while it lives; else None.
    Checked on torch 2.11, 2.14.1 and 2.15.0."""
    ref = fn.metadata.get(_KEPT, {}).get(output_nr)
    return None if ref is None else ref()
