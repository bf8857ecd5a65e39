"""Autograd (gradcheck, double backward, what is saved) and torch.library.opcheck on every op."""

import pytest
import torch

import relu_ext
from conftest import DEVICES, DTYPES, adversarial, layouts

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


def test_raw_inference_ops_refuse_a_gradient():
    """The mask-free ops have no backward: asking for one is an error, not a silent zero."""
    x = torch.randn(10, requires_grad=True)
    with pytest.raises(RuntimeError, match="writes no mask and has no backward"):
        ops.relu(x)
    with pytest.raises(RuntimeError, match="writes no mask and has no backward"):
        ops.relu_(x * 1)
    with torch.no_grad():
        assert torch.equal(ops.relu(x), torch.relu(x))


def test_meta_device():
    """Models built on the meta device (shape inference) go through the fake kernels."""
    x = torch.empty(4, 5, device="meta")
    assert relu_ext.relu(x).shape == (4, 5)
    y, mask = ops.relu_fwd(x)
    assert y.device.type == "meta" and mask.shape == (3,) and mask.dtype == torch.uint8
