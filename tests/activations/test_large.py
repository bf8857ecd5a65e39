"""A CPU tensor of more than 2^31 elements: 32-bit index arithmetic anywhere
(element offsets, mask byte offsets, per-thread ranges) would wrap here.

The input repeats a block of P adversarial values, with P prime to 2^32, so an
index that wrapped would read or write a different value of the period and
break the periodicity the test checks, for the output, the mask (through the
backward) and the in-place path.
"""

import pytest
import torch

import relu_ext
from conftest import adversarial, assert_bitwise_equal

P = 1_000_003
N = 2**31 + 77  # past 2^31 and not a multiple of 8 or 64: the tail paths run
NEED_GB = 12  # peak 9.2 GB measured: x, y, the mask, then grad_in (4.3 GB each in bf16)


def _available_gb() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] / 2**20


def _assert_periodic(big: torch.Tensor, period: torch.Tensor, what: str) -> None:
    """big[i] has the bits of period[i % P] for every i."""
    b, p = big.view(torch.int16), period.view(torch.int16)
    for start in range(0, big.numel(), P):
        chunk = b[start : start + P]
        if not torch.equal(chunk, p[: chunk.numel()]):
            bad = (chunk != p[: chunk.numel()]).nonzero()[0].item()
            raise AssertionError(f"{what}: element {start + bad} differs from element {bad} of the period")


@pytest.mark.full
@pytest.mark.native
@pytest.mark.skipif(_available_gb() < NEED_GB, reason=f"needs {NEED_GB} GB of free memory")
def test_more_than_2_to_the_31_elements_cpu():
    base = adversarial(P, torch.bfloat16, seed=31)
    y_ref, mask_ref = torch.ops.relu_ext.relu_fwd(base)
    assert_bitwise_equal(y_ref, torch.relu(base), "small forward")
    g_ref = torch.ops.relu_ext.relu_bwd(base, mask_ref)
    assert_bitwise_equal(g_ref, torch.ops.aten.threshold_backward(base, torch.relu(base), 0), "small backward")

    x = base.repeat(N // P + 1)[:N]
    assert x.is_contiguous() and x.numel() > 2**31
    y, mask = torch.ops.relu_ext.relu_fwd(x)
    assert mask.numel() == (N + 7) // 8
    _assert_periodic(y, y_ref, "forward")
    del y
    grad_in = torch.ops.relu_ext.relu_bwd(x, mask)  # x as the incoming gradient: also periodic
    _assert_periodic(grad_in, g_ref, "backward")
    del grad_in, mask
    relu_ext.relu(x, inplace=True)
    _assert_periodic(x, y_ref, "in-place forward")
