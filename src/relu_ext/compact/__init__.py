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
``relu_ext::compact`` / ``expand`` / ``nonzero_mask`` (csrc/compact/compact_cpu.cpp on
the CPU, csrc/compact/kernels.cuh on CUDA).

Recompute (on by default): an activation output whose input is a BatchNorm
output (``NativeBatchNormBackward0``, or cuDNN's ``CudnnBatchNormBackward0``;
training or eval) is kept as a recipe instead: a reference to the
BatchNorm's input, which its node keeps anyway, and a few numbers per
channel, from which it is rebuilt in backward exactly as PyTorch's kernels on
that device computed it (``relu_ext::bn_terms`` / ``bn_act_rebuild``:
csrc/compact/replay_cpu.cpp on the CPU; on CUDA, csrc/compact/kernels.cuh replays
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

The package: ``hooks`` (``save_compact`` and its pack hook, ``_Packer``: one path for every form's
check), ``forms`` (the forms a saved tensor is kept in), ``recipes`` (the table of forms, ``FORMS``,
and making each: recipes read from the graph, compaction, bitmaps), ``deferred`` (every read of a
device value), ``streams`` (the CUDA streams forms are made, filled and read on), ``graph`` (every
read of PyTorch's private autograd attributes), ``stats`` (the counts and ``report()``), ``bits``
(comparing tensors bit for bit, bool bitmaps).
"""

# The forms and the bit comparisons too, as ``relu_ext.compact.<name>``, which tests read.
from .bits import _same_bits_on_device  # noqa: F401
from .forms import Compacted, Concatenated, Narrowed, Pooled, Replayed, TwoValued  # noqa: F401
from .hooks import save_compact  # noqa: F401
