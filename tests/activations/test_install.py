"""relu_ext.install(): every entry point reached, exactness, delegation, what stays out of reach,
transforms and exporters under it, and real models (torchvision, transformers)."""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import relu_ext
from conftest import DEVICES, adversarial, assert_bitwise_equal, node_names

pytestmark = pytest.mark.native  # the risk it checks: see tests/tiers.py

_F_RELU_TAKEN_BEFORE_INSTALL = F.relu  # as library code that did `from torch.nn.functional import relu`


@torch.jit.script
def _scripted_before_install(t: torch.Tensor) -> torch.Tensor:
    return torch.relu(t)


@pytest.fixture(autouse=True)
def _pytorch_kernels_around_each_test():
    relu_ext.uninstall()
    yield
    relu_ext.uninstall()


# Each way of calling a ReLU. The in-place ones take a non-leaf.
ENTRY_POINTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F.relu": F.relu,
    "F.relu-inplace": lambda t: F.relu(t, inplace=True),
    "torch.relu": torch.relu,
    "torch.relu_": torch.relu_,
    "Tensor.relu": torch.Tensor.relu,
    "Tensor.relu_": torch.Tensor.relu_,
    "nn.ReLU": torch.nn.ReLU(),
    "nn.ReLU-inplace": torch.nn.ReLU(inplace=True),
    "aten.relu": torch.ops.aten.relu.default,
    "aten.relu_": torch.ops.aten.relu_.default,
    "F.relu-taken-before-install": _F_RELU_TAKEN_BEFORE_INSTALL,
    "torchscript-scripted-before-install": _scripted_before_install,
}


def _run(entry: Callable, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    leaf = x.clone().requires_grad_()
    y = entry(leaf * 1)
    nodes = node_names(y)
    g = torch.randn_like(y)
    y.backward(g)
    return y.detach(), leaf.grad, nodes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_runs_relu_ext(name, dtype, device):
    x = adversarial(4097, dtype, device, seed=3)
    torch.manual_seed(0)
    ref_y, ref_g, ref_nodes = _run(ENTRY_POINTS[name], x)
    assert "ReluBackward0" in ref_nodes and "ReluExtBackward0" not in ref_nodes
    with relu_ext.install():
        torch.manual_seed(0)
        y, g, nodes = _run(ENTRY_POINTS[name], x)
    assert "ReluExtBackward0" in nodes and "ReluBackward0" not in nodes, nodes
    assert_bitwise_equal(y, ref_y, f"{name} output")
    assert_bitwise_equal(g, ref_g, f"{name} gradient")


def _payload_probe() -> torch.Tensor:
    """bfloat16 NaNs with payload 0x7FC1. PyTorch's CPU bf16 relu rewrites them
    to 0xFFFF in its vectorized body; relu_ext keeps every NaN's bits. So the
    output tells which kernel ran, even where no autograd node is recorded."""
    return torch.full((64,), 0x7FC1, dtype=torch.int16).view(torch.bfloat16)


def _payload(y: torch.Tensor) -> int:
    return int(y.view(torch.int16)[0]) & 0xFFFF


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "inference_tensor"])
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_reached_without_autograd(name, mode):
    """No gradient (no_grad), no autograd key at all (inference mode, inference tensors)."""
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode

    def run() -> int:
        with context():
            x = _payload_probe().clone()
        with context() if mode != "inference_tensor" else torch.inference_mode():
            return _payload(ENTRY_POINTS[name](x))

    assert run() == 0xFFFF, "the probe no longer tells PyTorch's kernel from relu_ext's"
    with relu_ext.install():
        assert run() == 0x7FC1
    assert run() == 0xFFFF


def test_dispatch_modes_see_relu_ext_ops():
    """A TorchDispatchMode (a profiler, a memory tracker) sees what runs: relu_ext's ops."""
    x = torch.randn(10, requires_grad=True)
    with relu_ext.install(), _Log() as log:
        F.relu(x).sum().backward()
    assert "relu_ext.relu_fwd.default" in log.ops and "relu_ext.relu_bwd.default" in log.ops, log.ops
    assert "aten.relu.default" not in log.ops and "aten.threshold_backward.default" not in log.ops, log.ops


