"""Autograd (gradcheck, double backward, what is saved, the backward node) and torch.library.opcheck on every op."""

import re

import pytest
import torch

import relu_ext
from relu_ext import _C
from conftest import DEVICES, DTYPES, adversarial, layouts

pytestmark = [pytest.mark.native, pytest.mark.torch_version]  # the risk it checks: see tests/tiers.py

ops = torch.ops.relu_ext


def _away_from_kink(shape, device, seed=0):
    # gradcheck's finite differences need |x| > eps at every point.
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return (x + x.sign() * 0.1).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True])
def test_gradcheck_and_gradgradcheck(device, inplace):
    x = _away_from_kink((7, 13), device).requires_grad_()
    fn = (lambda t: relu_ext.relu(t * 1, inplace=True)) if inplace else relu_ext.relu
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("device", DEVICES)
def test_double_backward_matches_pytorch(device):
    """A gradient penalty (WGAN-GP style) differentiates through the ReLU backward."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16).to(device).double()

    def penalty(act):
        torch.manual_seed(1)
        x = torch.randn(8, 16, device=device, dtype=torch.float64).requires_grad_()
        (gx,) = torch.autograd.grad(act(lin(x)).sum(), x, create_graph=True)
        lin.zero_grad()
        gx.square().sum().backward()
        return lin.weight.grad.clone()

    assert torch.equal(penalty(relu_ext.relu), penalty(torch.relu))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_only_the_mask_is_saved(dtype):
    """Backward keeps ceil(n/8) bytes (plus nothing else) instead of the n-element output."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(1000, 37, dtype=dtype, requires_grad=True)
    for inplace in (False, True):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = relu_ext.relu(x * 1, inplace=inplace)
        relu_saved = [t for t in saved if t.dtype == torch.uint8]
        assert len(relu_saved) == 1 and relu_saved[0].numel() == (x.numel() + 7) // 8
        assert all(t.dtype == torch.uint8 for t in saved if t.numel() == x.numel()), "output or input saved"
        y.sum().backward()

    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.relu(x)
    assert sum(t.numel() * t.element_size() for t in saved) == x.numel() * x.element_size()


def test_no_grad_path_writes_no_mask():
    """Under no_grad / inference the mask-free op runs (it moves fewer bytes)."""
    calls = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(100, requires_grad=True)
    with torch.no_grad(), Spy():
        relu_ext.relu(x)
        relu_ext.relu(x.clone(), inplace=True)
    assert "relu_ext.relu.default" in calls and "relu_ext.relu_.default" in calls
    assert not any("fwd" in c for c in calls)


def _no_nan(n, dtype, device, seed):
    # opcheck compares with assert_close, for which NaN != NaN; NaNs are tested bitwise elsewhere.
    x = adversarial(n, dtype, device, seed)
    return torch.where(x.isnan(), torch.ones_like(x), x)


@pytest.mark.quick(cover=("device",))  # opcheck takes 5-10 s a dtype; the dtypes' kernels have their own tests
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_functional_ops(device, dtype):
    for name, x in layouts(_no_nan(4097, dtype, device, seed=1)).items():
        torch.library.opcheck(ops.relu.default, (x,))
        for requires_grad in (False, True):
            torch.library.opcheck(ops.relu_fwd.default, (x.detach().clone().requires_grad_(requires_grad),))
        y, mask = ops.relu_fwd(x)
        g = _no_nan(x.numel(), dtype, device, seed=2).view(x.shape)
        g = torch.empty_like(y).copy_(g)  # the raw op expects grad laid out like y
        torch.library.opcheck(ops.relu_bwd.default, (g, mask))
        torch.library.opcheck(ops.relu_bwd.default, (g.requires_grad_(), mask))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck_inplace_ops(device, dtype):
    for name, x in layouts(_no_nan(4097, dtype, device, seed=1)).items():
        torch.library.opcheck(ops.relu_.default, (x.clone(),))
        torch.library.opcheck(ops.relu_fwd_.default, (x.clone(),))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8], ids=str)
def test_opcheck_integer_ops(device, dtype):
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (4097,), dtype=dtype, generator=torch.Generator().manual_seed(0)).to(device)
    for name, v in layouts(x).items():
        torch.library.opcheck(ops.relu.default, (v,))
        torch.library.opcheck(ops.relu_.default, (v.clone(),))


