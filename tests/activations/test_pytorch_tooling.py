"""PyTorch's tooling around activations sees relu_ext's as it sees its own: selective activation
checkpointing policies, eager-mode quantization (fusion, QAT), and what the README's "Good to
know" lists (profiler and FX names, hooks)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import relu_ext
from conftest import assert_bitwise_equal
from cases import BY_ID, ONE_PER_OP, run_case

pytestmark = pytest.mark.torch_version  # the risk it checks: see tests/tiers.py


@pytest.fixture
def _pytorch_kernels_around():
    relu_ext.uninstall()
    yield
    relu_ext.uninstall()


# --- selective activation checkpointing -----------------------------------------------------

# (case id: its aten op), one row per op of the table
SAC_CASES = {c.id: c.op for c in ONE_PER_OP}


def _sac_step(case: str, impl: str, save_activation: bool) -> tuple[list, list]:
    """One checkpointed step whose policy saves the activation's aten op (or recomputes everything):
    the (phase, op) calls the policy saw, and the gradients."""
    c = BY_ID[case]
    aten_op = getattr(torch.ops.aten, SAC_CASES[case]).default
    seen: list[tuple[bool, str]] = []

    def policy(ctx, op, *args, **kwargs):
        seen.append((ctx.is_recompute, str(op)))
        if save_activation and op == aten_op:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (run_case(c, impl, x @ w) @ w).sin().sum()  # sin keeps its input: the recomputation reruns `@`

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 8, generator=g, requires_grad=True)
    w = torch.randn(8, 8, generator=g, requires_grad=True)
    out = checkpoint(block, x, w, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    out.backward()
    return seen, [x.grad, w.grad]


@pytest.mark.parametrize("save_activation", [True, False], ids=["must_save", "recompute"])
@pytest.mark.parametrize("mode", ["functions", "install"])
@pytest.mark.parametrize("case", list(SAC_CASES))
def test_selective_checkpointing_policy_sees_pytorchs_op(case, mode, save_activation, _pytorch_kernels_around):
    seen, grads = _sac_step(case, "torch", save_activation)
    assert (False, f"aten.{SAC_CASES[case]}.default") in seen
    if mode == "install":
        with relu_ext.install():
            ours = _sac_step(case, "torch", save_activation)
    else:
        ours = _sac_step(case, "relu_ext", save_activation)
    assert ours[0] == seen, "the policy saw other ops (relu_ext's), or was asked at other times"
    for a, b in zip(ours[1], grads):
        assert_bitwise_equal(a, b)


def test_plain_checkpointing_still_keeps_the_mask(_pytorch_kernels_around):
    """Only selective checkpointing hands the op to PyTorch: a plain checkpoint's forward runs relu_ext."""
    names: list[str] = []
    x = torch.randn(8, requires_grad=True)

    def block(t: torch.Tensor) -> torch.Tensor:
        y = relu_ext.relu(t * 2)
        names.append(y.grad_fn.name())
        return y.sum()

    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # the recomputation runs block to its end
        checkpoint(block, x, use_reentrant=False).backward()
    assert names == ["ReluExtBackward0", "ReluExtBackward0"]  # forward and recomputation


# --- eager-mode quantization ----------------------------------------------------------------

tq = torch.ao.quantization


def _small_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        tq.QuantStub(), torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 1), torch.nn.ReLU6(), torch.nn.Conv2d(8, 8, 1), torch.nn.LeakyReLU(0.1),
        torch.nn.Conv2d(8, 8, 1), torch.nn.Hardsigmoid(), tq.DeQuantStub())


def _kind(m: torch.nn.Module) -> str:
    """A module's class, relu_ext's named as their torch.nn twins (quantization's own by their module)."""
    cls = type(m)
    return f"{cls.__module__}.{cls.__name__}" if cls.__module__.startswith("torch.ao") else cls.__name__