def test_torch_function_modes_and_subclasses_work_as_without_install():
    """__torch_function__ runs above the dispatcher: a mode sees PyTorch's own
    functions, a subclass keeps its type, and what computes is relu_ext."""
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.funcs: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    class Tagged(torch.Tensor):
        pass

    def run() -> tuple[list[str], type, str]:
        x = torch.randn(6).as_subclass(Tagged).requires_grad_()
        with Seen() as seen:
            y = F.relu(x * 1)
        return seen.funcs, type(y), [n for n in node_names(y) if "Relu" in n]

    ref_funcs, ref_type, ref_node = run()
    with relu_ext.install():
        funcs, kind, node = run()
    assert funcs == ref_funcs and "relu" in funcs and kind is ref_type is Tagged
    assert (ref_node, node) == (["ReluBackward0"], ["ReluExtBackward0"])


# --- mechanics -------------------------------------------------------------------------


def _grad_fn_name() -> str:
    return torch.relu(torch.ones(2, requires_grad=True)).grad_fn.name()


def test_install_is_a_nestable_context_manager_and_uninstall_restores():
    assert not relu_ext.installed() and _grad_fn_name() == "ReluBackward0"
    outer = relu_ext.install()
    assert relu_ext.installed() and _grad_fn_name() == "ReluExtBackward0"
    with relu_ext.install() as inner:
        assert inner.active and relu_ext.installed()
    assert not inner.active
    assert relu_ext.installed() and _grad_fn_name() == "ReluExtBackward0", "leaving the inner one uninstalled"
    outer.remove()
    assert not relu_ext.installed() and _grad_fn_name() == "ReluBackward0"
    outer.remove()  # twice: nothing
    assert not relu_ext.installed()


def test_install_twice_needs_two_removes():
    a, b = relu_ext.install(), relu_ext.install()
    a.remove()
    a.remove()  # a hold counts once
    assert relu_ext.installed()
    b.remove()
    assert not relu_ext.installed()


def test_uninstall_ends_every_hold():
    a, b = relu_ext.install(), relu_ext.install()
    relu_ext.uninstall()
    assert not relu_ext.installed() and _grad_fn_name() == "ReluBackward0"
    assert not a.active and not b.active and "removed" in repr(a)
    c = relu_ext.install()
    a.remove()  # an earlier hold does not take the new installation away
    assert relu_ext.installed() and c.active
    relu_ext.uninstall()
    relu_ext.uninstall()  # twice: nothing
    assert not relu_ext.installed()


def test_exception_inside_with_block_still_uninstalls():
    with pytest.raises(ValueError):
        with relu_ext.install():
            raise ValueError("inside")
    assert not relu_ext.installed()


def test_installation_is_process_wide():
    """Every thread runs relu_ext while installed, not only the one that installed it."""
    names: list[str] = []

    def worker() -> None:
        names.append(_grad_fn_name())

    with relu_ext.install():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert names == ["ReluExtBackward0", "ReluBackward0"]


