"""A numpy reference, written as a user would: forward, bit-packed mask, backward from the mask."""

import numpy as np
import pytest
import torch

import relu_ext
from conftest import DTYPES, adversarial, assert_bitwise_equal

pytestmark = pytest.mark.native  # the risk it checks: see tests/tiers.py

ops = torch.ops.relu_ext


def np_relu_forward(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.where(x < 0, np.zeros_like(x), x)  # NaN and -0.0 pass through unchanged
    keep = ~(y <= 0)  # PyTorch's backward test, so NaN keeps its gradient
    return y, np.packbits(keep.ravel(), bitorder="little")


def np_relu_backward(grad: np.ndarray, mask: np.ndarray) -> np.ndarray:
    keep = np.unpackbits(mask, count=grad.size, bitorder="little").astype(bool).reshape(grad.shape)
    return np.where(keep, grad, np.zeros_like(grad))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    # numpy has no bfloat16; float32 holds every bfloat16 value exactly.
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 63, 64, 65, 4097, 100_003])
def test_against_numpy(dtype, n):
    x = adversarial(n, dtype, seed=n)
    g = adversarial(n, dtype, seed=n + 1)
    y, mask = ops.relu_fwd(x)
    y_ref, mask_ref = np_relu_forward(to_numpy(x))
    assert mask.dtype == torch.uint8 and mask.shape == ((n + 7) // 8,)
    assert np.array_equal(mask.numpy(), mask_ref), "mask bits"
    nan = np.isnan(y_ref)
    assert np.array_equal(np.isnan(to_numpy(y)), nan)
    assert np.array_equal(to_numpy(y)[~nan].view(np.uint8), y_ref[~nan].view(np.uint8)), "forward values and zero signs"

    grad_in = ops.relu_bwd(g, mask)
    ref = np_relu_backward(to_numpy(g), mask_ref)
    assert_bitwise_equal(grad_in, torch.from_numpy(ref).to(dtype), "backward from the mask")


def test_float64_reference_on_random_data():
    x = torch.randn(10_000, dtype=torch.float64)
    y = relu_ext.relu(x)
    ref = np.maximum(x.numpy(), 0.0)
    assert np.abs(y.numpy() - ref).max() == 0.0
    assert (y > 0).sum() > 4000, "random data, not zeros"
