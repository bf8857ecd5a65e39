"""Property-based fuzzing against PyTorch, torch.export, and concurrent use.

The fuzz run is fixed-seed (derandomized): 200 examples in the quick tier, and a second
run of 2,000 in the full tier; set RELU_EXT_FUZZ_EXAMPLES for a longer one.
"""

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import relu_ext
from conftest import DTYPES, adversarial, assert_bitwise_equal

pytestmark = pytest.mark.native  # the risk it checks: see tests/tiers.py

LONG_EXAMPLES = int(os.environ.get("RELU_EXT_FUZZ_EXAMPLES", "2000"))
FUZZ = dict(derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def views(draw):
    """A tensor of random dtype, rank 0-6 and shape (0-size included), values of
    every kind, seen through random permutes, strided slices, expands and a
    storage offset."""
    dtype = draw(st.sampled_from(DTYPES))
    rank = draw(st.integers(0, 6))
    shape = draw(st.lists(st.integers(0, 3 if rank > 4 else 9), min_size=rank, max_size=rank))
    offset = draw(st.integers(0, 3))
    n = math.prod(shape)
    x = adversarial(n + offset, dtype, seed=draw(st.integers(0, 2**31 - 1)))[offset:].view(shape)
    if rank >= 2 and draw(st.booleans()):
        x = x.permute(draw(st.permutations(range(rank))))
    if rank >= 1 and draw(st.booleans()):
        index = [slice(None)] * rank
        index[draw(st.integers(0, rank - 1))] = slice(draw(st.integers(0, 2)), None, draw(st.integers(1, 3)))
        x = x[tuple(index)]
    if rank >= 1 and draw(st.booleans()):
        d = draw(st.integers(0, rank - 1))
        if x.shape[d] >= 1:
            x = x.narrow(d, 0, 1).expand(*x.shape[:d], draw(st.integers(0, 4)), *x.shape[d + 1:])
    return x, draw(st.booleans())


def _twin(v: torch.Tensor) -> torch.Tensor:
    """The same view (sizes, strides, offset) over a private copy of v's storage;
    clone() would instead make a fresh, non-overlapping tensor."""
    t = torch.empty(0, dtype=v.dtype, device=v.device)
    return t.set_(v.detach().untyped_storage().clone(), v.storage_offset(), v.size(), v.stride())


@settings(max_examples=200, **FUZZ)
@given(views())
def test_fuzz_against_pytorch(case):
    _fuzz(case)


@pytest.mark.full
@settings(max_examples=LONG_EXAMPLES, **FUZZ)
@given(views())
def test_fuzz_against_pytorch_long(case):
    _fuzz(case)


def _fuzz(case: "tuple[torch.Tensor, bool]") -> None:
    """relu_ext.relu and its gradient match PyTorch's on one drawn view, in place or not."""
    x, inplace = case
    want = torch.relu(x)
    assert_bitwise_equal(relu_ext.relu(x), want, "forward")

    g = adversarial(max(x.numel(), 1), x.dtype, seed=x.numel())[: x.numel()].view(x.shape)
    a = x.detach().clone().requires_grad_()
    b = x.detach().clone().requires_grad_()
    if inplace:
        relu_ext.relu(a * 1, inplace=True).backward(g)
        torch.relu_(b * 1).backward(g)
    else:
        relu_ext.relu(a).backward(g)
        torch.relu(b).backward(g)
    assert_bitwise_equal(a.grad, b.grad, "gradient")

    if inplace and not x.is_contiguous():
        # In place on the (possibly self-overlapping) view itself: same result or same error.
        mine, theirs = _twin(x), _twin(x)
        try:
            torch.relu_(theirs)
        except RuntimeError as e:
            expected_error = str(e).splitlines()[0]
            try:
                relu_ext.relu(mine, inplace=True)
            except RuntimeError as e2:
                assert str(e2).splitlines()[0] == expected_error
            else:
                raise AssertionError("relu_ext accepted an in-place op PyTorch refuses")
        else:
            relu_ext.relu(mine, inplace=True)
            assert_bitwise_equal(mine, theirs, "in place on the view")


@pytest.mark.torch_version
def test_torch_export():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), relu_ext.ReLU(), torch.nn.Linear(16, 4), relu_ext.ReLU())
    x = torch.randn(5, 8)
    ep = torch.export.export(model, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any(t.startswith("relu_ext.") for t in targets), targets
    assert torch.equal(ep.module()(x), model(x))
    x2 = torch.randn(5, 8)
    assert torch.equal(ep.module()(x2), model(x2))


def test_concurrent_python_threads():
    xs = [adversarial(200_003 + i, DTYPES[i % 4], seed=i) for i in range(16)]

    def work(x):
        xr = x.clone().requires_grad_()
        y = relu_ext.relu(xr)
        y.backward(torch.ones_like(y))
        return y.detach(), xr.grad

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(work, xs))
    for x, (y, grad) in zip(xs, results):
        xr = x.clone().requires_grad_()
        ref = torch.relu(xr)
        ref.backward(torch.ones_like(ref))
        assert_bitwise_equal(y, ref.detach())
        assert_bitwise_equal(grad, xr.grad)
