"""relu_ext under every PyTorch transform, compared with torch.relu bit for bit.

torch.func (grad, vjp, jacrev, jacfwd, hessian, jvp, vmap and their nestings,
functional_call), forward-mode AD with dual tensors, compiled autograd, and what
__torch_function__ subclasses and modes see. Export, TorchScript and ONNX are
in test_export.py.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import relu_ext
from cases import BY_ID, FUNC_CASES, ONE_PER_OP, REPRESENTATIVES, Case, run_case, with_edges
from conftest import DEVICES, adversarial, assert_bitwise_equal

pytestmark = [pytest.mark.native, pytest.mark.torch_version]  # the risk it checks: see tests/tiers.py


def _inputs(device: str, shape=(6, 5), seed: int = 0) -> torch.Tensor:
    """float64 values of every kind (NaN, ±0, ±inf, denormals), but never
    only zeros: the transforms must see the mask at work."""
    x = adversarial(shape[0] * shape[1], torch.float64, device, seed).view(shape)
    assert (x > 0).any() and (x < 0).any() and x.isnan().any()
    return x


def _tangent(x: torch.Tensor, seed: int = 1) -> torch.Tensor:
    return adversarial(x.numel(), x.dtype, x.device.type, seed).view(x.shape)


def _act(impl: str, inplace: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """ReLU of the implementation; in place on a fresh non-leaf (as inside a model)."""
    if impl == "torch":
        return (lambda t: torch.relu_(t * 1)) if inplace else torch.relu
    return (lambda t: relu_ext.relu(t * 1, inplace=True)) if inplace else relu_ext.relu


def _assert_same(actual, expected, what: str) -> None:
    """Bit for bit and, for every tensor, in PyTorch's strides."""
    if isinstance(expected, torch.Tensor):
        assert_bitwise_equal(actual, expected, what)
        assert actual.numel() <= 1 or actual.stride() == expected.stride(), \
            f"{what}: strides {actual.stride()} != {expected.stride()}"
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), what
        for k in expected:
            _assert_same(actual[k], expected[k], f"{what}[{k}]")
    else:
        assert len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{what}[{i}]")


