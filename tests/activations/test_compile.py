"""torch.compile traces the ops (no graph break) and matches eager, forward and backward."""

import os
import subprocess
import sys

import pytest
import torch

import relu_ext
from conftest import DEVICES

pytestmark = pytest.mark.torch_version  # the risk it checks: see tests/tiers.py


def _model(device, inplace=False):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), relu_ext.ReLU(inplace), torch.nn.Linear(64, 64), relu_ext.ReLU(inplace),
        torch.nn.Linear(64, 4),
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
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_compile_fullgraph_matches_eager(device, backend, inplace):
    torch._dynamo.reset()
    model = _model(device, inplace)
    x = torch.randn(16, 32, device=device)
    eager_out, eager_grads = _run(model, x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out, grads = _run(compiled, x)
    assert torch.equal(out, eager_out)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=0, atol=0) if backend == "aot_eager" else torch.testing.assert_close(g, e)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_compiled_graph_calls_the_custom_ops(inplace):
    """The ops stay opaque in the graph: forward saves the mask, backward calls
    relu_bwd. In place, functionalization turns relu_fwd_ into relu_fwd (no
    auto_functionalized wrapper, no clone)."""
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
    model = _model("cpu", inplace)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    compiled(torch.randn(8, 32)).sum().backward()
    fw = set().union(*(ops for kind, ops in seen if kind == "fw"))
    bw = set().union(*(ops for kind, ops in seen if kind == "bw"))
    assert "relu_ext.relu_fwd.default" in fw, fw
    assert "relu_ext.relu_bwd.default" in bw, bw
    assert not any("threshold_backward" in op for op in bw)
    assert not any("auto_functionalized" in op or "clone" in op for op in fw | bw), fw | bw


def test_compile_dynamic_shapes_and_no_grad():
    torch._dynamo.reset()
    fn = torch.compile(lambda t: relu_ext.relu(t) * 2, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (5, 17, 1000):
        x = torch.randn(n)
        assert torch.equal(fn(x), torch.relu(x) * 2)
    with torch.no_grad():
        x = torch.randn(33, requires_grad=True)
        assert torch.equal(fn(x), torch.relu(x) * 2)


def test_compile_inference_inplace_and_integers():
    """No grad: the mask-free ops; relu_ on a graph input mutates it, as eager does."""
    torch._dynamo.reset()

    def fn(t, i):
        relu_ext.relu(t, inplace=True)
        return t * 2, relu_ext.relu(i)

    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    x, i = torch.randn(100), torch.randint(-5, 5, (100,), dtype=torch.int32)
    x_ref = x.clone()
    out, out_i = compiled(x, i)
    assert torch.equal(x, torch.relu(x_ref)) and torch.equal(out, torch.relu(x_ref) * 2)
    assert torch.equal(out_i, torch.relu(i))


INDUCTOR_WITH_CI = """
import sys, torch
if {inductor_first}:
    import torch._inductor.lowering
import relu_ext
assert {inductor_first} or "torch._inductor.lowering" not in sys.modules, "import relu_ext imported inductor"

def fn(t, i):
    relu_ext.relu(t, inplace=True)
    return t * 2, relu_ext.relu(i), relu_ext.hardtanh(t, -1.0, 1.0)

x, i = torch.randn(100), torch.randint(-5, 5, (100,), dtype=torch.int32)
want = torch.relu(x) * 2, torch.relu(i), torch.nn.functional.hardtanh(torch.relu(x), -1.0, 1.0)
out = torch.compile(fn, fullgraph=True, backend="inductor")(x.clone(), i)
assert all(torch.equal(a, b) for a, b in zip(out, want)), out
"""


@pytest.mark.quick(cover=())  # one order: each is a process that imports inductor (~20 s)
@pytest.mark.parametrize("inductor_first", [False, True])
def test_inductor_runs_ops_that_have_a_decomposition_with_ci_set(tmp_path, inductor_first):
    """With the CI environment variable set, inductor refuses an implicit fallback for an op that
    has a decomposition (relu_ext registers its functional ops' for the exporters): relu_ext makes
    those fallbacks itself, whether inductor is imported before or after it, and without importing
    it. A fresh cache directory, so that no cached graph skips the lowering."""
    env = {**os.environ, "CI": "true", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", INDUCTOR_WITH_CI.format(inductor_first=inductor_first)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
