"""Drop-in to the last bit: every output, gradient and tangent in PyTorch's strides under mixed
layouts, gradients taken with create_graph=True as differentiable as PyTorch's, and channels-last
training bitwise PyTorch's, over the activation table (tests/cases.py)."""

from __future__ import annotations

import itertools
from typing import Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import relu_ext
from conftest import DEVICES, DTYPES, adversarial, assert_same_step, train_step
from cases import BY_ID, CASE_IDS, FUNC_CASES, ONE_PER_OP_IDS, assert_family_equal, grad_at_nan, run_case, with_edges

pytestmark = pytest.mark.native  # the risk it checks: see tests/tiers.py

SHAPE = (2, 3, 4, 5)

# A layout of SHAPE as a function of the data it lays out (each gives a tensor of SHAPE).
LAYOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "contiguous": lambda t: t.contiguous(),
    "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
    "transposed": lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),
    "expanded": lambda t: t[:1, :, :1].expand(SHAPE),  # zero strides
    "non_dense": lambda t: torch.cat([t, t], 3)[..., ::2],
    "permuted_slice": lambda t: t.permute(0, 2, 3, 1).contiguous()[:, :, :, :].permute(0, 3, 1, 2)[:, :, :, :],
}
# Dimensions of size 1 with strides of their own: contiguous and channels-last at once, or neither.
ODD = [((2, 3, 1, 1), (3, 1, 3, 3)), ((2, 1, 4, 4), (16, 1, 4, 1)), ((1, 3, 2, 2), (1, 1, 6, 3)), ((3, 1), (1, 5))]


def _pairs(dtype: torch.dtype, device: str, args: tuple, seed: int):
    """(name, x, g): inputs and incoming gradients in every pair of layouts, adversarial values."""
    n = torch.Size(SHAPE).numel()
    x0 = with_edges(adversarial(n, dtype, device, seed), args).view(SHAPE)
    g0 = adversarial(n, dtype, device, seed + 1).view(SHAPE)
    for (xn, xl), (gn, gl) in itertools.product(LAYOUTS.items(), repeat=2):
        yield f"x {xn}, grad {gn}", xl(x0), gl(g0)
    for (size, stride), other in itertools.product(ODD, ("contiguous", "same")):
        x = torch.empty_strided(size, stride, dtype=dtype, device=device)
        x.copy_(with_edges(adversarial(x.numel(), dtype, device, seed), args).view(size))
        g = torch.empty_strided(size, stride, dtype=dtype, device=device) if other == "same" else x.new_empty(size)
        g.copy_(adversarial(x.numel(), dtype, device, seed + 2).view(size))
        yield f"x {size} {stride}, grad {other}", x, g


def _grad_and_tangent(c: tuple, impl: str, x: torch.Tensor, g: torch.Tensor, inplace: bool):
    """The output, the gradient autograd hands the input (as it comes, not as .grad keeps it) and the
    forward-AD tangent for tangent g."""
    leaf = x.detach().clone() if inplace else x.detach()
    leaf.requires_grad_()
    y = run_case(c, impl, leaf * 1 if inplace else leaf, inplace)
    grad, = torch.autograd.grad(y, leaf, g)
    if torch._debug_has_internal_overlap(x) or torch._debug_has_internal_overlap(g):
        return y, grad, None  # make_dual refuses an overlapping primal or tangent
    with fwAD.dual_level():
        primal = x.detach().clone() if inplace else x.detach()
        dual = fwAD.make_dual(primal, g)
        tangent = fwAD.unpack_dual(run_case(c, impl, dual * 1 if inplace else dual, inplace)).tangent
    return y, grad, tangent


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASE_IDS)
def test_outputs_gradients_and_tangents_have_pytorchs_strides(case, dtype, device):
    c = BY_ID[case]
    for name, x, g in _pairs(dtype, device, c[4], seed=7):
        for inplace in (False, True):
            if inplace and (name.startswith("x expanded") or case == "leaky_negative"):
                continue  # overlapping elements: both raise; leaky_relu_ with slope < 0: test_family
            ours = _grad_and_tangent(c, "relu_ext", x, g, inplace)
            theirs = _grad_and_tangent(c, "torch", x, g, inplace)
            what = f"{name}{' in place' if inplace else ''}"
            assert_family_equal(ours[0].detach(), theirs[0].detach(), f"{what}: output", case=c)
            assert_family_equal(ours[1], theirs[1], f"{what}: gradient", x, grad_at_nan(c, g))
            if theirs[2] is not None:
                assert_family_equal(ours[2], theirs[2], f"{what}: tangent", x, grad_at_nan(c, g))


@pytest.fixture
def _pytorch_kernels_around():
    relu_ext.uninstall()
    yield
    relu_ext.uninstall()


@pytest.mark.parametrize("case", ONE_PER_OP_IDS)
def test_installed_gradients_have_pytorchs_strides(case, _pytorch_kernels_around):
    c = BY_ID[case]
    for name, x, g in _pairs(torch.float32, "cpu", c[4], seed=11):
        theirs = _grad_and_tangent(c, "torch", x, g, False)
        with relu_ext.install():
            ours = _grad_and_tangent(c, "torch", x, g, False)
            assert "Ext" in ours[0].grad_fn.name()
        for i, what in enumerate(("output", "gradient", "tangent")):
            if theirs[i] is not None:
                at_nan = grad_at_nan(c, g) if i else None
                assert_family_equal(ours[i].detach(), theirs[i].detach(), f"{name}: {what}", x, at_nan, case=c)