def test_install_inside_a_compiled_region():
    """fullgraph: a clear error naming the reason; otherwise Dynamo runs the frame
    eagerly, and install() works there."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        relu_ext.install()
        return torch.relu(t)

    x = torch.randn(8)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="relu_ext.install\\(\\) was called inside a region torch.compile is tracing"):
        torch.compile(fn, fullgraph=True, backend="eager")(x)
    assert not relu_ext.installed()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, backend="eager")(x), torch.relu(x))
    assert relu_ext.installed()


# --- delegation: what relu_ext has no kernel for gets exactly torch.relu's answer ---------


def _densify(y: torch.Tensor) -> torch.Tensor:
    if y.is_quantized:
        return y.int_repr()
    if y.layout == torch.jagged:
        return y.values()
    if y.is_nested:
        return torch.nested.to_padded_tensor(y, 0.0)
    if y.layout != torch.strided:
        return y.to_dense()
    return y


def _quantized(requires_grad: bool) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in recent torch
        return torch.quantize_per_tensor(torch.linspace(-2, 2, 12), 0.1, 10, torch.quint8)


def _nested(layout: torch.layout, requires_grad: bool) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided layout is a prototype
        parts = [torch.linspace(-1, 1, 5), torch.linspace(-2, 3, 7)]
        return torch.nested.nested_tensor(parts, layout=layout, requires_grad=requires_grad)


# Inputs relu_ext has no kernel for; each is made afresh for each call.
DELEGATED: dict[str, Callable[[bool], torch.Tensor]] = {
    "sparse_coo": lambda g: torch.linspace(-2, 2, 12).view(3, 4).to_sparse().requires_grad_(g),
    "sparse_csr": lambda g: torch.linspace(-2, 2, 12).view(3, 4).to_sparse_csr().requires_grad_(g),
    "nested_strided": lambda g: _nested(torch.strided, g),
    "nested_jagged": lambda g: _nested(torch.jagged, g),
    "quantized": _quantized,
    "mkldnn": lambda g: torch.linspace(-2, 2, 12).to_mkldnn(),
}


def _outcome(call: Callable[[torch.Tensor], torch.Tensor], make: Callable[[bool], torch.Tensor], grad: bool) -> Any:
    """What a call gives: its values and gradient, or its error (type and message)."""
    x = make(grad)
    try:
        y = call(x)
        values = _densify(y).clone()
        if not grad:
            return ("value", values.dtype, values.tolist())
        try:
            _densify(y).sum().backward()
            gradient = _densify(x.grad).tolist()
        except Exception as e:  # noqa: BLE001  (PyTorch's own error is the expected answer here)
            gradient = (type(e), str(e))
        return ("value", values.dtype, values.tolist(), gradient)
    except Exception as e:  # noqa: BLE001
        return ("error", type(e), str(e))


CALLS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {  # (call, under install())
    "relu_ext.relu": (relu_ext.relu, False),
    "relu_ext.relu-inplace": (lambda t: relu_ext.relu(t, inplace=True), False),
    "relu_ext.ReLU": (relu_ext.ReLU(), False),
    "install-torch.relu": (torch.relu, True),
    "install-F.relu-inplace": (lambda t: F.relu(t, inplace=True), True),
    "install-nn.ReLU": (torch.nn.ReLU(), True),
}


@pytest.mark.parametrize(
    "grad, call",
    # In place on a leaf that requires grad is an error either way (test_exact checks that).
    [(g, c) for g in (False, True) for c in CALLS if not (g and "inplace" in c)],
    ids=lambda v: ("grad" if v else "no_grad") if isinstance(v, bool) else v,
)
@pytest.mark.parametrize("kind", DELEGATED)
def test_inputs_without_kernels_get_torch_relus_answer(kind, call, grad):
    fn, under_install = CALLS[call]
    reference = torch.relu_ if "inplace" in call else torch.relu
    expected = _outcome(reference, DELEGATED[kind], grad)
    if under_install:
        with relu_ext.install():
            got = _outcome(fn, DELEGATED[kind], grad)
    else:
        got = _outcome(fn, DELEGATED[kind], grad)
    assert got == expected


class _Elsewhere(torch.Tensor):
    """A tensor on a device relu_ext has no kernels for; records the ops it receives."""

    seen: list[str] = []

    @staticmethod
    def __new__(cls, device: str):
        return torch.Tensor._make_wrapper_subclass(cls, (3,), dtype=torch.float32, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(func))
        return _Elsewhere(args[0].device.type)


@pytest.mark.parametrize("device", ["xpu", "mps", "privateuseone"])
@pytest.mark.parametrize("call", CALLS)
def test_other_devices_get_aten_relu(device, call):
    fn, under_install = CALLS[call]
    _Elsewhere.seen = []
    with relu_ext.install() if under_install else torch.no_grad():
        fn(_Elsewhere(device))
    assert _Elsewhere.seen == ["aten.relu_.default" if "inplace" in call else "aten.relu.default"]


def test_training_pieces_still_refuse_what_they_have_no_kernel_for():
    with pytest.raises(RuntimeError, match="x has layout Sparse.*supports strided \\(dense\\) tensors only"):
        torch.ops.relu_ext.relu_fwd(torch.randn(3, 3).to_sparse())


# --- what install() does not reach, by design -------------------------------------------------


def test_traced_graphs_keep_aten_relu():
    """torch.compile and torch.export trace with fake tensors, which keep PyTorch's
    kernel: the graphs are nn.ReLU's (Inductor fuses the ReLU, exported programs hold
    aten.relu), and compiled code runs PyTorch's ReLU."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[set[str]] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm)

    model = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    with relu_ext.install():
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=aot_autograd(fw_compiler=capture, bw_compiler=capture), fullgraph=True)
        compiled(x).sum().backward()
        exported = torch.export.export(model, (x.detach(),))
    forward, backward = graphs
    assert "aten.relu.default" in forward and not any("relu_ext" in t for t in forward | backward), graphs
    assert "aten.threshold_backward.default" in backward
    assert "aten.relu.default" in {str(n.target) for n in exported.graph.nodes}


