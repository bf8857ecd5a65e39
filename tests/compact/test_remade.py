"""save_compact()'s remade ops (forms.Remade): a mul or div output kept by a later node, kept as the op
and its inputs, which its own node keeps (or, an input it did not need, another node: dropout's
input), verified bit for bit when saved, run again in backward. Compared with PyTorch on adversarial
data in the four float dtypes, in chains (HF's T5 / Llama RMSNorm), across threads, with in-place
changes after the forward, and on transformers' own models."""

from __future__ import annotations

import collections
import math
import threading
from typing import Any, Callable

import pytest
import torch

import relu_ext
from conftest import DEVICES, adversarial, assert_bitwise_equal, assert_same_step, train_step
from relu_ext.compact import forms, graph, recipes, stats

pytestmark = [pytest.mark.native, pytest.mark.torch_version]  # the risk it checks: see tests/tiers.py

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"mul": torch.mul, "div": torch.div}


def _grads(f: Callable[..., torch.Tensor], inputs: list[torch.Tensor], ctx: Any = None) -> tuple:
    """The loss `f(*inputs)` (run under `ctx`) and its gradients for `inputs`."""
    if ctx is None:
        loss = f(*inputs)
    else:
        with ctx:
            loss = f(*inputs)
    return (loss.detach(), *torch.autograd.grad(loss, inputs))


def _grads_and_ops(f: Callable[..., torch.Tensor], inputs: list[torch.Tensor], ctx: Any) -> tuple[tuple, list[Any]]:
    """_grads under `ctx`, and the ops save_compact() ran meanwhile (run_as_forward's: checks when saved,
    eps probes, rebuilds), in order."""
    ran: list[Any] = []
    with pytest.MonkeyPatch.context() as patch:
        for module in (forms, recipes):
            real = module.run_as_forward
            patch.setattr(module, "run_as_forward", lambda op, *a, real=real: ran.append(op) or real(op, *a))
        return _grads(f, inputs, ctx), ran


def _assert_same(got: tuple, want: tuple) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(a, b, f"output {i}")


# Arguments each op of graph._REMAKE needs besides its tensors (a value its node keeps).
_ARGS: dict[str, dict[str, Any]] = {
    "ToCopyBackward0": {"dtype": torch.float64}, "PowBackward0": {"exponent": 3.0},
    "MeanBackward1": {"dim": [-1], "keepdim": True}, "GeluBackward0": {"approximate": "tanh"},
    "ViewBackward0": {"size": [3, 4]}, "UnsafeViewBackward0": {"size": [12]},
    "TransposeBackward0": {"dim0": -1, "dim1": 0}, "MulBackward1": {"other": 0.3}}
# The tensors an op of graph._REMAKE takes where they are not two float tensors.
_INPUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]] = {
    "EmbeddingBackward0": lambda a, b: (a, torch.tensor([[0, 2], [3, 1]]))}


def test_the_remade_ops_are_the_ops_of_their_nodes():
    """graph._REMAKE's op for each node is the op whose node it is, its node keeps the inputs and
    arguments the row names, and the op the row reads back from the node gives the output again."""
    a, b = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    for name, entry in graph._REMAKE.items():
        inputs = _INPUTS[name](a, b) if name in _INPUTS else (a, b)[: len(entry.inputs)]
        y = entry.op(*inputs, **_ARGS.get(name, {}))
        assert y.grad_fn.name() == name
        assert all(hasattr(y.grad_fn, f"_raw_saved_{s}") for s in entry.inputs if s is not None)
        assert all(hasattr(y.grad_fn, f"_saved_{s}") for s in entry.args)
        remake = graph._remake_of(y.grad_fn)
        assert remake is not None, name
        op, saved, _ = remake
        assert len(graph._node_inputs(y.grad_fn)) <= len(saved) == len(inputs)
        assert_bitwise_equal(op(*inputs), y, name)


@pytest.mark.quick(cover=("op",))  # (every dtype: the full tier, CI's --rest leg)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_an_op_output_kept_by_a_later_node_is_remade_bit_for_bit(op, dtype):
    """mul / div of two tensors that require grad (their node keeps both), kept by a later mul: remade,
    and every gradient is PyTorch's, on adversarial data (NaN, ±inf, ±0, denormals) and a broadcast."""
    x = adversarial(64 * 128, dtype).view(64, 128).requires_grad_()
    y = adversarial(128, dtype, seed=1).requires_grad_()  # (broadcast along x's rows)
    c = adversarial(64 * 128, dtype, seed=2).view(64, 128).requires_grad_()

    def f(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (OPS[op](x, y) * c).nan_to_num().sum()

    want = _grads(f, [x, y, c])
    sc = relu_ext.save_compact()
    got = _grads(f, [x, y, c], sc)
    assert sc.remade == 2, sc.report()  # (op(x, y), kept by the mul; and that mul's output, by nan_to_num)
    _assert_same(got, want)


def _other(dtype: torch.dtype) -> torch.dtype:
    """A float dtype other than `dtype` (what a cast goes to)."""
    return torch.float32 if dtype == torch.float64 else torch.float64


# Rows of x viewed as 8192 x 4 (an embedding's table), repeated, and its padding row.
_IDS = torch.randint(0, 128 * 64, (64, 48), generator=torch.Generator().manual_seed(0))

# The other ops of graph._REMAKE, each on leaves x (128 x 64 x 4) and y (4,), whose nodes keep none of
# their inputs (or, pow, only x; embedding, only its indices): the inputs come from the graph, x and y
# as leaves; a Python number an add was given is found from the output.
ONE_OP: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "add_number": lambda x, y: 1.0 + x,
    "mul_number": lambda x, y: torch.ops.aten.mul.Scalar(x, 0.3),  # (its node keeps the number)
    "embedding": lambda x, y: torch.nn.functional.embedding(_IDS, x.view(-1, 4), padding_idx=0),
    "_to_copy": lambda x, y: x.to(_other(x.dtype)),
    "tanh": lambda x, y: torch.tanh(x),
    "sigmoid": lambda x, y: torch.sigmoid(x),
    "rsqrt": lambda x, y: torch.rsqrt(x),
    "pow": lambda x, y: x.pow(3.0),
    "mean": lambda x, y: x.mean(-1),
}


