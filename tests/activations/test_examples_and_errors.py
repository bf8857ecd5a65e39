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
from relu_ext import _C
from conftest import DEVICES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import two_layer_net  # noqa: E402

pytestmark = pytest.mark.native  # the risk it checks: see tests/tiers.py


@pytest.mark.parametrize("device", DEVICES)
def test_two_layer_net_same_trajectory(device):
    ref = two_layer_net.train(torch.relu, device=device)
    ours = two_layer_net.train(relu_ext.relu, device=device)
    assert len(ours) == 500
    assert ours == ref, "loss trajectories differ"
    assert ours[-1] < ours[0] / 1000, f"loss fell only {ours[0] / ours[-1]:.3g}x"


# --- bad inputs ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.uint16, torch.float8_e4m3fn], ids=str)
def test_unsupported_dtype_behaves_as_torch(dtype):
    """A dtype relu_ext has no kernel for goes to PyTorch's own op, so it gets
    exactly torch's error: the same type (an `except` that catches torch's
    catches ours; torch 2.11 raises RuntimeError for bool, 2.14
    NotImplementedError) and the same message; or, where this torch has a
    kernel (uint16 since torch 2.15), its result."""
    x = torch.tensor([0, 1, 1, 0]).to(dtype)
    pairs = ((lambda: torch.relu(x.clone()), lambda: relu_ext.relu(x.clone())),
             (lambda: torch.relu_(x.clone()), lambda: relu_ext.relu(x.clone(), inplace=True)),
             (lambda: torch.nn.ReLU()(x.clone()), lambda: relu_ext.ReLU()(x.clone())))
    for theirs_call, ours_call in pairs:
        try:
            want = theirs_call()
        except RuntimeError as theirs:
            with pytest.raises(RuntimeError) as ours:
                ours_call()
            assert type(ours.value) is type(theirs)
            assert str(ours.value) == str(theirs)
        else:
            got = ours_call()
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_mask_ops_refuse_integers():
    x = torch.arange(-4, 4, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="relu_ext::relu_fwd: x has dtype Int.*gradient mask, for float32.*integer tensors carry no gradient"):
        torch.ops.relu_ext.relu_fwd(x)


# relu / relu_ hand sparse, quantized, nested, mkldnn and other-device tensors
# to torch.relu (tests/activations/test_install.py); the training pieces, which have no
# PyTorch counterpart, refuse them by name.
@pytest.mark.parametrize("make", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr], ids=["coo", "csr"])
def test_sparse_layout_in_training_pieces(make):
    x = make(torch.randn(3, 3))
    for call in (lambda: torch.ops.relu_ext.relu_fwd(x), lambda: torch.ops.relu_ext.relu_fwd_(x)):
        with pytest.raises(RuntimeError, match="x has layout Sparse.*supports strided \\(dense\\) tensors only"):
            call()


class _OnDevice(torch.Tensor):
    """A tensor that claims to live on a device this machine lacks."""

    @staticmethod
    def __new__(cls, device: str):
        return torch.Tensor._make_wrapper_subclass(cls, (3,), dtype=torch.float32, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} reached a kernel")


@pytest.mark.parametrize("device", ["xpu", "mps", "privateuseone"])
def test_device_without_kernels_is_reported_by_training_pieces(device):
    with pytest.raises(RuntimeError, match=f"x is on {device}.*kernels for CPU and CUDA tensors only"):
        torch.ops.relu_ext.relu_fwd(_OnDevice(device))


@pytest.mark.skipif(_C.with_cuda, reason="this build has CUDA kernels")
def test_cpu_only_build_explains_a_cuda_tensor():
    """The CUDA-key kernels of a CPU-only build say why (called directly: no GPU is needed)."""
    for op, args in ((torch.ops.relu_ext.relu.default, (torch.randn(3),)),
                     (torch.ops.relu_ext.relu_bwd.default, (torch.randn(3), torch.zeros(1, dtype=torch.uint8))),
                     (torch.ops.relu_ext.hardtanh_fwd.default, (torch.randn(3), 0.0, 6.0))):
        with pytest.raises(RuntimeError, match="input is on CUDA, but this relu_ext build has CPU kernels only"):
            op._op_dk(torch._C.DispatchKey.CUDA, *args)


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


@pytest.mark.skipif(_C.with_cuda, reason="this build has CUDA kernels")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
def test_cuda_tensor_on_cpu_only_build():
    with pytest.raises(RuntimeError, match="this relu_ext build has CPU kernels only"):
        relu_ext.relu(torch.randn(3, device="cuda"))


def test_bad_cpu_isa_name():
    with pytest.raises(RuntimeError, match="unknown CPU kernel set 'sse9'"):
        _C.set_cpu_isa("sse9")