def _scalar_fn(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    # The product keeps the second derivative non-trivial (hessian) and makes
    # the gradient depend on both the mask and the input.
    return lambda t: (act(t) * t.sin()).sum()


TRANSFORMS: dict[str, Callable[[Callable, torch.Tensor], object]] = {
    "grad": lambda act, x: grad(_scalar_fn(act))(x),
    "vjp": lambda act, x: vjp(act, x)[1](_tangent(x)),
    "jacrev": lambda act, x: jacrev(act)(x[0]),
    "jacfwd": lambda act, x: jacfwd(act)(x[0]),
    "hessian": lambda act, x: hessian(_scalar_fn(act))(x[0]),
    "jvp": lambda act, x: jvp(act, (x,), (_tangent(x),)),
    "vmap": lambda act, x: vmap(act)(x),
    "vmap_in_dim_1": lambda act, x: vmap(act, in_dims=1)(x),
    "vmap_of_vmap": lambda act, x: vmap(vmap(act))(x.view(2, 3, 5)),
    "vmap_of_grad": lambda act, x: vmap(grad(_scalar_fn(act)))(x),
    "vmap_of_vjp": lambda act, x: vmap(lambda t, g: vjp(act, t)[1](g))(x, _tangent(x)),
    "grad_of_grad": lambda act, x: grad(lambda t: grad(_scalar_fn(act))(t).sum())(x),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_torch_func_matches_pytorch(device, inplace, transform):
    x = _inputs(device)
    got = TRANSFORMS[transform](_act("relu_ext", inplace), x)
    want = TRANSFORMS[transform](_act("torch", inplace), x)
    _assert_same(got, want, transform)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_vmap_of_a_grad_requiring_input(device, inplace):
    """vmap with autograd outside it: the batch rule runs on tensors that require grad."""
    results = {}
    for impl in ("torch", "relu_ext"):
        x = _inputs(device).requires_grad_()
        y = vmap(_act(impl, inplace))(x)
        (gx,) = torch.autograd.grad((y * _tangent(x)).sum(), x)
        results[impl] = (y.detach(), gx)
    _assert_same(results["relu_ext"], results["torch"], "vmap with autograd outside")


def _batch_layouts(base: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    """Batches of 4-D `base` (4, 3, 5, 6) with their batch dimension (in_dims): channels_last samples,
    a batch dimension in the middle, a non-dense view, the batch dimension innermost, a permutation."""
    return {"channels_last": (base.contiguous(memory_format=torch.channels_last), 0), "bdim_2": (base, 2),
            "strided": (base[:, :, ::2], 1), "innermost": (base.reshape(4, 90).t(), 0),
            "permuted": (base.permute(2, 0, 3, 1), 1)}


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_sample_layouts_and_empty_batch(device):
    """Per-sample masks whatever the batch layout (_batch_layouts), and an empty batch."""
    base = adversarial(4 * 3 * 5 * 6, torch.float32, device, seed=3).view(4, 3, 5, 6)
    cases = {**_batch_layouts(base), "empty": (base[:0], 0)}
    for name, (x, d) in cases.items():
        # In place on t * 1 against torch on t * 1: on a GPU the product quiets NaN payloads.
        for act, ref in ((relu_ext.relu, torch.relu),
                         (lambda t: relu_ext.relu(t * 1, inplace=True), lambda t: torch.relu_(t * 1))):
            _assert_same(vmap(act, in_dims=d)(x), vmap(ref, in_dims=d)(x), f"vmap {name}")
        f_ext, f_ref = _scalar_fn(relu_ext.relu), _scalar_fn(torch.relu)
        _assert_same(vmap(grad(f_ext), in_dims=d)(x), vmap(grad(f_ref), in_dims=d)(x), f"vmap(grad) {name}")


# The quick tier runs relu; --rest every other op (its rules are one function over the table).
@pytest.mark.quick(cover=())
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FUNC_CASES)
def test_vmap_layouts_of_every_op(device, case):
    """Each op's vmap rules lay out a batch as PyTorch's batch rules do, strides included: the
    output where the batch dimension was, grad_in over grad and the tensor the backward reads
    (transposed, channels_last, a batch dimension in the middle or innermost, a non-dense view;
    vmap of grad and of vjp, and jacrev, whose gradients are batched and the mask is not)."""
    c = BY_ID[case]
    base = with_edges(torch.randn(360, dtype=torch.float64, generator=torch.Generator().manual_seed(2)),
                      c.args).view(4, 3, 5, 6).to(device)
    layouts = _batch_layouts(base)
    refused = c.op == "leaky_relu" and c.args[0] < 0  # (both refuse the in-place form's backward: test_family)
    for inplace in (False,) if refused else (False, True):
        results = {}
        for impl in ("relu_ext", "torch"):
            f = lambda t, impl=impl: run_case(c, impl, t * 1 if inplace else t, inplace)  # noqa: E731
            scalar = lambda t, f=f: (f(t) * t.sin()).sum()  # noqa: E731
            results[impl] = [vmap(f, in_dims=d)(x) for x, d in layouts.values()]
            results[impl] += [vmap(grad(scalar), in_dims=d)(x) for x, d in layouts.values()]
            results[impl] += [vmap(lambda t, f=f: vjp(f, t)[1](t.cos())[0], in_dims=d)(x) for x, d in layouts.values()]
            results[impl].append(jacrev(f)(layouts["channels_last"][0][0]))
        _assert_same(results["relu_ext"], results["torch"], f"{case} inplace={inplace}")


# (Not hardsigmoid: PyTorch has no forward derivative for hardsigmoid_backward, it raises; relu_ext gives one.
# The quick tier runs relu; --rest every other op.)
@pytest.mark.quick(cover=())
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [c for c in FUNC_CASES if BY_ID[c].op != "hardsigmoid"])
def test_forward_over_reverse_keeps_pytorchs_signed_zeros(device, case):
    """jvp of a gradient and torch.func.hessian (forward over reverse): grad_in's tangent is grad's
    tangent through the mask, and for threshold_backward's ops (relu, threshold) PyTorch's formula adds
    zeros to it, so that a -0.0 comes out +0.0. Finite inputs with values at the thresholds (at a NaN
    PyTorch's hardtanh formula drops the tangent, which a mask bit cannot tell: docs/design.md)."""
    c = BY_ID[case]
    x = with_edges(torch.randn(40, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 4,
                   c.args).to(device)
    v = torch.randn(40, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).to(device)
    v[::3] = 0.0  # (cos(t) * 0 is -0.0 where cos(t) < 0)
    assert ((x[:12] > 1) & (x[:12].cos() < 0)).any() and ((x > 1) & (x.cos() < 0) & (v == 0)).any()
    results = {}
    for impl in ("relu_ext", "torch"):
        # cos(t) < 0 at some kept elements: the tangent there is -0.0 off the diagonal.
        scalar = lambda t, impl=impl: (run_case(c, impl, t) * t.sin()).sum()  # noqa: E731
        results[impl] = [jvp(grad(scalar), (x,), (v,))[1], hessian(scalar)(x[:12])]
    _assert_same(results["relu_ext"], results["torch"], case)


@pytest.mark.parametrize("device", DEVICES)
def test_per_sample_gradients_with_functional_call(device):
    """The torch.func recipe for per-sample gradients, with the ReLUs swapped."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(device).double()
    ours = torch.nn.Sequential(ref[0], relu_ext.ReLU(), ref[2])
    params = {k: v.detach() for k, v in ref.named_parameters()}
    x = _inputs(device).nan_to_num(0.0, 1.0, -1.0)  # finite: a NaN would spread to every weight

    def loss(model):
        return lambda p, sample: functional_call(model, p, (sample.unsqueeze(0),)).square().sum()

    _assert_same(grad(loss(ours))(params, x[0]), grad(loss(ref))(params, x[0]), "functional_call grad")
    _assert_same(
        vmap(grad(loss(ours)), in_dims=(None, 0))(params, x),
        vmap(grad(loss(ref)), in_dims=(None, 0))(params, x),
        "per-sample gradients",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_forward_ad_dual_tensors(device, dtype):
    """The tangent is masked as PyTorch masks it: out of place, in place, on a
    view of a dual tensor, and with a channels_last primal."""
    x = adversarial(4 * 3 * 2 * 5, dtype, device, seed=5).view(4, 3, 2, 5)
    t = adversarial(x.numel(), dtype, device, seed=6).view(x.shape)

    def run(impl: str) -> list[torch.Tensor]:
        act = _act(impl, False)
        act_ = torch.relu_ if impl == "torch" else (lambda v: relu_ext.relu(v, inplace=True))
        out = []
        with fwAD.dual_level():
            for primal in (x, x.contiguous(memory_format=torch.channels_last)):
                out.append(fwAD.unpack_dual(act(fwAD.make_dual(primal, t))).tangent)
            d = fwAD.make_dual(x.clone(), t.clone())
            act_(d)
            out.append(fwAD.unpack_dual(d).tangent)
            base = fwAD.make_dual(x.clone(), t.clone())
            act_(base[1:, :, ::2])  # in place on a view: the base's tangent changes too
            out.append(fwAD.unpack_dual(base).tangent)
        return out

    _assert_same(run("relu_ext"), run("torch"), "tangents")


# (torch.nn class, relu_ext class, arguments, relu_ext's node): ReLU and the family, one per op of the table.
COMPILED_AUTOGRAD_CASES = {c.name: (c.module, c.ours_module, c.module_args, c.node) for c in ONE_PER_OP}


# One op in the quick tier: the node's compiled-autograd code is one template over the table's
# rows, and each case compiles for seconds; --rest runs every op.
@pytest.mark.quick(cover=())
@pytest.mark.parametrize("case", COMPILED_AUTOGRAD_CASES)
def test_compiled_autograd_traces_the_node(case):
    """Compiled autograd captures the node (its apply_with_saved puts a call
    to it into the graph, as PyTorch's own nodes do), and the gradients equal
    PyTorch's module's."""
    from torch._dynamo import compiled_autograd

    theirs, ours, args, node = COMPILED_AUTOGRAD_CASES[case]
    seen: list[set[str]] = []

    def compiler(gm: torch.fx.GraphModule):
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return torch.compile(gm, backend="eager")

    grads = {}
    for act in (theirs, ours):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), act(*args), torch.nn.Linear(16, 8),
                                    act(*args, inplace=True), torch.nn.Linear(8, 1))
        torch._dynamo.reset()
        with compiled_autograd._enable(compiler):
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
        grads[act] = [p.grad for p in model.parameters()]
    assert any(f"torch._dynamo.compiled_autograd.ops.{node}" in ops for ops in seen), seen
    _assert_same(grads[ours], grads[theirs], "compiled autograd gradients")


class _Logged(torch.Tensor):
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


# (op name, relu_ext function, PyTorch's): the functions take a C++ path for
# plain tensors in eager mode, which subclasses and modes must not bypass.
def _function(c: Case) -> tuple[str, Callable, Callable]:
    return (c.op, lambda t, inplace=False: run_case(c, "relu_ext", t, inplace), lambda t: run_case(c, "torch", t))


# One per public function of the table.
_FUNCTIONS = [_function(c) for c in REPRESENTATIVES]


@pytest.mark.parametrize("name,fn,theirs", _FUNCTIONS, ids=[c.name for c in REPRESENTATIVES])
def test_subclasses_and_modes_see_the_op(name, fn, theirs):
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    op, op_ = getattr(torch.ops.relu_ext, name), getattr(torch.ops.relu_ext, name + "_")
    x = torch.randn(10)
    _Logged.seen.clear()
    y = fn(x.as_subclass(_Logged))
    assert type(y) is _Logged and torch.equal(y.as_subclass(torch.Tensor), theirs(x))
    assert op in _Logged.seen

    class FunctionLog(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    class DispatchLog(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    with FunctionLog() as fmode, DispatchLog() as dmode:
        assert torch.equal(fn(x), theirs(x))
        z = x.clone()
        assert fn(z, inplace=True) is z and torch.equal(z, theirs(x))
    assert op in fmode.seen and op_ in fmode.seen
    assert op.default in dmode.seen and op_.default in dmode.seen
    # Without a mode the same calls go through C++ (relu_ext._C), with the same results.
    z = x.clone()
    assert torch.equal(fn(x), theirs(x)) and fn(z, inplace=1) is z and torch.equal(z, theirs(x))
