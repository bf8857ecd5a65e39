"""torch.compile traces the ops (no graph break) and matches eager, forward and backward."""

import pytest
import torch

import relu_ext
from conftest import DEVICES


def _model(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), relu_ext.ReLU(), torch.nn.Linear(64, 64), relu_ext.ReLU(), torch.nn.Linear(64, 4)
    ).to(device)


def _run(model, x):
    model.zero_grad()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _graph_ops(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(device, backend):
    torch._dynamo.reset()
    model = _model(device)
    x = torch.randn(16, 32, device=device)
    eager_out, eager_grads = _run(model, x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out, grads = _run(compiled, x)
    assert torch.equal(out, eager_out)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=0) if backend == "aot_eager" else torch.testing.assert_close(g, e)


def test_compiled_graph_calls_the_custom_ops():
    """The ops stay opaque in the graph: forward saves the mask, backward calls relu_bwd."""
    torch._dynamo.reset()
    seen = []

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def fw_compiler(gm, _):
        seen.append(("fw", _graph_ops(gm)))
        return make_boxed_func(gm.forward)

    def bw_compiler(gm, _):
        seen.append(("bw", _graph_ops(gm)))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=fw_compiler, bw_compiler=bw_compiler)
    model = _model("cpu")
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    compiled(torch.randn(8, 32)).sum().backward()
    fw = set().union(*(ops for kind, ops in seen if kind == "fw"))
    bw = set().union(*(ops for kind, ops in seen if kind == "bw"))
    assert "relu_ext.relu_fwd.default" in fw, fw
    assert "relu_ext.relu_bwd.default" in bw, bw
    assert not any("threshold_backward" in op for op in bw)


def test_compile_dynamic_shapes_and_no_grad():
    torch._dynamo.reset()
    fn = torch.compile(lambda t: relu_ext.relu(t) * 2, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (5, 17, 1000):
        x = torch.randn(n)
        assert torch.equal(fn(x), torch.relu(x) * 2)
    with torch.no_grad():
        x = torch.randn(33, requires_grad=True)
        assert torch.equal(fn(x), torch.relu(x) * 2)


def test_fx_symbolic_trace():
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), relu_ext.ReLU()))
    x = torch.randn(3, 4)
    lin = gm.get_submodule("0")
    assert torch.equal(gm(x), torch.relu(lin(x)))
    assert any(n.op == "call_function" and n.target is relu_ext.relu for n in gm.graph.nodes), gm.graph
