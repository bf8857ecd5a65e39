"""Everything that turns a model into something else: TorchScript (script and
trace), torch.export, ONNX (both exporters, run with onnxruntime), and
torch.fx.symbolic_trace of user code. Each compares with nn.ReLU / torch.relu."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import relu_ext
from conftest import adversarial

onnx = pytest.importorskip("onnx", reason="onnx is in the test extra (pip install -e .[test])")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is in the test extra (pip install -e .[test])")
pytest.importorskip("onnxscript", reason="onnxscript is in the test extra (pip install -e .[test])")

# TorchScript is deprecated (each call warns: DeprecationWarning in torch 2.11,
# FutureWarning in 2.14); it is still supported, and tested.
pytestmark = [pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated"), pytest.mark.torch_version]

INPLACE = pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])


def _mlp(act: type, inplace: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), act(inplace=inplace), torch.nn.Linear(16, 8), act(inplace=inplace), torch.nn.Linear(8, 1)
    )


def _convnet(act: type, inplace: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), act(inplace=inplace),
        torch.nn.Conv2d(8, 8, 3, padding=1), act(inplace=inplace), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10),
    ).eval()


def _x(shape=(5, 8), seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _grads(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_same_training(a: torch.nn.Module, b: torch.nn.Module, x: torch.Tensor) -> None:
    out_a, grads_a = _grads(a, x)
    out_b, grads_b = _grads(b, x)
    assert torch.equal(out_a, out_b)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.equal(ga, gb)


def _relu_ext_ops(graph_nodes) -> set[str]:
    return {str(n.target) for n in graph_nodes if n.op == "call_function" and str(n.target).startswith("relu_ext.")}


# --- TorchScript ------------------------------------------------------------------


def _save_load(scripted):
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    return torch.jit.load(buf)


@INPLACE
def test_torchscript_script_module_saves_loads_and_trains(inplace):
    loaded = _save_load(torch.jit.script(_mlp(relu_ext.ReLU, inplace)))
    assert "relu_ext::relu" in str(loaded.inlined_graph)  # relu_ext::relu or relu_ext::relu_
    _assert_same_training(loaded, _mlp(torch.nn.ReLU, inplace), _x())


def test_torchscript_script_function():
    def fn(t: torch.Tensor) -> torch.Tensor:
        return relu_ext.relu(t) + relu_ext.relu(t * 2, inplace=True)

    loaded = _save_load(torch.jit.script(fn))
    x = adversarial(1000, torch.float32, seed=1)
    assert torch.equal(loaded(x).nan_to_num(), (torch.relu(x) + torch.relu(x * 2)).nan_to_num())


@INPLACE
def test_jit_trace_in_training_mode_checks_and_trains(inplace):
    """torch.jit.trace's default check (re-trace and compare) passes, and the
    traced module trains like nn.ReLU: same losses, step by step."""
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error", torch.jit.TracerWarning)  # a failed check only warns by default
        warnings.filterwarnings("ignore", "`torch.jit.*` is deprecated")
        traced = torch.jit.trace(_mlp(relu_ext.ReLU, inplace), (x,))
    assert "relu_ext::relu(" in str(traced.inlined_graph)
    ref = _mlp(torch.nn.ReLU, inplace)
    losses = {}
    for name, model in (("traced", traced), ("ref", ref)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses[name] = []
        for _ in range(5):
            opt.zero_grad()
            loss = (model(x) - 1).square().mean()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["traced"] == losses["ref"] and losses["ref"][-1] < losses["ref"][0]


def test_jit_trace_follows_the_in_place_value():
    """A traced relu_ is relu plus copy_ into x, so later uses of x (here a
    residual add) see the new value, in the trace as in eager."""

    def fn(t: torch.Tensor) -> torch.Tensor:
        u = t * 1
        relu_ext.relu(u, inplace=True)
        return u + t

    x = _x()
    traced = torch.jit.trace(fn, (x,))
    assert torch.equal(traced(x), torch.relu(x) + x)
    assert torch.equal(traced(-x), torch.relu(-x) - x)


# --- torch.export -------------------------------------------------------------------


@INPLACE
def test_export_forward_and_train_mode_backward(inplace):
    x = _x()
    ep = torch.export.export(_mlp(relu_ext.ReLU, inplace), (x,))
    assert _relu_ext_ops(ep.graph.nodes), ep.graph
    module = ep.module()
    _assert_same_training(module, _mlp(torch.nn.ReLU, inplace), x)
    _assert_same_training(module, _mlp(torch.nn.ReLU, inplace), _x(seed=3))


@INPLACE
def test_export_under_no_grad_then_run_with_grad(inplace):
    """The graph holds the public op, whose autograd kernel runs whenever the
    program is run with grad."""
    x = _x()
    with torch.no_grad():
        ep = torch.export.export(_mlp(relu_ext.ReLU, inplace), (x,))
    _assert_same_training(ep.module(), _mlp(torch.nn.ReLU, inplace), x)


@INPLACE
def test_export_run_decompositions(inplace):
    """The core-ATen lowering keeps relu_ext.relu as the custom op it is (as
    for any op with kernels of its own); the table that ONNX and other
    exporters decompose with lowers it to aten.relu."""
    x = _x()
    ref = _mlp(torch.nn.ReLU, inplace)
    ep = torch.export.export(_mlp(relu_ext.ReLU, inplace), (x,))
    core = ep.run_decompositions()
    assert _relu_ext_ops(core.graph.nodes) == {"relu_ext.relu.default"}, core.graph
    assert torch.equal(core.module()(x), ref(x))
    table = {torch.ops.relu_ext.relu.default: torch._decomp.decomposition_table[torch.ops.relu_ext.relu.default]}
    lowered = ep.run_decompositions(table)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert "aten.relu.default" in targets and not _relu_ext_ops(lowered.graph.nodes), targets
    assert torch.equal(lowered.module()(x), ref(x))


# --- ONNX ------------------------------------------------------------------------------


# (in place, dynamo, opset): both exporters at their default opset, and the TorchScript exporter
# at opsets 7 and 8, below PyTorch's own symbolics (opset 9): at opset 7 relu_ext's own Relu
# symbolic writes the node. Not relu_ext's in-place ReLU at opset 7: its export fails there (expand_as has no opset-7
# symbolic), where PyTorch's exports.
ONNX_EXPORTS = {
    f"{exporter}-{place}": (place == "inplace", dynamo, opset)
    for exporter, dynamo, opset, places in [("torchscript_exporter", False, None, ("out_of_place", "inplace")),
                                            ("dynamo_exporter", True, None, ("out_of_place", "inplace")),
                                            ("torchscript_exporter_opset7", False, 7, ("out_of_place",)),
                                            ("torchscript_exporter_opset8", False, 8, ("out_of_place", "inplace"))]
    for place in places
}


@pytest.mark.parametrize("case", ONNX_EXPORTS)
def test_onnx_export_writes_standard_relu(tmp_path, case):
    inplace, dynamo, opset = ONNX_EXPORTS[case]
    model, ref = _convnet(relu_ext.ReLU, inplace), _convnet(torch.nn.ReLU, inplace)
    x = _x((2, 3, 8, 8))
    path = str(tmp_path / "model.onnx")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (x,), dynamo=True, verbose=False).save(path)
        else:
            torch.onnx.export(model, (x,), path, dynamo=False, opset_version=opset)
    node_types = [n.op_type for n in onnx.load(path).graph.node]
    assert node_types.count("Relu") == 2, node_types
    assert not any("relu_ext" in t for t in node_types), node_types
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), ref(x), rtol=1e-5, atol=1e-5)


# --- torch.fx ----------------------------------------------------------------------------


def _user_code(t: torch.Tensor) -> torch.Tensor:
    return relu_ext.relu(t) + relu_ext.relu(t * 2, inplace=True)


def test_fx_symbolic_trace_of_user_code():
    """relu_ext.relu called from user code traces as one node per call."""
    gm = torch.fx.symbolic_trace(_user_code)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.relu_ext.relu) == 1 and calls.count(torch.ops.relu_ext.relu_) == 1, calls
    x = adversarial(1000, torch.float32, seed=2)
    assert torch.equal(gm(x).nan_to_num(), _user_code(x).nan_to_num())

    module = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), relu_ext.ReLU()))
    assert any(n.op == "call_function" and n.target is torch.ops.relu_ext.relu for n in module.graph.nodes)