def _quantized(net: torch.nn.Module, qat: bool, x: torch.Tensor) -> tuple[list[str], list, torch.Tensor]:
    """Fuse (conv, bn, relu), prepare (QAT: two training steps; else: calibrate), convert: the module
    types after fusion and after conversion, the QAT steps' outputs and gradients, and the quantized
    model's output."""
    net.train(qat)
    fused = (tq.fuse_modules_qat if qat else tq.fuse_modules)(net, [["1", "2", "3"]])
    kinds = [_kind(m) for m in fused]
    fused.qconfig = tq.get_default_qat_qconfig("x86") if qat else tq.get_default_qconfig("x86")
    prepared = (tq.prepare_qat if qat else tq.prepare)(fused)
    steps = []
    opt = torch.optim.SGD(prepared.parameters(), lr=0.1) if qat else None
    for _ in range(2 if qat else 1):
        out = prepared(x)
        if opt is not None:
            opt.zero_grad()
            out.square().mean().backward()
            steps.append([out.detach()] + [p.grad.clone() for p in prepared.parameters() if p.grad is not None])
            opt.step()
    quantized = tq.convert(prepared.eval())
    return kinds + [_kind(m) for m in quantized], steps, quantized(x)


@pytest.mark.parametrize("qat", [False, True], ids=["ptq", "qat"])
def test_eager_quantization_of_a_converted_model_is_pytorchs(qat):
    x = torch.randn(2, 3, 12, 12)
    theirs = _quantized(_small_net(), qat, x)
    ours = _quantized(relu_ext.convert(_small_net()), qat, x)
    assert ours[0] == theirs[0] and theirs[0][1].endswith("ConvBnReLU2d" if qat else "ConvReLU2d"), ours[0]
    for a, b in zip(ours[1], theirs[1]):
        for p, q in zip(a, b):
            assert_bitwise_equal(p, q)
    assert torch.equal(ours[2].int_repr(), theirs[2].int_repr()) if ours[2].is_quantized else torch.equal(ours[2], theirs[2])


@pytest.mark.quick(cover=())  # resnet18: a real quantizable model takes 10-20 s
@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v2"])
def test_torchvisions_quantizable_models_fuse_and_train_as_pytorchs(arch):
    tv = pytest.importorskip("torchvision")

    def run(convert: bool) -> tuple[list[str], list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = getattr(tv.models.quantization, arch)(weights=None, quantize=False)
        if convert:
            relu_ext.convert(model)
        model.train()
        model.fuse_model(is_qat=True)
        kinds = sorted({_kind(m) for m in model.modules()})
        model.qconfig = tq.get_default_qat_qconfig("x86")
        tq.prepare_qat(model, inplace=True)
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        model(x).square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        quantized = tq.convert(model.eval())
        return kinds, grads, quantized(x)

    theirs, ours = run(False), run(True)
    assert ours[0] == theirs[0] and any(k.endswith("ConvBnReLU2d") for k in theirs[0]), ours[0]
    for a, b in zip(ours[1], theirs[1]):
        assert_bitwise_equal(a, b)
    assert torch.equal(ours[2], theirs[2])


def test_fx_graph_mode_quantization_of_a_converted_model_says_to_revert():
    from torch.ao.quantization.quantize_fx import prepare_fx, prepare_qat_fx

    x = torch.randn(2, 3, 12, 12)
    for prepare in (prepare_fx, prepare_qat_fx):
        net = relu_ext.convert(_small_net()[1:-1]).train(prepare is prepare_qat_fx)
        mapping = tq.get_default_qat_qconfig_mapping("x86") if prepare is prepare_qat_fx else tq.get_default_qconfig_mapping("x86")
        with pytest.raises(RuntimeError, match=r"relu_ext.revert\(model\)"):
            prepare(net, mapping, (x,))
        prepare(relu_ext.revert(net), mapping, (x,))  # reverted: PyTorch's own path
    # Other FX tracing keeps working: relu_ext's functions record their op.
    assert "relu_ext.relu" in str(torch.fx.symbolic_trace(relu_ext.convert(_small_net()[1:-1])).graph)