@pytest.mark.skipif(not _C.with_cuda, reason="built without CUDA kernels")
def test_cuda_unroll_choice():
    """The CUDA kernels' unroll (tests and tuning) takes 1, 2 or 4, nothing else."""
    previous = _C.cuda_unroll()
    try:
        for rows in (1, 2, 4):
            _C.set_cuda_unroll(rows)
            assert _C.cuda_unroll() == rows
        for bad in (0, 3, 8, -1):
            with pytest.raises(ValueError, match=f"takes 1, 2 or 4 rows per warp, not {bad}"):
                _C.set_cuda_unroll(bad)
            assert _C.cuda_unroll() == 4
    finally:
        _C.set_cuda_unroll(previous)


@pytest.mark.skipif(not _C.with_cuda, reason="built without CUDA kernels")
def test_cuda_waves_choice():
    """The CUDA grid cap (tests and tuning) is off by default (0) and takes 0 to 64 waves,
    nothing else."""
    previous = _C.cuda_waves()
    assert previous == 0 and relu_ext.build_info()["cuda_waves"] == 0
    try:
        for waves in (1, 2, 64, 0):
            _C.set_cuda_waves(waves)
            assert _C.cuda_waves() == waves and relu_ext.build_info()["cuda_waves"] == waves
        for bad in (-1, 65, 1 << 40):
            with pytest.raises(ValueError, match=f"takes 0 \\(no cap\\) to 64 waves, not {bad}"):
                _C.set_cuda_waves(bad)
            assert _C.cuda_waves() == 0
    finally:
        _C.set_cuda_waves(previous)


@pytest.mark.skipif(_C.with_cuda, reason="this build has CUDA kernels")
def test_cuda_unroll_without_cuda_kernels():
    for call in (_C.cuda_unroll, lambda: _C.set_cuda_unroll(2), _C.cuda_waves, lambda: _C.set_cuda_waves(0)):
        with pytest.raises(RuntimeError, match="this build has no CUDA kernels"):
            call()
    assert relu_ext.build_info()["cuda_unroll"] is None and relu_ext.build_info()["cuda_waves"] is None


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
    assert b"relu_ext" in pickle.dumps(model) and b"relu_ext.activations" not in pickle.dumps(model)


def test_convert_and_revert():
    """convert swaps exactly nn.ReLU (not subclasses, not other activations),
    keeps inplace, hooks and sharing; revert undoes it."""

    class MyReLU(torch.nn.ReLU):
        pass

    shared = torch.nn.ReLU(inplace=True)
    calls = []
    shared.register_forward_hook(lambda *args: calls.append(1))
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), shared, torch.nn.Sequential(torch.nn.Linear(4, 4), shared, torch.nn.ReLU()),
        MyReLU(), torch.nn.GELU(),
    )
    model.eval()
    x = torch.randn(3, 4)
    want = model(x)
    assert relu_ext.convert(model) is model
    assert type(model[1]) is relu_ext.ReLU and model[1].inplace and model[1] is model[2][1]
    assert type(model[2][2]) is relu_ext.ReLU and not model[2][2].inplace and not model[1].training
    assert type(model[3]) is MyReLU and type(model[4]) is torch.nn.GELU
    calls.clear()
    assert torch.equal(model(x), want) and len(calls) == 2  # the hook came along, called at both uses
    assert relu_ext.revert(model) is model
    assert type(model[1]) is torch.nn.ReLU and model[1] is model[2][1] and model[1].inplace
    assert type(relu_ext.convert(torch.nn.ReLU())) is relu_ext.ReLU


def test_quantization_fusion_takes_converted_and_reverted_models():
    """fuse_modules matches nn.ReLU by type: a converted model's relu_ext.ReLU is registered with it
    (relu_ext.quantization), and the fused module holds PyTorch's own ReLU either way."""
    from torch.ao.quantization import fuse_modules

    for before in (lambda m: m, relu_ext.revert):
        model = relu_ext.convert(
            torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).eval()
        )
        fused = fuse_modules(before(model), [["0", "1", "2"]])
        assert type(fused[0]).__name__ == "ConvReLU2d" and type(fused[0][1]) is torch.nn.ReLU


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
    assert relu_ext.build_info()["cuda"] and relu_ext.build_info()["cuda_arch_list"]


def test_cuda_compiled_where_nvcc_exists():
    # RELU_EXT_SANITIZE=1 implies a CPU-only build (setup.py).
    forced_cpu = "1" in (os.environ.get("RELU_EXT_FORCE_CPU"), os.environ.get("RELU_EXT_SANITIZE"))
    has_nvcc = os.path.exists("/usr/local/cuda/bin/nvcc") or shutil.which("nvcc") is not None
    if forced_cpu or torch.version.cuda is None or not has_nvcc:
        assert not forced_cpu or not _C.with_cuda
        assert _C.with_cuda or relu_ext.build_info()["cpu_only_reason"]
        return
    assert _C.with_cuda, "nvcc and a CUDA torch are here, yet the CUDA kernels were not compiled"


def test_sanitizer_build_is_what_it_says():
    """make test-sanitize must run instrumented kernels: a plain build there
    would pass every test and check nothing."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    instrumented = "libasan" in maps and "libubsan" in maps  # libubsan comes only from _C
    assert instrumented == (os.environ.get("RELU_EXT_SANITIZE") == "1")

