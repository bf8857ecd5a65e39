"""Bit-exactness against torch.relu / nn.ReLU: values, gradients, layouts, in-place."""

import pytest
import torch
import torch.nn.functional as F

import relu_ext
from conftest import DEVICES, DTYPES, SIZES, adversarial, assert_bitwise_equal, bits, layouts, minus_zero_meets_plus_zero

pytestmark = pytest.mark.native  # the risk it checks: see tests/tiers.py


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_forward_backward_bitwise(cpu_isa, device, dtype, n):
    x = adversarial(n, dtype, device, seed=n)
    for name, v in layouts(x).items():
        want = torch.relu(v)
        got = relu_ext.relu(v)
        assert_bitwise_equal(got, want, f"forward {name}")
        assert got.stride() == want.stride(), f"{name}: memory format not kept"

        g = adversarial(v.numel(), dtype, device, seed=n + 1).view(v.shape)
        a = v.detach().clone().requires_grad_()
        b = v.detach().clone().requires_grad_()
        relu_ext.relu(a).backward(g)
        torch.relu(b).backward(g)
        assert_bitwise_equal(a.grad, b.grad, f"gradient {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_bits_are_kept(device, dtype):
    """Every NaN comes out with its exact input bits (payload and sign)."""
    x = adversarial(100_003, dtype, device, seed=7)
    nan = x.isnan()
    assert nan.sum() > 100
    y = relu_ext.relu(x)
    assert torch.equal(bits(y)[nan], bits(x)[nan])
    y2, _ = torch.ops.relu_ext.relu_fwd(x)
    assert torch.equal(bits(y2)[nan], bits(x)[nan])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values(device, dtype):
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0, -3.0], dtype=dtype, device=device)
    info = torch.finfo(dtype)
    x = torch.cat([x, torch.tensor([info.tiny / 2, -info.tiny / 2, info.max, -info.max], dtype=dtype, device=device)])
    xr = x.clone().requires_grad_()
    y = relu_ext.relu(xr)
    assert_bitwise_equal(y, torch.relu(x), "forward")
    assert torch.isnan(y[0]) and y[1] == float("inf") and bits(y[2]) == 0 and bits(y[3]) == 0
    assert torch.signbit(y[4]), "relu(-0.0) is -0.0 in PyTorch"
    assert y[7] > 0 and bits(y[8]) == 0, "denormals are not flushed"
    y.backward(torch.full_like(x, -2.0))
    expected = torch.tensor([-2.0, -2.0, 0, 0, 0, -2.0, 0, -2.0, 0, -2.0, 0], dtype=dtype, device=device)
    assert_bitwise_equal(xr.grad, expected, "gradient (NaN passes, exactly 0 and -0 give 0)")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_known_cuda_difference_is_narrow(dtype):
    """The tests accept one difference from torch 2.11's CUDA relu (conftest):
    relu_ext's -0.0 against torch's +0.0, and nothing else, not even the other
    way round or a -0.0 against a value."""
    ours = torch.tensor([-0.0, -0.0, 0.0, -0.0, 1.0, -1.0, float("nan")], dtype=dtype)
    torchs = torch.tensor([0.0, -0.0, -0.0, 1.0, 0.0, 0.0, 0.0], dtype=dtype)
    assert minus_zero_meets_plus_zero(bits(ours), bits(torchs)).tolist() == [True] + [False] * 6


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1000, 100_003])
def test_denormals_as_zero_mode_changes_nothing(cpu_isa, dtype, n):
    """The float-compare CPU kernels would read denormals as zero under
    torch.set_flush_denormal(True) (MXCSR.DAZ): the result must not change."""
    x = adversarial(n, dtype, "cpu", seed=n)
    tiny = torch.finfo(dtype).tiny
    x[::7] = torch.tensor([tiny / 4, -tiny / 4], dtype=dtype).repeat((len(x[::7]) + 1) // 2)[: len(x[::7])]
    want_y, want_mask = torch.ops.relu_ext.relu_fwd(x)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no denormals-are-zero mode")
    try:
        y, mask = torch.ops.relu_ext.relu_fwd(x)
        y_nograd = relu_ext.relu(x)
    finally:
        torch.set_flush_denormal(False)
    assert_bitwise_equal(y, want_y, "forward under DAZ")
    assert_bitwise_equal(y_nograd, want_y, "no-grad forward under DAZ")
    assert torch.equal(mask, want_mask), "mask under DAZ"
    assert_bitwise_equal(want_y, torch.relu(x), "forward")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gradient_select_not_product(device, dtype):
    """A NaN or -0.0 incoming gradient at a dropped element gives +0, as PyTorch's threshold_backward."""
    x = torch.tensor([-1.0, -1.0, 0.0, 2.0, 2.0], dtype=dtype, device=device, requires_grad=True)
    g = torch.tensor([float("nan"), -0.0, float("nan"), -0.0, float("nan")], dtype=dtype, device=device)
    relu_ext.relu(x).backward(g)
    ref = x.detach().clone().requires_grad_()
    torch.relu(ref).backward(g)
    assert_bitwise_equal(x.grad, ref.grad)
    assert bits(x.grad[:3]).eq(0).all() and torch.signbit(x.grad[3]) and x.grad[4].isnan()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 33, 4097, 100_003])