def test_every_op_has_an_autograd_kernel():
    """No op of the library is silently non-differentiable: each has relu_ext's
    own autograd kernel (activations/family.cpp, compact/autograd.cpp for the
    save_compact ops), not a fallthrough or PyTorch's not-implemented fallback."""
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("relu_ext::")]
    assert len(names) == 5 * len(_C.install_targets()) + 10, names  # 5 ops per activation; compaction (7), replay (3)
    for name in names:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"), name
        table = torch._C._dispatch_dump_table(name)
        for key in ("AutogradCPU", "AutogradCUDA", "AutogradMeta"):
            line = next(line for line in table.splitlines() if line.startswith(key + ":"))
            assert re.search(r"csrc/(activations/family|compact/autograd)\.cpp", line), (name, line)


@pytest.mark.parametrize("device", DEVICES)
def test_training_pieces_are_differentiable(device):
    """Called directly, relu_fwd / relu_fwd_ differentiate through y (the
    mask is not differentiable) and relu_bwd through grad: gradcheck and
    gradgradcheck, and the same gradients as relu."""
    x = _away_from_kink((7, 13), device).requires_grad_()
    g = _away_from_kink((7, 13), device, seed=1).requires_grad_()
    mask = ops.relu_fwd(x.detach())[1]
    assert torch.autograd.gradcheck(lambda t: ops.relu_fwd(t)[0], (x,))

    def fwd_inplace(t):
        u = t * 1
        ops.relu_fwd_(u)
        return u

    assert torch.autograd.gradcheck(fwd_inplace, (x,))
    assert torch.autograd.gradcheck(lambda grad: ops.relu_bwd(grad, mask), (g,))
    assert torch.autograd.gradgradcheck(lambda t: ops.relu_fwd(t)[0], (x,))
    y, m = ops.relu_fwd(x)
    assert y.requires_grad and not m.requires_grad and m.grad_fn is None
    z = x * 1
    ops.relu_fwd_(z)
    (gx,) = torch.autograd.grad(z, x, g.detach())
    assert torch.equal(gx, torch.autograd.grad(torch.relu(x), x, g.detach())[0])


def test_backward_node_is_like_relu_backward():
    """grad_fn: a readable name, callable by hand (a scalar gradient is
    broadcast, as ReluBackward0 does), next_functions as usual, the mask
    readable, and released after backward."""
    x = torch.randn(50, requires_grad=True)
    a = x * 2
    y, ref = relu_ext.relu(a), torch.relu(a)
    node = y.grad_fn
    assert type(node).__name__ == node.name() == "ReluExtBackward0"
    assert "ReluExtBackward0" in repr(y)
    assert node.next_functions == ref.grad_fn.next_functions and node.next_functions[0][0].name() == "MulBackward0"
    assert torch.equal(node(torch.tensor(1.0)), ref.grad_fn(torch.tensor(1.0)))
    g = torch.randn(50)
    assert torch.equal(node(g), ref.grad_fn(g))
    assert torch.equal(node._saved_mask, ops.relu_fwd(a.detach())[1])
    y.sum().backward(retain_graph=True)  # the mask stays
    y.sum().backward()
    assert torch.equal(x.grad, 2 * 2 * (a > 0).float())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        node._saved_mask
    inplace = relu_ext.relu(x * 1, inplace=True)
    assert inplace.grad_fn.name() == "ReluExtBackward0"


def test_inplace_on_a_view_rebases_history():
    """In place on a view of a non-leaf: the base's gradient goes through the
    node (CopySlices), as for torch.relu_."""
    grads = []
    for act in (torch.relu_, lambda t: relu_ext.relu(t, inplace=True)):
        x = torch.randn(6, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))
        base = x * 1
        act(base[:, ::2])
        base.sin().sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def test_inference_mode():
    """Inference tensors skip autograd and version counting altogether."""
    with torch.inference_mode():
        x = torch.randn(1000)
        y = relu_ext.relu(x)
        z = x.clone()
        relu_ext.relu(z, inplace=True)
    assert torch.equal(y, torch.relu(x)) and torch.equal(z, y) and y.is_inference()


def test_meta_device():
    """Models built on the meta device (shape inference) go through the fake kernels."""
    x = torch.empty(4, 5, device="meta")
    assert relu_ext.relu(x).shape == (4, 5)
    y, mask = ops.relu_fwd(x)
    assert y.device.type == "meta" and mask.shape == (3,) and mask.dtype == torch.uint8
