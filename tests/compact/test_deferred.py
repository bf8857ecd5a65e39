"""The deferred result (relu_ext.compact.deferred): the one place where save_compact()'s host code
reads a device value, and a tripwire that finds any other read in a training step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import relu_ext
from relu_ext.compact.deferred import CudaCopies, Deferred

PACKAGE = Path(relu_ext.__file__).resolve().parent
DEFERRED = PACKAGE / "compact" / "deferred.py"
# The ways Python code reads a tensor's value on the host (each waits for the device on CUDA).
READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero")


def test_deferred_on_the_cpu_is_done_at_once():
    flag, ints = Deferred(torch.tensor(True)), Deferred(torch.tensor([-3, 7], dtype=torch.int64))
    assert flag.done() and flag.flag() is True and not Deferred(torch.tensor(False)).flag()
    assert ints.done() and ints.ints() == [-3, 7] and all(type(v) is int for v in ints.ints())
    assert torch.equal(ints.get(), torch.tensor([-3, 7]))


@pytest.mark.skipif(not relu_ext.cuda_available(), reason="no GPU visible")
def test_deferred_on_cuda_waits_for_its_event_only():
    """A value queued after a long kernel is not done until the kernel ends; done() does not block."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time
    value = torch.tensor([5, 6], device="cuda") * 2
    d = Deferred(value)
    assert not d.done()  # returned at once, while the sleep runs
    assert d.ints() == [10, 12] and d.done()


class _Recorder(CudaCopies):
    """A stand-in for Deferred's CUDA calls that records the device and stream each used; a
    stream is named by its device."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def stream(self, device: torch.device) -> str:
        return f"current stream of {device}"

    def copy(self, value: torch.Tensor, stream: str) -> torch.Tensor:
        self.calls.append(("copy", str(value.device), stream))
        return torch.full(value.shape, 7, dtype=value.dtype)

    def event(self, stream: str) -> "_Done":
        self.calls.append(("event", stream))
        return _Done()


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def test_deferred_copies_and_records_on_the_values_own_device_and_stream(monkeypatch: pytest.MonkeyPatch):
    """With the value on cuda:1 while cuda:0 is current, the copy and the event after it are both on
    cuda:1's current stream: an event on cuda:0's would not wait for the copy."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    recorder = _Recorder()
    monkeypatch.setattr(Deferred, "cuda", recorder)
    with FakeTensorMode():
        value = torch.zeros(2, dtype=torch.int64, device="cuda:1")  # (a CUDA tensor without a GPU)
    d = Deferred(value)
    assert recorder.calls == [("copy", "cuda:1", "current stream of cuda:1"), ("event", "current stream of cuda:1")]
    assert d.done() and d.ints() == [7, 7]


class _Net(nn.Module):
    """Every form save_compact() keeps: BatchNorm recipes (ReLU and ReLU6, a residual add), a max-pool
    recipe and its narrowed indices, a concatenation in pieces, compaction with the ReLU's own mask,
    CPU dropout's noise as a bitmap (CUDA's bool mask too), and a dropout of a ReLU output compacted
    (on the CPU a product with the noise, on CUDA native_dropout's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv3, self.bn3 = nn.Conv2d(16, 8, 1), nn.BatchNorm2d(8)
        self.conv4 = nn.Conv2d(24, 8, 1)
        self.fc1, self.fc2, self.fc3 = nn.Linear(8 * 16 * 16, 512), nn.Linear(512, 10), nn.Linear(512, 10)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pool(torch.relu(self.bn1(self.conv1(x))))
        r = torch.relu(self.bn2(self.conv2(p)) + p)
        c = nn.functional.relu6(self.bn3(self.conv3(torch.cat([p, r], 1))))
        d = self.conv4(torch.cat([p, r, c], 1))  # (DenseNet's: each concatenation extends the one before)
        a = self.fc1(self.drop(d.flatten(1)))
        return self.fc2(torch.relu(a)) + self.fc3(self.drop(torch.relu(-a)))  # (the second: kept by no node)


def _spy(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """Record each host read of a tensor made directly by relu_ext's code outside deferred.py."""

    def wrap(name: str, real):
        def spy(*args, **kwargs):
            frame = sys._getframe(1)
            path = Path(frame.f_code.co_filename).resolve()
            if PACKAGE in path.parents and path != DEFERRED:
                calls.append(f"{name} at {path.relative_to(PACKAGE)}:{frame.f_lineno}")
            return real(*args, **kwargs)

        return spy

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(f"Tensor.{name}", getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "equal", wrap("torch.equal", torch.equal))


def test_the_tripwire_fires(monkeypatch):
    """A read from a file of the package is recorded (the test below could fail)."""
    calls: list[str] = []
    _spy(monkeypatch, calls)
    code = compile("bool(t); t.item(); t.tolist(); torch.equal(t, t)", str(PACKAGE / "compact" / "hooks.py"), "exec")
    exec(code, {"t": torch.ones(1), "torch": torch})
    assert [c.split(" at ")[0] for c in calls] == ["Tensor.__bool__", "Tensor.item", "Tensor.tolist", "torch.equal"]


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "compact_only"])
def test_no_host_read_outside_the_deferred_result(monkeypatch, recompute):
    """A training step under install() + save_compact() reads device values only through Deferred."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(8, 3, 32, 32)
    calls: list[str] = []
    _spy(monkeypatch, calls)
    with relu_ext.install(), relu_ext.save_compact(recompute=recompute) as sc:
        loss = model(x).square().mean()
    loss.backward()
    monkeypatch.undo()
    assert calls == [], calls
    forms = {"compacted": sc.compacted, "narrowed": sc.narrowed, "two_valued": sc.two_valued}
    if recompute:
        forms.update(replayed=sc.replayed, pooled=sc.pooled, concatenated=sc.concatenated)
    assert all(forms.values()), (forms, sc.report())
    # (With recompute: a ReLU output, with its mask, and a dropout of one, with its bitmap; the rest rebuilt.)
    assert sc.compacted == 2 or not recompute, sc.report()