def test_dispatch_subclasses_keep_aten_relu():
    """A __torch_dispatch__ subclass (DTensor, a user's wrapper) receives aten.relu, as without install()."""
    _Elsewhere.seen = []
    with relu_ext.install():
        torch.relu(_Elsewhere("cpu"))
        F.relu(_Elsewhere("cpu"), inplace=True)
    assert _Elsewhere.seen == ["aten.relu.default", "aten.relu_.default"]


class _Log(TorchDispatchMode):
    """Records the ops that reach the dispatcher's Python key."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "call",
    [lambda t: torch.clamp(t, min=0), lambda t: F.threshold(t, 0.0, 0.0), lambda t: torch.where(t > 0, t, 0.0)],
    ids=["clamp_min", "threshold", "where"],
)
def test_ops_that_compute_a_relu_of_their_own_are_not_reached(call):
    """Only aten::relu / aten::relu_ are taken over; another op that happens to
    compute a ReLU keeps its own kernel and backward node."""
    x = torch.randn(16, requires_grad=True)
    with relu_ext.install(ops=["relu"]), _Log() as log:  # threshold is the family's: install() takes it by default
        y = call(x)
    assert not any("relu" in op for op in log.ops), log.ops
    assert "Relu" not in y.grad_fn.name()


def test_relu_out_is_reached_for_its_values():
    """aten.relu.out (no gradient: out= ops record none) computes through aten::relu."""
    x = _payload_probe()
    run = lambda: _payload(torch.ops.aten.relu.out(x, out=torch.empty_like(x)))  # noqa: E731
    assert run() == 0xFFFF
    with relu_ext.install():
        assert run() == 0x7FC1


# --- transforms and exporters under install() ---------------------------------------------


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True),
        torch.nn.Linear(16, 4),
    )


def _train_step(model: Callable, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [p for p in _mlp_params(model)]
    for p in params:
        p.grad = None
    y = model(x)
    y.square().sum().backward()
    return y.detach(), [p.grad.clone() for p in params]


def _mlp_params(model: Callable) -> list[torch.nn.Parameter]:
    return list(getattr(model, "_orig_mod", model).parameters())


def _assert_same_step(a: tuple, b: tuple) -> None:
    assert_bitwise_equal(a[0], b[0], "output")
    for i, (ga, gb) in enumerate(zip(a[1], b[1])):
        assert_bitwise_equal(ga, gb, f"gradient {i}")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_under_install(backend):
    x = torch.randn(4, 8)
    ref = _train_step(_mlp(), x)
    model = _mlp()
    with relu_ext.install():
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        got = _train_step(compiled, x)
    if backend == "inductor":  # Inductor may fuse Linear layers differently from eager
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    else:
        _assert_same_step(got, ref)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_after_uninstall(backend):
    """A model compiled after a compilation under install() and uninstall
    gets PyTorch's ReLU and every gradient (PyTorch's Python dispatcher caches
    kernel choices per op: install and uninstall must clear them)."""
    x = torch.randn(4, 8)
    ref = _train_step(_mlp(), x)
    with relu_ext.install():
        torch._dynamo.reset()
        torch.compile(_mlp(), backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    got = _train_step(torch.compile(_mlp(), backend=backend, fullgraph=True), x)
    assert all(g.abs().sum() > 0 for g in got[1])  # a gradient through every ReLU
    if backend == "aot_eager":
        _assert_same_step(got, ref)


def test_export_under_install_equals_nn_relu():
    x = torch.randn(4, 8)
    with relu_ext.install():
        ep = torch.export.export(_mlp(), (x,))
        _assert_same_step(_train_step(ep.module(), x), _train_step(_mlp(), x))
    assert torch.equal(ep.module()(x), _mlp()(x))  # a standard program: it runs without relu_ext too


def test_torchscript_trace_and_onnx_under_install(tmp_path):
    onnx = pytest.importorskip("onnx")
    x = torch.randn(4, 8)
    with relu_ext.install():
        traced = torch.jit.trace(_mlp(), (x,))
        _assert_same_step(_train_step(traced, x), _train_step(_mlp(), x))
        path = str(tmp_path / "m.onnx")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_mlp(), (x,), path, dynamo=False)
    assert [n.op_type for n in onnx.load(path).graph.node].count("Relu") == 2


def test_torch_func_under_install():
    from torch.func import grad, jacrev, jvp, vmap

    x = adversarial(33, torch.float32, seed=5).view(3, 11)

    def f(t: torch.Tensor) -> torch.Tensor:
        return (F.relu(t) * torch.arange(11.0)).sum()

    ref = [grad(f)(x), jacrev(torch.relu)(x[0]), vmap(grad(f))(x), jvp(torch.relu, (x,), (torch.ones_like(x),))[1]]
    with relu_ext.install():
        got = [grad(f)(x), jacrev(torch.relu)(x[0]), vmap(grad(f))(x), jvp(torch.relu, (x,), (torch.ones_like(x),))[1]]
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_bitwise_equal(a, b, f"transform {i}")


def _checkpointed() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU6(inplace=True),
        torch.nn.Linear(16, 16), torch.nn.LeakyReLU(0.1), torch.nn.Linear(16, 4),
    )


# Each way of holding an installation around a checkpointed forward and its
# backward: (forward's ops or None, how the forward's hold ends before
# backward, backward's ops or None). The recomputation in backward must run
# the kernels the forward ran, whatever is installed by then.
TARGETS = tuple(relu_ext.install_targets())
CHECKPOINT_WAYS = {
    "with block, backward after it": (TARGETS, "exit", None),
    "Installation.remove()": (TARGETS, "remove", None),
    "uninstall()": (TARGETS, "uninstall", None),
    "forward and backward inside": (TARGETS, "keep", None),
    "installed for backward only": (None, "exit", TARGETS),
    "relu at forward, the family at backward": (("relu",), "exit", ("hardtanh", "leaky_relu")),
    "nested holds": (TARGETS, "nested", None),
}


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("way", CHECKPOINT_WAYS)
def test_activation_checkpointing_under_install(way, use_reentrant):
    """A checkpointed forward and its backward under any installation
    state: the same output and gradients as without relu_ext, bitwise, and
    the installation as the user left it afterwards."""
    from torch.utils.checkpoint import checkpoint

    fwd_ops, end, bwd_ops = CHECKPOINT_WAYS[way]
    x = torch.randn(4, 8, requires_grad=True)

    def forward() -> tuple[torch.nn.Module, torch.Tensor]:
        model = _checkpointed()
        return model, checkpoint(model, x, use_reentrant=use_reentrant)

    def backward(model: torch.nn.Module, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        y.square().sum().backward()
        return y.detach(), [p.grad for p in model.parameters()]

    ref = backward(*forward())
    outer = relu_ext.install(("relu",)) if end == "nested" else None
    hold = relu_ext.install(fwd_ops) if fwd_ops else None
    try:
        model, y = forward()
        if fwd_ops and not use_reentrant:  # the forward really ran relu_ext's kernels
            expected = {"ReluExtBackward0"} | ({"HardtanhExtBackward0"} if "hardtanh" in fwd_ops else set())
            assert expected <= set(node_names(y))
    finally:
        if end == "uninstall":
            relu_ext.uninstall()
        elif hold is not None and end != "keep":
            hold.remove()
    state = relu_ext.dispatch._C.installed()
    try:
        if bwd_ops:
            with relu_ext.install(bwd_ops):
                got = backward(model, y)
        else:
            got = backward(model, y)
        assert sorted(relu_ext.dispatch._C.installed()) == sorted(state)
    finally:
        relu_ext.uninstall()
    _assert_same_step(got, ref)


# --- real models -------------------------------------------------------------------------


def _torchvision(name: str) -> Callable[[], tuple[torch.nn.Module, torch.Tensor]]:
    def make() -> tuple[torch.nn.Module, torch.Tensor]:
        tv = pytest.importorskip("torchvision")
        kwargs = {"aux_logits": False, "init_weights": True} if name in ("googlenet", "inception_v3") else {}
        model = getattr(tv.models, name)(weights=None, **kwargs)
        side = 80 if name == "inception_v3" else 64  # inception_v3 needs at least 75x75
        return model, torch.randn(2, 3, side, side)

    return make


def _t5() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        feed_forward_proj="relu", dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config)
    g = torch.Generator().manual_seed(0)
    return model, {"input_ids": torch.randint(1, 64, (2, 9), generator=g), "labels": torch.randint(1, 64, (2, 7), generator=g)}


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {
    "googlenet": _torchvision("googlenet"),
    "inception_v3": _torchvision("inception_v3"),
    "densenet121": _torchvision("densenet121"),
    "resnet18": _torchvision("resnet18"),
    "t5_relu": _t5,
}


def _model_step(model: torch.nn.Module, inputs: Any, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)  # the same dropout masks in every run
    if isinstance(inputs, dict):
        out = model(**inputs).loss
        loss = out
    else:
        out = model(inputs.to(dtype))
        loss = out.float().square().mean()
    nodes = node_names(loss)
    loss.backward()
    return out.detach(), [p.grad for p in model.parameters() if p.grad is not None], nodes


@pytest.mark.quick(cover=("dtype",))  # one model a dtype: a real model takes seconds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_real_models_run_relu_ext_everywhere_with_identical_results(name, dtype):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.to(dtype).train()
    ref_out, ref_grads, ref_nodes = _model_step(model, inputs, dtype)
    relus = ref_nodes.count("ReluBackward0")
    assert relus > 0 and "ReluExtBackward0" not in ref_nodes
    with relu_ext.install():
        out, grads, nodes = _model_step(model, inputs, dtype)
    assert nodes.count("ReluBackward0") == 0, "a ReLU of this model escaped install()"
    assert nodes.count("ReluExtBackward0") == relus
    assert_bitwise_equal(out, ref_out, f"{name} output")
    assert len(grads) == len(ref_grads) == sum(1 for p in model.parameters() if p.requires_grad)
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert_bitwise_equal(a, b, f"{name} gradient {i}")
    _, _, after = _model_step(model, inputs, dtype)
    assert after.count("ReluBackward0") == relus and "ReluExtBackward0" not in after


# --- exported programs that load without relu_ext ------------------------------------------

_LOAD_WITHOUT_RELU_EXT = """
import sys, torch
ep = torch.export.load(sys.argv[1])
x, expected = torch.load(sys.argv[2])
assert "relu_ext" not in sys.modules
assert torch.equal(ep.module()(x), expected)
print("loaded and equal")
"""


@pytest.mark.full  # a fresh process that exports and lowers: the quick tier has test_export.py's cases
def test_lowered_export_loads_in_a_process_without_relu_ext(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(  # ReLU and every activation of the family, in place and not
        torch.nn.Linear(8, 8), relu_ext.ReLU(), torch.nn.Linear(8, 8), relu_ext.ReLU(inplace=True),
        torch.nn.Linear(8, 8), relu_ext.ReLU6(inplace=True), torch.nn.Linear(8, 8), relu_ext.Hardtanh(-0.5, 0.5),
        torch.nn.Linear(8, 8), relu_ext.LeakyReLU(0.1), torch.nn.Linear(8, 8), relu_ext.Threshold(0.1, -2.0),
        torch.nn.Linear(8, 8), relu_ext.Hardsigmoid(inplace=True), torch.nn.Linear(8, 4),
    )
    x = torch.randn(3, 8)
    ep = torch.export.export(model, (x,))
    torch.save((x, model(x).detach()), tmp_path / "io.pt")
    torch.export.save(ep, tmp_path / "raw.pt2")
    lowered = ep.run_decompositions(relu_ext.aten_decompositions())
    assert not any("relu_ext" in str(n.target) for n in lowered.graph.nodes), lowered.graph
    torch.export.save(lowered, tmp_path / "lowered.pt2")

    def load(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_RELU_EXT, str(tmp_path / name), str(tmp_path / "io.pt")],
                              capture_output=True, text=True, timeout=300)

    ok = load("lowered.pt2")
    assert ok.returncode == 0 and "loaded and equal" in ok.stdout, ok.stderr[-3000:]
    raw = load("raw.pt2")
    assert raw.returncode != 0 and "error when deserializing" in raw.stderr, "the unlowered program is expected to need relu_ext"