# --- gradients of gradients -------------------------------------------------------------------


def _second_order(c: tuple, impl: str, inplace: bool, weighted: bool) -> tuple:
    """g = d/dx sum(act(x * 1) * w) taken with create_graph=True, then sum(g * v) differentiated:
    whether g requires grad, and x.grad, w.grad (w requires grad only when `weighted`)."""
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4
    x[0] = torch.tensor([0.0, -0.0, 3.0, -3.0, 0.1, -1.0, 6.0], dtype=torch.float64)
    x.requires_grad_()
    w = torch.randn(6, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_(weighted)
    v = torch.randn(6, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y = run_case(c, impl, x * 1, inplace)
    g, = torch.autograd.grad((y * w).sum(), x, create_graph=True)
    if not g.requires_grad:
        return False, None, None
    (g * v).sum().backward()
    return True, x.grad, w.grad


@pytest.mark.parametrize("weighted", [False, True], ids=["nothing_else_requires_grad", "weighted"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("case", FUNC_CASES)
def test_gradients_of_gradients_as_pytorchs(case, inplace, weighted):
    c = BY_ID[case]
    if inplace and case == "leaky_negative":
        pytest.skip("PyTorch refuses the in-place form's backward (test_family)")
    ours = _second_order(c, "relu_ext", inplace, weighted)
    try:
        theirs = _second_order(c, "torch", inplace, weighted)
    except RuntimeError as e:
        # PyTorch has no derivative of hardsigmoid_backward; relu_ext's is exact: zero in x,
        # and in w the first derivative itself.
        assert c[3] == "hardsigmoid" and "not implemented" in str(e)
        x = torch.randn(6, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4
        assert ours[0] and torch.equal(ours[1], torch.zeros_like(x))
        return
    assert ours[0] == theirs[0], "requires_grad of the gradient"
    for got, want, what in zip(ours[1:], theirs[1:], ("x.grad", "w.grad")):
        assert (got is None) == (want is None), what
        if want is not None:
            assert_family_equal(got, want, what)


def test_the_issues_example_differentiates_again():
    for f in (relu_ext.relu, relu_ext.leaky_relu, relu_ext.hardtanh, F.relu):
        x = torch.randn(5, requires_grad=True)
        g, = torch.autograd.grad(f(x).sum(), x, create_graph=True)
        assert g.requires_grad
        g.pow(2).sum().backward()
        assert torch.equal(x.grad, torch.zeros(5)) and not x.grad.signbit().any()


def _edges(node: object) -> list[str | None]:
    return [f and f.name() for f, _ in node.next_functions]


def test_installed_gradients_of_gradients_lead_where_pytorchs_do(_pytorch_kernels_around):
    """relu's gradient depends on relu's output (its node), relu6's on its input, as PyTorch's do."""
    for f, reads in ((F.relu, "ReluBackward0"), (F.relu6, "MulBackward0")):
        x = torch.randn(5, requires_grad=True)
        theirs, = torch.autograd.grad(f(x * 2).sum(), x, create_graph=True)
        with relu_ext.install():
            ours, = torch.autograd.grad(f(x * 2).sum(), x, create_graph=True)
        below = [g.grad_fn.next_functions[0][0] for g in (ours, theirs)]  # under (x * 2)'s backward
        assert [n and n.replace("Ext", "") for n in _edges(below[0])] == _edges(below[1]) == [None, reads]
        ours.pow(2).sum().backward()
        assert torch.equal(x.grad, torch.zeros(5))


def test_first_order_training_saves_only_the_mask():
    """Differentiability of the gradient costs nothing saved: the node keeps the mask alone."""
    saved: list[torch.Tensor] = []
    x = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        for f in (relu_ext.relu, relu_ext.relu6, relu_ext.leaky_relu, relu_ext.hardsigmoid):
            f(x * 1)
    assert [t.dtype for t in saved if t.numel() > 64] == [torch.uint8] * 4


# --- channels-last training, whole models -------------------------------------------------------


def _conv_bn_act(act: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), act(),
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.nn.BatchNorm2d(8), act(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))


MODELS = {
    "conv_bn_relu6": lambda: _conv_bn_act(torch.nn.ReLU6),
    "conv_bn_hardsigmoid": lambda: _conv_bn_act(torch.nn.Hardsigmoid),
    "conv_bn_leaky": lambda: _conv_bn_act(lambda: torch.nn.LeakyReLU(0.1)),
    "mobilenet_v2": lambda: pytest.importorskip("torchvision").models.mobilenet_v2(weights=None),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["convert", "install"])
@pytest.mark.parametrize("model", list(MODELS))
def test_channels_last_training_is_bitwise(model, mode, dtype, _pytorch_kernels_around):
    torch.manual_seed(0)
    net = MODELS[model]().train().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 48, 48).contiguous(memory_format=torch.channels_last)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == torch.bfloat16 else torch.enable_grad()
    state = {k: v.clone() for k, v in net.state_dict().items()}
    ref = train_step(net, x, ctx)
    net.load_state_dict(state)
    if mode == "convert":
        relu_ext.convert(net)
        got = train_step(net, x, ctx)
    else:
        with relu_ext.install():
            got = train_step(net, x, ctx)
    assert_same_step(got, ref)
