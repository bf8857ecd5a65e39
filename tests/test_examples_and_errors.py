"""The two-layer-net example, bad inputs, the module API, and build facts."""

import copy
import io
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

import relu_ext
from relu_ext import _C, ops as relu_ops
from conftest import DEVICES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import two_layer_net  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
def test_two_layer_net_same_trajectory(device):
    ref = two_layer_net.train(torch.relu, device=device)
    ours = two_layer_net.train(relu_ext.relu, device=device)
    assert len(ours) == 500
    assert ours == ref, "loss trajectories differ"
    assert ours[-1] < ours[0] / 1000, f"loss fell only {ours[0] / ours[-1]:.3g}x"


# --- bad inputs ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64])
def test_unsupported_dtype(dtype):
    x = torch.zeros(4, dtype=dtype)
    for call in (lambda: relu_ext.relu(x), lambda: relu_ext.relu(x, inplace=True), lambda: relu_ext.ReLU()(x)):
        with pytest.raises(RuntimeError, match=r"dtype .*supports float32, float64, float16 and bfloat16"):
            call()


def test_sparse_layout():
    with pytest.raises(RuntimeError, match="layout torch.sparse_coo.*strided"):
        relu_ext.relu(torch.randn(3, 3).to_sparse())


def test_not_a_tensor():
    with pytest.raises(TypeError, match="expected a Tensor"):
        relu_ext.relu([1.0, -1.0])


def test_raw_backward_bad_mask():
    g = torch.randn(100)
    _, mask = torch.ops.relu_ext.relu_fwd(torch.randn(100))
    with pytest.raises(RuntimeError, match=r"mask has shape \[12\] but grad has 100 elements, which need a 1-D mask of 13"):
        torch.ops.relu_ext.relu_bwd(g, mask[:12])
    with pytest.raises(RuntimeError, match="1-D mask"):
        torch.ops.relu_ext.relu_bwd(g, torch.zeros(13, 1, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="mask has dtype Int.*expected uint8"):
        torch.ops.relu_ext.relu_bwd(g, mask.int())
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.relu_ext.relu_bwd(g, torch.zeros(26, dtype=torch.uint8)[::2])


def test_raw_backward_devices_differ():
    # A meta mask takes the fake kernel's checks; with a GPU, cpu vs cuda below.
    with pytest.raises(RuntimeError, match="same device|device"):
        torch.ops.relu_ext.relu_bwd(torch.randn(16), torch.empty(2, dtype=torch.uint8, device="meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_backward_devices_differ_cuda():
    _, mask = torch.ops.relu_ext.relu_fwd(torch.randn(16, device="cuda"))
    with pytest.raises(RuntimeError, match="grad is on cpu but mask is on cuda:0"):
        torch.ops.relu_ext.relu_bwd(torch.randn(16), mask)


def test_device_without_kernels_is_reported(monkeypatch):
    monkeypatch.setattr(relu_ops, "_KERNEL_DEVICES", frozenset({"meta"}))
    with pytest.raises(RuntimeError, match="input is on cpu, but this relu_ext build has kernels for"):
        relu_ext.relu(torch.randn(3))


@pytest.mark.skipif(_C.with_cuda, reason="this build has CUDA kernels")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_cuda_tensor_on_cpu_only_build():
    with pytest.raises(RuntimeError, match="no CUDA kernels"):
        relu_ext.relu(torch.randn(3, device="cuda"))


def test_bad_cpu_isa_name():
    with pytest.raises(RuntimeError, match="unknown CPU kernel set 'sse9'"):
        _C.set_cpu_isa("sse9")


# --- module API ---------------------------------------------------------------

def test_module_is_a_drop_in():
    for inplace in (False, True):
        ours, ref = relu_ext.ReLU(inplace=inplace), torch.nn.ReLU(inplace=inplace)
        assert repr(ours) == repr(ref)
        assert isinstance(ours, torch.nn.ReLU) and ours.inplace is inplace
        assert ours.state_dict() == ref.state_dict() == {}
    assert repr(relu_ext.ReLU(True)) == "ReLU(inplace=True)"

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), relu_ext.ReLU(inplace=True))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True))
    ref.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(clone[1]) is relu_ext.ReLU and clone[1].inplace
        assert torch.equal(clone(x), ref(x))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert torch.equal(loaded(x), ref(x))
    assert b"relu_ext" in pickle.dumps(model) and b"relu_ext.ops" not in pickle.dumps(model)


def test_functional_signature_like_F_relu():
    import inspect

    assert list(inspect.signature(relu_ext.relu).parameters) == list(inspect.signature(torch.nn.functional.relu).parameters)


# --- build facts --------------------------------------------------------------

OPS = ["relu", "relu_", "relu_fwd", "relu_fwd_", "relu_bwd"]


def test_cpu_kernels_registered():
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"relu_ext::{op}", "CPU"), op


@pytest.mark.skipif(not _C.with_cuda, reason="built without CUDA kernels")
def test_cuda_kernels_registered():
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"relu_ext::{op}", "CUDA"), op
    assert relu_ext.cuda_available() and relu_ext.build_info()["cuda_arch_list"]


def test_cuda_compiled_where_nvcc_exists():
    # RELU_EXT_SANITIZE=1 implies a CPU-only build (setup.py).
    forced_cpu = "1" in (os.environ.get("RELU_EXT_FORCE_CPU"), os.environ.get("RELU_EXT_SANITIZE"))
    has_nvcc = os.path.exists("/usr/local/cuda/bin/nvcc") or shutil.which("nvcc") is not None
    if forced_cpu or torch.version.cuda is None or not has_nvcc:
        assert not forced_cpu or not _C.with_cuda
        return
    assert _C.with_cuda, "nvcc and a CUDA torch are here, yet the CUDA kernels were not compiled"


def test_sanitizer_build_is_what_it_says():
    """make test-sanitize must run instrumented kernels: a plain build there
    would pass every test and check nothing."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    instrumented = "libasan" in maps and "libubsan" in maps  # libubsan comes only from _C
    assert instrumented == (os.environ.get("RELU_EXT_SANITIZE") == "1")


def test_build_info():
    info = relu_ext.build_info()
    assert info["cpu_isa"] in ("avx2", "scalar") and info["torch"] == torch.__version__
    assert info["cuda"] == relu_ext.cuda_available()