def test_inplace_matches_pytorch(cpu_isa, device, dtype, n):
    base = adversarial(n, dtype, device, seed=n)
    for name in layouts(base):
        # In place on a (view of a) non-leaf, as inside a model.
        leaf_a = base.clone().requires_grad_()
        leaf_b = base.clone().requires_grad_()
        va = layouts(leaf_a * 1)[name]
        vb = layouts(leaf_b * 1)[name]
        out_a = relu_ext.relu(va, inplace=True)
        out_b = F.relu(vb, inplace=True)
        assert out_a is va
        assert_bitwise_equal(out_a, out_b, f"inplace forward {name}")
        g = adversarial(out_a.numel(), dtype, device, seed=5).view(out_a.shape)
        out_a.backward(g)
        out_b.backward(g)
        assert_bitwise_equal(leaf_a.grad, leaf_b.grad, f"inplace gradient {name}")

        # Without autograd: the inference op.
        vc = layouts(base.clone())[name]
        expected = torch.relu(vc)
        relu_ext.relu(vc, inplace=True)
        assert_bitwise_equal(vc, expected, f"inplace no-grad {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_on_noncontiguous_view_writes_through(device):
    base = torch.randn(6, 8, device=device)
    ref = base.clone()
    relu_ext.relu(base[:, ::2], inplace=True)
    F.relu(ref[:, ::2], inplace=True)
    assert torch.equal(base, ref), "strided in-place must write into the viewed storage only"


def test_inplace_bumps_version_and_guards_leaves():
    x = torch.randn(10, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        relu_ext.relu(x, inplace=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        F.relu(x, inplace=True)  # the behaviour being copied

    y = x * 2
    v0 = y._version
    relu_ext.relu(y, inplace=True)
    assert y._version > v0

    z = torch.randn(10)
    v0 = z._version
    relu_ext.relu(z, inplace=True)
    assert z._version > v0

    # A tensor saved for backward and then overwritten in place: same error as PyTorch.
    w = x * 3
    s = w.sin()
    relu_ext.relu(w, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.sum().backward()


def test_inplace_on_expanded_view_errors_like_pytorch():
    e = torch.randn(3, 1).expand(3, 4)
    with pytest.raises(RuntimeError) as theirs:
        F.relu(e, inplace=True)
    with pytest.raises(RuntimeError) as ours:
        relu_ext.relu(e, inplace=True)
    assert str(ours.value).split("\n")[0] == str(theirs.value).split("\n")[0]
    # Out of place is fine on an expanded view.
    assert torch.equal(relu_ext.relu(e), torch.relu(e))


@pytest.mark.parametrize("device", DEVICES)
def test_expanded_gradient(device):
    """`.sum().backward()` feeds an expanded (stride-0) gradient; channels_last output."""
    x = torch.randn(2, 3, 4, 5, device=device).contiguous(memory_format=torch.channels_last).requires_grad_()
    ref = x.detach().clone().requires_grad_()
    relu_ext.relu(x).sum().backward()
    torch.relu(ref).sum().backward()
    assert torch.equal(x.grad, ref.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_module_swap_in_a_convnet(device):
    """A channels_last conv net with every nn.ReLU swapped: identical outputs and parameter gradients."""
    torch.manual_seed(0)

    def net(act):
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), act(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 8, 3, padding=1), act(inplace=True), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10),
        ).to(device)

    ref = net(torch.nn.ReLU)
    ours = net(relu_ext.ReLU)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 16, 16, device=device).contiguous(memory_format=torch.channels_last)
    out_ref, out = ref(x), ours(x)
    assert torch.equal(out, out_ref)
    out_ref.square().sum().backward()
    out.square().sum().backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_threads_do_not_change_results():
    x = adversarial(1_000_003, torch.float32, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1, m1 = torch.ops.relu_ext.relu_fwd(x)
        torch.set_num_threads(max(2, before))
        y2, m2 = torch.ops.relu_ext.relu_fwd(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(y1), bits(y2)) and torch.equal(m1, m2)


INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 33, 4097, 100_003])
def test_integer_dtypes_like_torch(device, dtype, n):
    """Integers: forward and in place as torch.relu, over the whole range
    (min, max, 0 included), in every layout."""
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(n)
    x = torch.randint(info.min, info.max, (n,), dtype=torch.int64, generator=g).to(dtype)
    x[: min(n, 3)] = torch.tensor([info.min, info.max, 0], dtype=dtype)[: min(n, 3)]
    x = x.to(device)
    for name, v in layouts(x).items():
        got = relu_ext.relu(v)
        assert torch.equal(got, torch.relu(v)) and got.dtype == dtype, name
        assert got.stride() == torch.relu(v).stride(), name
        mine, theirs = v.clone(), v.clone()
        assert relu_ext.relu(mine, inplace=True) is mine
        torch.relu_(theirs)
        assert torch.equal(mine, theirs), name
