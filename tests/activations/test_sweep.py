"""A standing sweep: one training step of a dozen real architectures (torchvision's, and timm's
where it is installed), in float32 and bfloat16 (autocast), contiguous and channels-last, under
install() and under install() + save_compact(): every loss, gradient and buffer bitwise PyTorch's."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest
import torch

import relu_ext
from conftest import assert_bitwise_equal, assert_same_step, train_step


def _torchvision(name: str, **kwargs: object) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(pytest.importorskip("torchvision").models, name)(weights=None, **kwargs)


def _timm(name: str) -> Callable[[], torch.nn.Module]:
    return lambda: pytest.importorskip("timm").create_model(name, pretrained=False)


ARCHS: dict[str, Callable[[], torch.nn.Module]] = {
    "resnet18": _torchvision("resnet18"),
    "mobilenet_v2": _torchvision("mobilenet_v2"),  # ReLU6
    "mobilenet_v3_small": _torchvision("mobilenet_v3_small"),  # ReLU, Hardsigmoid in its SE blocks
    "densenet121": _torchvision("densenet121"),
    "googlenet": _torchvision("googlenet", aux_logits=False, init_weights=True),
    "squeezenet1_1": _torchvision("squeezenet1_1"),
    "shufflenet_v2_x0_5": _torchvision("shufflenet_v2_x0_5"),
    "regnet_x_400mf": _torchvision("regnet_x_400mf"),
    "timm/mobilenetv2_035": _timm("mobilenetv2_035"),
    "timm/efficientnet_lite0": _timm("efficientnet_lite0"),  # ReLU6
    "timm/lcnet_035": _timm("lcnet_035"),  # Hardsigmoid
    "timm/ghostnet_050": _timm("ghostnet_050"),
    "timm/rexnet_100": _timm("rexnet_100"),
}


@pytest.fixture
def _pytorch_kernels_around():
    relu_ext.uninstall()
    yield
    relu_ext.uninstall()


@contextlib.contextmanager
def _forward(dtype: torch.dtype, compact: bool) -> Iterator[None]:
    """What the forward runs under: autocast for bfloat16, as people train; save_compact() or not."""
    with contextlib.ExitStack() as stack:
        if dtype == torch.bfloat16:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        if compact:
            stack.enter_context(relu_ext.save_compact())
        yield


def _step(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype, compact: bool) -> tuple:
    """train_step's loss and gradients, and the buffers (BatchNorm's statistics) the step updated."""
    return train_step(model, x, _forward(dtype, compact)), [b.clone() for b in model.buffers()]


# The quick tier: each dtype and layout; --rest (CI): each architecture too; --full: every combination.
@pytest.mark.quick(cover=("dtype", "layout"), rest=("arch", "dtype", "layout"))
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_training_step_is_pytorchs(arch, dtype, layout, _pytorch_kernels_around):
    torch.manual_seed(0)
    model = ARCHS[arch]().train()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = _step(model, x, dtype, compact=False)
    for compact in (False, True):
        model.load_state_dict(state)
        with relu_ext.install():
            got = _step(model, x, dtype, compact)
        what = "install() + save_compact()" if compact else "install()"
        try:
            assert_same_step(got[0], ref[0])
            for i, (a, b) in enumerate(zip(got[1], ref[1])):
                if b.is_floating_point():
                    assert_bitwise_equal(a, b, f"buffer {i}")
                else:
                    assert torch.equal(a, b), f"buffer {i}"
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