@pytest.mark.quick(cover=("op",))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ONE_OP)
def test_each_op_of_the_table_is_remade_bit_for_bit(op, dtype):
    """Each op's output, kept by a later mul, remade from inputs its node does not keep (leaves) or
    keeps, or from a number it was given, found; every gradient PyTorch's on adversarial data (NaN,
    ±inf, ±0, denormals), at a size the CPU kernels split among threads."""
    x = adversarial(128 * 64 * 4, dtype).view(128, 64, 4).requires_grad_()
    y = adversarial(4, dtype, seed=1).requires_grad_()
    c = adversarial(1, dtype, seed=2).abs().add(0.5).requires_grad_()

    def f(x: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (ONE_OP[op](x, y) * c).double().nan_to_num().sum()

    inputs = [x, c] if op != "add" else [x, y, c]
    want = _grads(lambda *a: f(x, y, c), inputs)
    sc = relu_ext.save_compact()
    got = _grads(lambda *a: f(x, y, c), inputs, sc)
    name = op.replace("_number", "")
    # (In float64, .double() is the tensor itself: nan_to_num keeps the mul by c, remade too.)
    assert sc.remade_by_op.get(name, 0) == 1 + (name == "mul" and dtype == torch.float64), sc.report()
    _assert_same(got, want)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (transformers' NewGELUActivation), as written there."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


@pytest.mark.quick(cover=())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_chain_through_outputs_no_node_keeps_is_remade(dtype):
    """GPT-2's GELU between two Linears: its tanh's output (kept by the tanh's node) is remade from the
    input through four ops whose outputs no node keeps; ``1.0 + tanh`` with the number found; ``0.5 * x``
    from the input the pow keeps; their product (kept by the Linear) from those two forms. Nothing of it
    is held; every gradient PyTorch's."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 256).to(dtype), torch.nn.Linear(256, 8).to(dtype)
    x = adversarial(4 * 32 * 64, dtype).view(4, 32, 64).requires_grad_()
    params = [x, lin1.weight, lin2.weight]

    def f(*_: torch.Tensor) -> torch.Tensor:
        return lin2(gelu_new(lin1(x))).double().nan_to_num().sum()

    want = _grads(f, params)
    sc = relu_ext.save_compact()
    got = _grads(f, params, sc)
    assert sc.remade_by_op == {"tanh": 1, "add": 1, "mul": 2}, sc.report()
    _assert_same(got, want)


def test_an_add_of_a_tensor_no_node_keeps_keeps_the_output():
    """An add of a tensor that needs no gradient (an attention mask): the number guessed for it fails its
    check, so the output is kept as it is, counted as a miss of `add`; gradients PyTorch's."""
    x, c = torch.randn(64, 128, requires_grad=True), torch.randn(64, 128, requires_grad=True)
    mask = torch.randn(64, 128)

    def f(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ((x + mask) * c).sum()

    want = _grads(f, [x, c])
    sc = relu_ext.save_compact()
    got = _grads(f, [x, c], sc)
    assert sc.remade == 0 and "by op: add 0 (0 B, 1 missed)\n" in sc.report(), sc.report()
    _assert_same(got, want)


ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}


@pytest.mark.quick(cover=("act",))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_a_gelu_or_silu_output_is_remade_bit_for_bit(act, dtype):
    """GELU (both approximations) and SiLU outputs kept by the next Linear (a 2-D view), remade from the
    input their node keeps, with the forward's thread count; gradients PyTorch's on adversarial data,
    at a size the CPU kernels split among threads."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 8).to(dtype)
    x = adversarial(8 * 64 * 512, dtype).view(8, 64, 512).requires_grad_()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return lin(ACTS[act](x)).nan_to_num().float().sum()

    want = _grads(f, [x, lin.weight])
    sc = relu_ext.save_compact()
    got = _grads(f, [x, lin.weight], sc)
    assert sc.remade == 1, sc.report()
    _assert_same(got, want)


def test_a_rebuild_that_differs_from_the_forward_raises():
    """A remade GELU output whose rebuild gives other bits than the forward's (here: an op changed after
    the forward; in use, an OpenMP runtime that ran it on fewer threads) raises, naming the way out,
    instead of giving other gradients."""
    lin, x = torch.nn.Linear(512, 8), torch.randn(4, 16, 512, requires_grad=True)
    with relu_ext.save_compact() as sc:
        loss = lin(torch.nn.functional.gelu(x)).sum()
    made, todo = [], [loss.grad_fn]
    while todo:  # (the Linear keeps a 2-D view of the GELU output: its form is the view's inner one)
        fn = todo.pop()
        saved = getattr(fn, "_raw_saved_mat1", None)
        if saved is not None and isinstance(saved.data, forms._ViewOf):
            made.append(saved.data.inner)
        todo.extend(f for f, _ in fn.next_functions if f is not None)
    assert len(made) == 1 and isinstance(made[0], forms.Remade) and made[0].threads == torch.get_num_threads() and made[0].fingerprint is not None
    made[0].op = lambda t: torch.nextafter(torch.nn.functional.gelu(t), torch.tensor(float("inf")))
    with pytest.raises(RuntimeError, match="gave other bits than the forward's.*recompute=False"):
        loss.backward()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """HF's T5 / Llama RMSNorm, as written there: its float32 chain, then the weight."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + eps)
    return weight * h.to(weight.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wide", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=str)
def test_a_widening_cast_is_remade_from_a_copy_in_its_input_type(narrow, wide, device):
    """A cast to a wider type whose input no node keeps (HF's RMSNorm in a bfloat16 model: the residual
    stream cast to float32, kept by its pow) is remade from a copy in the input's type, which the form
    holds: half the bytes (a quarter to float64); gradients PyTorch's on adversarial data (±0, ±inf,
    denormals, every finite bit pattern). With NaNs too: a cast to bfloat16 makes every NaN one quiet
    NaN, so the check misses and the cast is kept as it is (float16's keeps a NaN's payload in its vector
    loop, not in its scalar one: remade or kept, the gradients are PyTorch's; on CUDA, its casts'
    NaNs decide likewise, and only the gradients are asserted there)."""
    x = adversarial(65536, narrow, seed=7).to(device)
    for nans in (False, True):
        leaf = (x if nans else torch.where(x.isnan(), torch.zeros_like(x), x)).requires_grad_()

        def f(*_: torch.Tensor) -> torch.Tensor:
            return leaf.flip(0).to(wide).pow(2).sum()  # (a flip keeps nothing: no chain reaches the cast)

        want = _grads(f, [leaf])
        sc = relu_ext.save_compact()
        got = _grads(f, [leaf], sc)
        _assert_same(got, want)
        held = sc.bytes_saved_for_backward - x.numel() * wide.itemsize  # (the cast's bytes aside)
        if not nans:
            assert sc.remade_by_op == {"_to_copy": 1} and sc.bytes_held == held + x.nbytes, sc.report()
        elif narrow == torch.bfloat16 and device == "cpu":
            assert sc.remade == 0 and "_to_copy 0 (0 B, 1 missed)" in sc.report(), sc.report()


def _cast_then_kept(leaf: torch.Tensor, w: torch.Tensor, change: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """T5's RMSNorm in a bfloat16 model, its pattern: `h` cast to float32 (kept by its pow), then `h`
    itself kept by a later mul (``h * w``); with `change`, `h` changed in place between the two, outside
    autograd (its node stays the flip's, which the cast's edge names). The pow's loss and the mul's."""
    h = leaf.flip(0)  # (a flip keeps nothing: no chain reaches the cast when it is saved)
    y = h.to(torch.float32).pow(2).sum()
    if change:
        with torch.no_grad():
            h.mul_(2)
    return y, (h * w).float().sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", [False, True], ids=["same", "changed"])
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=str)
def test_a_widening_casts_copy_gives_way_to_its_input_kept_by_a_later_node(narrow, change, device):
    """The widening cast's copy (Widened) and the cast's input, which a node saved later keeps as it is,
    hold the same bits: at the exit the form reads that input and holds nothing. Where the input
    changed in place between the cast and that node (so the two differ), the copy stays. Gradients
    PyTorch's, bit for bit, on adversarial data (no NaN: those miss the cast's own check, above)."""
    x = adversarial(65536, narrow, seed=8).to(device)
    leaf = torch.where(x.isnan(), torch.zeros_like(x), x).requires_grad_()
    w = torch.randn(65536, dtype=narrow).to(device).requires_grad_()

    def f(*_: torch.Tensor) -> torch.Tensor:
        y, z = _cast_then_kept(leaf, w, change)
        return y + z

    want = _grads(f, [leaf, w])
    sc = relu_ext.save_compact()
    got = _grads(f, [leaf, w], sc)
    _assert_same(got, want)
    line = next(line for line in sc.report().splitlines() if line.strip().startswith("remade:"))
    assert sc.remade_by_op == {"_to_copy": 1}
    assert line.strip().startswith(f"remade: 1 tensor, 256.00 KiB held in {'128.00 KiB' if change else '0 B'}"), line


def test_a_widened_cast_reading_its_input_raises_where_that_changed_after_the_forward():
    """The cast's input changed in place after the forward (the form reads it since the exit): the
    cast's rebuild raises PyTorch's in-place error, though the node that keeps the input does not
    run backward."""
    leaf = adversarial(65536, torch.bfloat16, seed=9).nan_to_num().requires_grad_()
    w = torch.randn(65536, dtype=torch.bfloat16, requires_grad=True)
    with relu_ext.save_compact() as sc:
        h = leaf.flip(0)
        y = h.to(torch.float32).pow(2).sum()
        z = h * w  # (kept alive: its node keeps h)
    assert "held in 0 B" in next(line for line in sc.report().splitlines() if "remade:" in line)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*remakes a tensor from this one"):
        torch.autograd.grad(y, leaf)
    del z


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """HF's eager attention (Llama's) in a bfloat16 or float16 model: the float32 softmax of the scaled
    scores plus a mask, cast back, times the values."""
    scores = torch.matmul(q, k.transpose(2, 3)) * 0.25
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [64, 384], ids=["one-block", "blocks"])
@pytest.mark.parametrize("special", [False, True], ids=["random", "specials"])
@pytest.mark.parametrize("mask", ["causal", "none", "bias"])
@pytest.mark.parametrize("narrow", [torch.bfloat16, torch.float16], ids=str)
def test_a_float32_softmax_of_scores_is_remade_from_a_copy_of_its_input(narrow, mask, special, tokens, device):
    """The float32 softmax of narrower attention scores, which no node keeps (its node keeps its output),
    is kept as a copy of its input in the input's dtype, half the bytes: the scores made again once when
    saved (the matmul of q and k, which its node keeps, and the scale), a causal mask (HF's: the dtype's
    lowest value) guessed from where the output is 0, checked in blocks of rows on the CPU (384 tokens:
    five blocks, the last one short; on CUDA the whole). Gradients PyTorch's, bit for bit; with ±inf,
    NaN, ±0 and denormals in q, the rows they reach are checked as any. A mask of other values (a bias
    that needs no gradient, on the last rows only) misses the check: the softmax is kept as it is."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, tokens, 16, generator=g).to(narrow) for _ in range(3))
    if special:
        q[0, 0, :4] = adversarial(64, narrow, seed=12).view(4, 16)  # (the first block's rows)
    lowest = torch.finfo(narrow).min
    causal = torch.full((tokens, tokens), lowest, dtype=narrow).triu(1)
    bias = causal.expand(2, 4, tokens, tokens).clone()  # (a bias on the last block's rows only)
    bias[1, 3, -4:] += torch.randn(4, tokens, generator=g).to(narrow)
    given = {"causal": causal, "none": None, "bias": bias}[mask]
    given = None if given is None else given.to(device)
    leaves = [x.to(device).requires_grad_() for x in (q, k, v)]
    q, k, v = leaves

    def f(*_: torch.Tensor) -> torch.Tensor:
        return _eager_attention(q, k, v, given).float().nan_to_num().sum()

    want = _grads(f, leaves)
    sc = relu_ext.save_compact()
    got = _grads(f, leaves, sc)
    _assert_same(got, want)
    line = next(line for line in sc.report().splitlines() if line.strip().startswith("remade:"))
    if mask == "bias":
        assert "_softmax 0 (0 B, 1 missed)" in line, line
    elif not special:
        nbytes = 2 * 4 * tokens * tokens * 4
        assert sc.remade_by_op["_softmax"] == 1 and f"_softmax 1 ({stats._size(nbytes)})" in line, line


@pytest.mark.quick(cover=())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_chain_is_remade_from_the_form_before_it(dtype):
    """RMSNorm then a Linear: the normalized tensor (kept by the weight's mul) is remade, and the weighted
    one (kept by the Linear, as a 2-D view) is remade from that form: a chain; gradients PyTorch's. Off
    float32, the cast of the input to float32 (kept by the pow) is remade from the input; in bfloat16
    and float16, the normalized tensor is float32 and kept by no node, and its cast back (kept by the
    weight's mul) is remade through it, from the input and the rsqrt."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 64).to(dtype)
    weight = torch.nn.Parameter(torch.rand(256).to(dtype))
    x = adversarial(4 * 32 * 256, dtype).view(4, 32, 256).requires_grad_()

    def f(x: torch.Tensor, weight: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return lin(_rms_norm(x, weight)).nan_to_num().float().sum()

    want = _grads(f, [x, weight, lin.weight])
    made: list[forms.Remade] = []
    sc = relu_ext.save_compact()
    real = sc._packer._form

    def noting(t: torch.Tensor, rows: Any) -> Any:
        form = real(t, rows)
        made.extend([form] if isinstance(form, forms.Remade) else [])
        return form

    sc._packer._form = noting
    got = _grads(f, [x, weight, lin.weight], sc)
    cast = [] if dtype == torch.float32 else ["_to_copy"]
    normalized = ("_to_copy", 2) if dtype in (torch.bfloat16, torch.float16) else ("mul", 1)
    assert [m.op_name for m in made] == [*cast, normalized[0], "mul"], sc.report()
    assert made[-2].depth == normalized[1] and made[-1].depth == normalized[1] + 1
    assert made[-1].sources[1] is made[-2]
    _assert_same(got, want)


@pytest.mark.quick(cover=("eps",))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [1e-5, 1e-12, 1e-3], ids=["eps1e-5", "eps1e-12", "eps_unknown"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_a_layer_norm_output_is_remade_bit_for_bit(dtype, eps, affine):
    """A LayerNorm output kept by the next Linear (as a 2-D view), remade by PyTorch's LayerNorm from the
    input its node keeps, with the eps found from its rstd; an eps not in LAYER_NORM_EPS is not found:
    kept as it is. Gradients PyTorch's on adversarial data (specials in some rows)."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(256, eps=eps, elementwise_affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            norm.weight.uniform_(-2, 2), norm.bias.uniform_(-1, 1)
    lin = torch.nn.Linear(256, 32).to(dtype)
    x = (torch.randn(4, 32, 256) * 3 + 1).to(dtype)
    x[1, :4] = adversarial(4 * 256, dtype).view(4, 256)  # (rows of NaN, ±inf, ±0, denormals)
    x.requires_grad_()
    params = [x, lin.weight, *norm.parameters()]

    def f(*_: torch.Tensor) -> torch.Tensor:
        return lin(norm(x)).nan_to_num().float().sum()

    want = _grads(f, params)
    sc = relu_ext.save_compact()
    got = _grads(f, params, sc)
    assert sc.remade == (eps != 1e-3), sc.report()
    _assert_same(got, want)


@pytest.mark.parametrize("viewed", [False, True], ids=["3-D", "viewed"])
@pytest.mark.parametrize("eps", [1e-5, 1e-3], ids=["eps1e-5", "eps_unknown"])
def test_a_cast_of_a_layer_norm_output_is_remade_through_the_layer_norm(eps, viewed):
    """Under bfloat16 autocast a Linear keeps the cast of a LayerNorm's output (or of a 2-D view of it,
    as GPT-2's Conv1D takes), which no node keeps: the cast is remade through the view and the
    LayerNorm, its eps found from its rstd at once (on the CPU), as is the cast of the Linear's weight
    (from the parameter); an eps it does not try keeps the first cast as it is. Gradients PyTorch's,
    with specials in some rows."""
    torch.manual_seed(0)
    norm, lin = torch.nn.LayerNorm(256, eps=eps), torch.nn.Linear(256, 64)
    x = torch.randn(4, 32, 256) * 3 + 1
    x[1, :2] = adversarial(2 * 256, torch.float32).view(2, 256)
    x.requires_grad_()
    params = [x, lin.weight, norm.weight]

    def f(*_: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            h = norm(x)
            return lin(h.view(-1, 256) if viewed else h).nan_to_num().float().sum()

    want = _grads(f, params)
    sc = relu_ext.save_compact()
    got = _grads(f, params, sc)
    assert sc.remade_by_op == {"_to_copy": 2 if eps == 1e-5 else 1}, sc.report()
    _assert_same(got, want)


@pytest.mark.quick(cover=())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_casts_of_one_tensor_are_remade_once_as_twins(dtype, norm):
    """Under autocast, attention's q, k and v Linears each cast the same normalized tensor again, which no
    node keeps: the first cast is remade through the norm (its chain run when saved and in backward);
    the other two are its twins: compared with its value when saved, and rebuilt from its rebuild, so
    the chain runs once each way, not three times. Gradients PyTorch's, with specials in some rows."""
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(256, 64) for _ in range(3))
    weight = torch.nn.Parameter(torch.rand(256))
    layer = torch.nn.LayerNorm(256)
    x = torch.randn(4, 32, 256) * 3 + 1
    x[1, :2] = adversarial(2 * 256, torch.float32).view(2, 256)
    x.requires_grad_()
    params = [x, q.weight, v.weight, weight if norm == "rms" else layer.weight]

    def f(*_: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype):
            h = _rms_norm(x, weight) if norm == "rms" else layer(x)
            return (q(h) * k(h) + v(h)).nan_to_num().float().sum()

    want = _grads(f, params)
    sc = relu_ext.save_compact()
    got, ops = _grads_and_ops(f, params, sc)
    ran = [forms._op_name(op) for op in ops]
    # (three weights' casts, three of h; RMSNorm's normalized tensor, kept by the weight's mul, too)
    assert sc.remade_by_op == {"_to_copy": 6, **({"mul": 1} if norm == "rms" else {})}, sc.report()
    # Each way: the three weights' casts from the parameters, h's cast through its chain, two twins.
    # (RMSNorm's normalized tensor remade each way; the LayerNorm's eps probed once, five eps, for the first)
    also = {"mul": 2} if norm == "rms" else {None: len(forms.LAYER_NORM_EPS)}
    assert collections.Counter(ran) == {"_to_copy": 8, "alias": 2, **also}, ran
    _assert_same(got, want)


def test_a_twin_of_a_form_that_missed_is_the_tensor_it_keeps():
    """The first cast's check misses (its remade value made wrong here): it keeps its tensor, and its
    twins are checked against that tensor, which they are rebuilt as. Gradients PyTorch's."""
    torch.manual_seed(0)
    q, k = torch.nn.Linear(256, 64), torch.nn.Linear(256, 64)
    norm = torch.nn.LayerNorm(256)
    x = (torch.randn(4, 32, 256) * 3 + 1).requires_grad_()
    params = [x, q.weight, k.weight, norm.weight]

    def f(*_: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            h = norm(x)
            return (q(h) * k(h)).float().sum()

    want = _grads(f, params)
    sc = relu_ext.save_compact()
    with pytest.MonkeyPatch.context() as patch:
        real = recipes.run_as_forward

        def wrong_once(op: Any, args: list[Any]) -> torch.Tensor:
            out = real(op, args)
            if forms._op_name(op) == "_to_copy" and out.dim() == 3 and not ran:
                ran.append(op)
                out = out.clone()
                out.view(-1)[7] += 1  # (a value the check sees is not the tensor's)
            return out

        ran: list[Any] = []
        patch.setattr(recipes, "run_as_forward", wrong_once)
        got = _grads(f, params, sc)
    assert ran and "_to_copy 3 (128.00 KiB, 1 missed)" in sc.report(), sc.report()
    assert sc.remade_by_op == {"_to_copy": 3}, sc.report()  # (two weights' casts, the twin)
    _assert_same(got, want)


def test_a_layer_norm_is_probed_once_for_the_chains_through_it():
    """Under autocast, two Linears keep casts of two ops of one LayerNorm's output (no twins): each is
    remade through the LayerNorm, whose eps is probed for the first and noted on its node for the
    second. Gradients PyTorch's."""
    torch.manual_seed(0)
    norm, lin = torch.nn.LayerNorm(256, eps=1e-12), torch.nn.Linear(256, 64)
    x = (torch.randn(4, 32, 256) * 3 + 1).requires_grad_()
    params = [x, lin.weight, norm.weight]

    def f(*_: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16):
            h = norm(x)
            return (lin(h * 0.5) * lin(h * 2.0)).float().sum()

    want = _grads(f, params)
    sc = relu_ext.save_compact()
    got, ops = _grads_and_ops(f, params, sc)
    ran = [forms._op_name(op) for op in ops]
    assert sc.remade_by_op == {"_to_copy": 3}, sc.report()  # (the weight's cast; the two products')
    assert ran.count(None) == len(forms.LAYER_NORM_EPS), ran  # (one probe of every eps)
    _assert_same(got, want)


def test_a_layer_norm_output_is_remade_with_its_weights_last_eps():
    """A LayerNorm's output, step after step: the first step probes which eps gives its rstd; the next
    tries the eps its weight's last output had, on the whole tensor, and probes nothing; after the
    module's eps changes, that guess misses and the probe runs again: remade every step, gradients
    PyTorch's."""
    forms.EPS_BY_WEIGHT.eps.clear()
    torch.manual_seed(0)
    norm, lin = torch.nn.LayerNorm(256, eps=1e-12), torch.nn.Linear(256, 64)
    x = (torch.randn(4, 32, 256) * 3 + 1).requires_grad_()
    params = [x, lin.weight, norm.weight]

    def f(*_: torch.Tensor) -> torch.Tensor:
        return lin(norm(x)).square().sum()

    probes = []
    for eps in (1e-12, 1e-12, 1e-5):
        norm.eps = eps
        want = _grads(f, params)
        sc = relu_ext.save_compact()
        got, ran = _grads_and_ops(f, params, sc)
        assert sc.remade_by_op == {"layer_norm": 1}, sc.report()
        _assert_same(got, want)
        probes.append(sum(isinstance(op, forms.LayerNormOf) and op.output == 2 for op in ran))  # (rstd: a probe)
    n = len(forms.LAYER_NORM_EPS)
    assert probes == [n, 0, n], probes


def test_an_eps_that_matches_the_probe_alone_is_not_taken():
    """Where an eps that is not the LayerNorm's gives the node's rstd on the probed row, and not the output
    (here every row's variance dwarfs eps but one element of a row is off by an ulp: the probe's row is
    found, the output misses), the tensor is kept as it is, never rebuilt wrong."""
    norm, lin = torch.nn.LayerNorm(256, eps=1e-6), torch.nn.Linear(256, 8)
    x = (torch.randn(4, 256) * 1e4).requires_grad_()
    real = forms.LAYER_NORM_EPS
    forms.LayerNormOf.__call__, call = (lambda self, x, w, b: torch.nextafter(
        torch.native_layer_norm(x, self.shape, w, b, self.eps)[0], torch.tensor(float("inf")))), forms.LayerNormOf.__call__
    try:
        with relu_ext.save_compact() as sc:
            loss = lin(norm(x)).sum()
    finally:
        forms.LayerNormOf.__call__ = call
    assert real == forms.LAYER_NORM_EPS and sc.remade == 0, sc.report()
    got = torch.autograd.grad(loss, [x, norm.weight])
    _assert_same(got, torch.autograd.grad(lin(norm(x)).sum(), [x, norm.weight]))


def test_dropout_input_kept_by_another_node():
    """CPU dropout is a mul of its input by a noise tensor, and its node keeps the noise only: the input
    comes from the node that keeps it (softmax keeps its output), so the dropout's output is remade."""
    torch.manual_seed(0)
    scores = torch.randn(2, 4, 64, 64, requires_grad=True)
    v = torch.randn(2, 4, 64, 32, requires_grad=True)

    def f(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(1)  # (the same noise in every run)
        probs = torch.nn.functional.dropout(scores.softmax(-1), 0.1, training=True)
        return (probs @ v).sum()

    want = _grads(f, [scores, v])
    sc = relu_ext.save_compact()
    got = _grads(f, [scores, v], sc)
    assert sc.remade == 1 and sc.two_valued == 1, sc.report()
    _assert_same(got, want)


def test_not_remade_where_an_input_is_kept_by_no_node():
    """(x + 1) * y where only x requires grad: the node keeps y alone and no node keeps x + 1: kept as it is."""
    x, y = torch.randn(64, 128, requires_grad=True), torch.randn(64, 128)
    c = torch.randn(64, 128, requires_grad=True)
    with relu_ext.save_compact() as sc:
        loss = (((x + 1) * y) * c).sum()
    assert sc.remade == 0 and sc.kept_by_reason["not_activation"] >= 1, sc.report()
    loss.backward()


def test_a_miss_keeps_the_tensor():
    """A form whose check fails (here: an op that gives other bits) keeps the tensor as it is."""
    x, y = torch.randn(64, 128, requires_grad=True), torch.randn(64, 128, requires_grad=True)
    c = torch.randn(64, 128, requires_grad=True)
    real = graph._REMAKE["MulBackward0"]
    graph._REMAKE["MulBackward0"] = real._replace(op=lambda a, b: torch.mul(a, b) + 1)
    try:
        with relu_ext.save_compact() as sc:
            loss = ((x * y) * c).sum()
    finally:
        graph._REMAKE["MulBackward0"] = real
    assert sc.remade == 0 and sc.kept_by_reason["not_activation"] >= 2, sc.report()
    got = torch.autograd.grad(loss, [x, y, c])
    want = torch.autograd.grad(((x * y) * c).sum(), [x, y, c])
    _assert_same(got, want)


def test_backward_under_autocast_remakes_as_the_forward_did():
    """A forward under bfloat16 autocast and a backward under autocast too (float32 LayerNorm outputs,
    which autocast would run in another dtype): remade as the forward's nodes recorded them, gradients
    PyTorch's."""
    torch.manual_seed(0)
    norm, lin = torch.nn.LayerNorm(256), torch.nn.Linear(256, 64)
    x = torch.randn(4, 32, 256, requires_grad=True)
    params = [x, norm.weight, lin.weight]

    def step(ctx: Any) -> tuple:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with ctx:
                h = torch.nn.functional.gelu(norm(x)) * norm.weight
                loss = lin(h).float().sum()
            return (loss.detach(), *torch.autograd.grad(loss, params))

    import contextlib

    want = step(contextlib.nullcontext())
    sc = relu_ext.save_compact()
    got = step(sc)
    assert sc.remade >= 2, sc.report()
    _assert_same(got, want)


def test_the_report_names_each_remade_op_with_its_bytes_and_misses():
    """report() lists the remade tensors by op, with their bytes, and the checks that failed by op."""
    torch.manual_seed(0)
    lin, norm, w = torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Parameter(torch.rand(256))
    x = torch.randn(32, 256, requires_grad=True)

    def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mul(a, b) + 1  # (its check fails)

    real = graph._REMAKE["MulBackward0"]
    graph._REMAKE["MulBackward0"] = real._replace(op=mul)
    try:
        with relu_ext.save_compact() as sc:
            loss = lin(torch.nn.functional.gelu(norm(x) * w)).sum()
    finally:
        graph._REMAKE["MulBackward0"] = real
    line = next(line for line in sc.report().splitlines() if line.strip().startswith("remade:"))
    assert sc.remade == 2 and line.endswith("by op: layer_norm 1 (32.00 KiB), gelu 1 (32.00 KiB), mul 0 (0 B, 1 missed)")
    loss.backward()


@pytest.mark.parametrize("when", ["source", "output"])
def test_changed_in_place_after_the_forward_raises_pytorchs_error(when):
    """A source or the output changed in place after the forward: backward raises PyTorch's in-place
    error, as it does without hooks, from the rebuild (before the remade tensor's own node would)."""
    x, y = torch.randn(64, 128, requires_grad=True), torch.randn(64, 128, requires_grad=True)
    c = torch.randn(64, 128, requires_grad=True)
    with relu_ext.save_compact() as sc:
        a = x.cumsum(-1)  # (a non-leaf, so it may change in place, kept as it is)
        z = a * y
        loss = (z * c).sum()
    assert sc.remade >= 1
    with torch.no_grad():
        (a if when == "source" else z).add_(1)
    where = "remakes a tensor from this one" if when == "source" else "rebuilds it for backward"
    with pytest.raises(RuntimeError, match=f"modified by an inplace operation.*{where}"):
        loss.backward()


def test_an_embedding_table_renormalized_after_the_lookup_raises_a_clear_error():
    """An embedding with max_norm looked up twice: the second lookup renormalizes the table in place
    after the first output was saved (remade from the table, which no node keeps). PyTorch's backward
    runs; save_compact()'s raises the in-place error, naming recompute=False, with which gradients are
    PyTorch's (never other values)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(100, 16, max_norm=1.0)
    ids = torch.randint(0, 100, (2, 8, 64))
    c = torch.randn(8, 64, 16, requires_grad=True)

    def f(*_: torch.Tensor) -> torch.Tensor:
        return (emb(ids[0]) * c + emb(ids[1]) * c).sum()

    before = emb.weight.detach().clone()
    want = _grads(f, [c, emb.weight])
    emb.weight.data.copy_(before)
    sc = relu_ext.save_compact()
    with sc:
        loss = f()
    assert sc.remade_by_op == {"embedding": 2}, sc.report()
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*recompute=False"):
        loss.backward()
    emb.weight.data.copy_(before)
    _assert_same(_grads(f, [c, emb.weight], relu_ext.save_compact(recompute=False)), want)


# Blocks whose remade tensors are rebuilt on another thread: how many, by op.
_BLOCKS = {"rms_norm": {"mul": 2}, "gelu": {"gelu": 1, "mul": 1},
           "gelu_new": {"mul": 3, "tanh": 1, "add": 1}, "attention": {"_softmax": 1, "_to_copy": 3}}


def _attention_block(x: torch.Tensor) -> torch.Tensor:
    """Eager attention in bfloat16 over `x` (as q, k and v: one head of 129 tokens), a causal mask."""
    h = x.to(torch.bfloat16).unsqueeze(1)
    causal = torch.full((129, 129), torch.finfo(torch.bfloat16).min, dtype=torch.bfloat16).triu(1)
    return _eager_attention(h, h, h, causal).squeeze(1).float()


@pytest.mark.parametrize("block", _BLOCKS)
def test_backward_on_another_thread_with_another_thread_count(block):
    """Backward in a thread of its own, with another OpenMP thread count than the forward's (set inside
    that thread: the count is per thread): the remade ops' bits do not depend on it (mul's do not depend
    on the split; GELU, and a chain with tanh and pow, are run again with the forward's count). Odd
    sizes: the chunks of the split end inside a vector."""
    torch.manual_seed(0)
    x = torch.randn(7, 129, 1023, requires_grad=True)  # (large enough to split among threads)
    weight = torch.nn.Parameter(torch.rand(1023))
    lin = torch.nn.Linear(1023, 8)

    def f(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = {"rms_norm": lambda: _rms_norm(x, weight), "gelu": lambda: torch.nn.functional.gelu(x * weight),
             "gelu_new": lambda: gelu_new(x * weight), "attention": lambda: _attention_block(x * weight)}[block]()
        return lin(h).sum()

    want = _grads(f, [x, weight])
    with relu_ext.save_compact() as sc:
        loss = f(x, weight)
    assert sc.remade_by_op == _BLOCKS[block], sc.report()
    got: list[Any] = []

    def run() -> None:
        torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)
        got.extend(torch.autograd.grad(loss, [x, weight]))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    _assert_same((loss.detach(), *got), want)


def _t5() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4,
        feed_forward_proj="relu", dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config), _tokens(128, 64, labels=True)


def _llama(attention: str = "sdpa") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation=attention)
    return transformers.LlamaForCausalLM(config), _tokens(128, 64, labels=True)


def _tokens(vocab: int, length: int, labels: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (2, length), generator=g)
    return {"input_ids": ids, "labels": torch.randint(1, vocab, (2, length), generator=g)} if labels else {"input_ids": ids}


def _decoder(name: str) -> Callable[[], tuple[torch.nn.Module, dict[str, torch.Tensor]]]:
    """OPT (ReLU, LayerNorm), GPT-2 (LayerNorm, its tanh GELU in Python) or BERT (LayerNorm, GELU)."""

    def make() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        transformers = pytest.importorskip("transformers")
        if name == "opt":
            config = transformers.OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, ffn_dim=256,
                                            num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64)
            return transformers.OPTForCausalLM(config), _tokens(128, 64, labels=True)
        if name == "gpt2":
            config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                             bos_token_id=1, eos_token_id=1)
            return transformers.GPT2LMHeadModel(config), _tokens(128, 64, labels=True)
        config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, intermediate_size=256,
                                         num_attention_heads=4, max_position_embeddings=64)
        return transformers.BertForMaskedLM(config), _tokens(128, 64, labels=True)

    return make


MODELS = {"t5_relu": _t5, "llama": _llama, "llama@eager": lambda: _llama("eager"), "opt": _decoder("opt"),
          "gpt2": _decoder("gpt2"), "bert": _decoder("bert")}


@pytest.mark.quick(cover=())  # a real model takes seconds: the quick tier runs one
@pytest.mark.parametrize("mode", ["float32", "autocast", "bfloat16"])
@pytest.mark.parametrize("name", MODELS)
def test_transformers_train_bit_for_bit_with_remade_ops(name, mode):
    """A training step of transformers' T5 (ReLU), Llama (RMSNorm, SwiGLU; SDPA and eager attention),
    OPT, GPT-2 and BERT, from configs with random weights, under install() + save_compact(), in float32,
    under bfloat16 autocast and held in bfloat16: the loss and every gradient PyTorch's, with ops
    remade. Held in bfloat16, T5's RMSNorms cast the residual stream that their mul keeps: those casts
    hold no copy (Widened); Llama's eager attention keeps float32 softmax outputs of bfloat16 scores:
    remade from a copy of their input (recipes._softmax_widened)."""
    import contextlib

    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.train()
    if mode == "bfloat16":
        model.to(torch.bfloat16)
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext
    relu_ext.uninstall()
    with amp():
        want = train_step(model, inputs, contextlib.nullcontext())
    sc = relu_ext.save_compact()
    with relu_ext.install(), amp():
        got = train_step(model, inputs, sc)
    assert sc.remade > 0, sc.report()
    # (The embeddings' output is remade through the embedding: OPT's and BERT's sum of embeddings, an
    # add that no other op of theirs is remade as, and Llama's embedding output itself, where its
    # RMSNorm's cast is not the chain through it.)
    if name in ("opt", "bert") or (name == "llama" and mode != "bfloat16"):
        assert sc.remade_by_op.get("embedding" if name == "llama" else "add") == 1, sc.report()
    if name == "llama@eager" and mode == "bfloat16":
        assert sc.remade_by_op.get("_softmax") == 2, sc.report()  # (one a layer)
    if name == "t5_relu" and mode == "bfloat16":  # (the copies of its RMSNorms' casts, 16 KiB each, given way)
        assert "held in 64.00 KiB" in next(line for line in sc.report().splitlines() if "remade:" in line)
    assert_same_step(got, want)
