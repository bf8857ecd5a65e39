"""Checks that have not come back: save_compact() holds a tensor as it is while its form's check runs
on the device, and resolves it later (relu_ext.compact.hooks._Packer). On the CPU a check is back at
once; here every Deferred waits on a stand-in event that the test completes when it chooses, so the
CPU runs what the GPU runs when the device is behind the host."""

from __future__ import annotations

import contextlib
import gc
import random
import sys
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

import relu_ext
from conftest import adversarial, assert_bitwise_equal, assert_same_step, train_step
from relu_ext.compact import forms, hooks, recipes, streams
from relu_ext.compact.deferred import Deferred
from test_deferred import _Net

pytestmark = pytest.mark.native  # the risk it checks: see tests/tiers.py


class _Event:
    """A stand-in for a CUDA event: complete once the test says so (``complete``) or once waited on.
    ``asked`` counts its queries and waits made while ``_Event.capturing`` (a CUDA graph's capture)."""

    capturing = False

    def __init__(self, log: list[_Event]) -> None:
        self.complete = self.waited = False
        self.asked = 0
        log.append(self)

    def query(self) -> bool:
        self.asked += _Event.capturing
        return self.complete

    def synchronize(self) -> None:
        self.asked += _Event.capturing
        self.waited = self.complete = True


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[_Event]]:
    """Every Deferred made meanwhile waits on a stand-in event, listed here in the order made."""
    log: list[_Event] = []
    monkeypatch.setattr(Deferred, "stand_in", lambda: _Event(log))
    yield log


def _come_back(events: list[_Event], packer) -> None:
    """Complete every check, and those made when one resolves (a compaction's next step), resolving
    them without waiting."""
    while packer.waiting:
        for e in events:
            e.complete = True
        packer.poll()
    assert not any(e.waited for e in events)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


X = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(3))


def _reference(model: nn.Module | None = None) -> tuple:
    """The step without hooks."""
    with relu_ext.install():
        return train_step(model or _model(), X, contextlib.nullcontext())


def _step(sc: relu_ext.save_compact) -> tuple:
    return _step_of(_model(), sc)


def _step_of(model: nn.Module, sc: relu_ext.save_compact) -> tuple:
    with relu_ext.install():
        return train_step(model, X, sc)


def test_backward_before_any_check_is_back_is_exact(events):
    """No check comes back during the step: every form stands for its tensor as the tensor itself, and
    backward reads those, bit for bit, without waiting; the counts, read after, wait for the checks
    and equal those of a step whose checks were back at once."""
    sc = relu_ext.save_compact()
    assert_same_step(_step(sc), _reference())
    assert events and not any(e.waited for e in events)
    got = repr(sc)  # (waits for the checks)
    assert all(e.waited or e.complete for e in events)
    Deferred.stand_in = None
    at_once = relu_ext.save_compact()
    _step(at_once)
    assert got == repr(at_once)
    assert sc.replayed and sc.pooled and sc.concatenated and sc.two_valued


def test_checks_resolve_oldest_first_without_waiting(events):
    """poll() resolves the checks that are back in the order they were made: one back before an older
    one waits for it. Nothing is waited for."""
    sc = relu_ext.save_compact()
    with relu_ext.install(), sc:
        loss = _model()(X).square().mean()
    packer = sc._packer
    held = len(packer.waiting)
    assert held >= 3 and held == sum(1 for _ in packer.waiting)
    checks = [e for e in events if not e.complete]
    checks[1].complete = True
    packer.poll()
    assert len(packer.waiting) == held
    checks[0].complete = True
    packer.poll()
    assert len(packer.waiting) == held - 2
    loss.backward()
    assert not any(e.waited for e in events)


@pytest.mark.parametrize("budget", [0, 300_000, 2_000_000])
def test_held_bytes_stay_within_the_budget(events, budget):
    """Past the budget (pending_bytes) the pack hook waits for the oldest checks only, never for one it
    made in this pack (that would wait for the device's newest work: a sync): after a pack the bytes
    held as they are exceed the budget only where every check left was made by the last pack that
    made any, and waits go oldest first."""
    sc = relu_ext.save_compact(pending_bytes=budget)
    packer = sc._packer
    over, made = [], []  # after each pack: past the budget with an older check left; events made so far
    latest: set[int] = set()  # the events of the last pack that made any
    real = packer.pack

    def pack(t):
        before = len(events)
        packed = real(t)
        if len(events) > before:
            latest.clear()
            latest.update(id(e) for e in events[before:])
        older = [c for c in packer.waiting if id(c.check._event) not in latest]
        over.append(packer.waiting_bytes > budget and bool(older))
        made.append(len(events))
        return packed

    torch.autograd.graph.saved_tensors_hooks.__init__(sc, pack, packer.unpack)  # (hooks bound at construction)
    assert_same_step(_step(sc), _reference())
    assert over and not any(over)
    waited = [e.waited for e in events[: made[-1]]]
    assert waited == sorted(waited, reverse=True)  # (a prefix: the oldest)
    assert any(waited) == (budget < 2_000_000)
    assert not waited[-1]  # (the last pack's check: never waited for by the pack hook)


def test_pending_bytes_default_from_the_device(monkeypatch):
    """pending_bytes=None: 1/32 of the tensor's GPU's memory (each GPU its own), 256 MiB on the CPU;
    an int sets it; anything else is refused."""
    memory = {torch.device("cuda", 0): 24 << 30, torch.device("cuda", 1): 80 << 30}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=memory[d]))
    hooks._pending_bytes.cache_clear()
    try:
        assert hooks._pending_bytes(torch.device("cuda", 1)) == (80 << 30) // 32
        assert hooks._pending_bytes(torch.device("cuda", 0)) == (24 << 30) // 32
        assert hooks._pending_bytes(torch.device("cpu")) == 256 << 20
    finally:
        hooks._pending_bytes.cache_clear()
    assert relu_ext.save_compact()._packer.budget is None and relu_ext.save_compact(pending_bytes=7)._packer.budget == 7
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="pending_bytes must be None or an int >= 0"):
            relu_ext.save_compact(pending_bytes=bad)


def test_late_misses_keep_the_tensor(events, monkeypatch):
    """A check that comes back False after the pack hook returned: the form keeps the tensor as it is,
    counted as kept (a replay: a verification miss), and backward is exact before and after."""

    monkeypatch.setattr(recipes._C, "bn_act_verify", lambda *args: torch.tensor(False))
    sc = relu_ext.save_compact()
    with relu_ext.install(), sc:
        loss = _model()(X).float().square().mean()
    _come_back(events, sc._packer)
    loss.backward()
    assert sc.replayed == 0 and sc.replay_misses == 1 and sc.kept_by_reason["not_replayed"] == 1
    assert sc.pooled == 1  # (a recipe reading the missed one's tensor)


def test_an_exception_in_forward_frees_what_was_held(events):
    """The forward raises after some packs: the packer holds the forms it waits for (and their
    tensors) until their checks are resolved, then lets them go with their graph."""
    sc = relu_ext.save_compact()
    model = _model()
    with pytest.raises(RuntimeError, match="stop"), relu_ext.install(), sc:
        y = model.bn1(model.conv1(X)).relu()
        model.pool(y).square()
        raise RuntimeError("stop")
    del y
    forms = {c.form.kind: weakref.ref(c.form) for c in sc._packer.waiting}
    assert set(forms) == {"replayed", "pooled", "two_valued"}  # (the input X, alive, checked as two-valued)
    assert sc.replayed == 1 and sc.pooled == 1  # (waits for the checks)
    gc.collect()
    assert forms["replayed"]() is None and forms["pooled"]() is None
    assert not sc._packer.waiting and sc._packer.waiting_bytes == 0


def test_nested_blocks_hold_their_own(events):
    """An inner block's forms are its own packer's; both resolve, and backward is exact."""

    def run(model: nn.Module, outer, inner) -> list[torch.Tensor]:
        with relu_ext.install(), outer:
            h = model.pool(torch.relu(model.bn1(model.conv1(X))))
            with inner:
                r = torch.relu(model.bn2(model.conv2(h)) + h).square()
            loss = r.mean()
        held = [sc._packer.waiting and True for sc in (outer, inner) if isinstance(sc, relu_ext.save_compact)]
        loss.backward()
        return held, [p.grad for p in model.parameters() if p.grad is not None]

    outer, inner = relu_ext.save_compact(), relu_ext.save_compact()
    held, got = run(_model(), outer, inner)
    _, want = run(_model(), contextlib.nullcontext(), contextlib.nullcontext())
    assert held == [True, True]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert outer.replayed >= 1 and inner.replayed >= 1


class _Checkpointed(nn.Module):
    """_Net with its first convolution and BatchNorm under non-reentrant checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.net
        first = cp.checkpoint(lambda t: m.bn1(m.conv1(t)), x, use_reentrant=False)
        p = m.pool(torch.relu(first))
        r = torch.relu(m.bn2(m.conv2(p)) + p)
        c = nn.functional.relu6(m.bn3(m.conv3(torch.cat([p, r], 1))))
        d = m.conv4(torch.cat([p, r, c], 1))
        return m.fc2(torch.relu(m.fc1(m.drop(d.flatten(1)))))


def test_checkpointing_inside_a_block(events):
    """Non-reentrant checkpointing inside the block, with its checks not back: exact."""
    sc = relu_ext.save_compact()
    assert_same_step(_step_of(_Checkpointed(), sc), _reference(_Checkpointed()))
    assert events and sc.pooled


def test_retain_graph_and_a_second_backward(events):
    """Backward twice over one graph: before any check is back, and after all are (forms then rebuilt)."""
    model = _model()
    sc = relu_ext.save_compact()
    with relu_ext.install(), sc:
        loss = model(X).square().mean()
    first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    sc._packer.settle()
    assert not sc._packer.waiting
    second = torch.autograd.grad(loss, list(model.parameters()))
    ref_model = _model()
    with relu_ext.install():
        ref = torch.autograd.grad(ref_model(X).square().mean(), list(ref_model.parameters()))
    for a, b, c in zip(first, second, ref):
        assert torch.equal(a, c) and torch.equal(b, c)


# --- On a GPU: the real events ---------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")


def _cuda_step(model: nn.Module, x: torch.Tensor, sc) -> list[torch.Tensor]:
    """A training step's forward under install() and `sc`, and its backward, in sync debug mode "error":
    any host sync in either raises. Gradients, as they come."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with relu_ext.install(), sc:
            loss = model(x).float().square().mean()
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [p.grad for p in model.parameters() if p.grad is not None]


def _event_waits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every torch.cuda.Event.synchronize from now on, listed (sync debug mode does not see them)."""
    waits: list[int] = []
    real = torch.cuda.Event.synchronize

    def synchronize(self: torch.cuda.Event) -> None:
        waits.append(1)
        real(self)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", synchronize)
    return waits


@needs_gpu
@pytest.mark.parametrize("arch", ["resnet50", "mobilenet_v2", "densenet121"])
def test_a_cuda_training_step_has_no_host_sync(arch, monkeypatch):
    """Forward and backward of a real model under install() + save_compact(), float32 and bfloat16
    autocast in channels_last, wait for the device nowhere: no sync PyTorch's debug mode sees, and no
    event waited for. With a pending_bytes the step goes past, it waits for old checks' events, and
    still no sync the debug mode sees. (Gradients are compared bitwise elsewhere: a max-pool's CUDA
    backward adds with atomics, so two runs of resnet50 may differ in last bits.)"""
    import torchvision

    waits = _event_waits(monkeypatch)
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)(num_classes=10).cuda()
    x = torch.randn(4, 3, 96, 96, device="cuda")
    sc = relu_ext.save_compact()
    got = _cuda_step(model, x, sc)
    assert not waits  # (before the counts: reading them waits for every check)
    assert len(got) == len(list(model.parameters())) and sc.compacted + sc.replayed > 0, sc.report()
    model = model.to(memory_format=torch.channels_last)
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        sc = relu_ext.save_compact()
        _cuda_step(model, x, sc)
    assert not waits
    assert sc.compacted + sc.replayed > 0, sc.report()
    sc = relu_ext.save_compact(pending_bytes=1 << 20)  # (past it: waits for old checks, each an event)
    _cuda_step(model, x, sc)
    assert waits, sc.report()


def _cuda_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of train_step under install() alone, on the model's device."""
    with relu_ext.install():
        return train_step(model, x, contextlib.nullcontext())[1]


@needs_gpu
@pytest.mark.parametrize("back", [False, True], ids=["pending", "back"])
def test_a_side_stream_forward_is_exact(back):
    """The forward on a side stream (forms made, and filled, there), backward from the default one,
    with the checks still out or all back (every form then rebuilt): PyTorch's gradients, bitwise."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        model, x = _model().cuda(), X.cuda()
        want = _cuda_reference(_model().cuda(), x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        sc = relu_ext.save_compact()
        with torch.cuda.stream(side), relu_ext.install(), sc:
            torch.manual_seed(1)
            loss = model(x).float().square().mean()
        assert all(f.stream == side for f in (c.form for c in sc._packer.waiting))
        torch.cuda.current_stream().wait_stream(side)
        if back:
            sc._packer.settle()
            assert not sc._packer.waiting
        loss.backward()
        got = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sc.compacted >= 2 and sc.replayed + sc.replay_misses and sc.pooled and sc.concatenated, sc.report()


@needs_gpu
def test_every_form_rebuilt_on_cuda_is_exact():
    """The rebuild path on CUDA, forced: every check back before backward, so every form is rebuilt
    from what it keeps, not read from the tensor it held; PyTorch's gradients, bitwise."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        model, x = _model().cuda(), X.cuda()
        want = _cuda_reference(_model().cuda(), x)
        sc = relu_ext.save_compact()
        with relu_ext.install(), sc:
            torch.manual_seed(1)
            loss = model(x).float().square().mean()
        sc._packer.settle()
        loss.backward()
        got = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sc.compacted >= 2 and sc.replayed + sc.replay_misses and sc.pooled and sc.concatenated, sc.report()
    assert sc.two_valued, sc.report()


@needs_gpu
@pytest.mark.parametrize("back", [True, False], ids=["rebuilt", "held"])
def test_remade_ops_on_cuda_are_exact(back):
    """A transformer's MLP under bfloat16 autocast on CUDA: the cast of the LayerNorm's output that the
    first Linear keeps, remade through the LayerNorm with its eps found in steps, the weights' casts
    from the parameters, GELU and the product from what their nodes keep. Every check back before
    backward (each rebuilt), or none (each held as it is): PyTorch's gradients, bitwise."""
    torch.manual_seed(0)
    norm, lin1, lin2 = nn.LayerNorm(256).cuda(), nn.Linear(256, 512).cuda(), nn.Linear(512, 256).cuda()
    x = torch.randn(8, 64, 256, device="cuda", requires_grad=True)
    params = [x, norm.weight, lin1.weight, lin2.weight]

    def loss_of(ctx) -> torch.Tensor:
        with ctx, torch.autocast("cuda", torch.bfloat16):
            h = lin1(norm(x))
            return lin2(nn.functional.gelu(h) * h).float().square().mean()

    want = torch.autograd.grad(loss_of(contextlib.nullcontext()), params)
    sc = relu_ext.save_compact()
    loss = loss_of(sc)
    if back:
        sc._packer.settle()
    got = torch.autograd.grad(loss, params)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sc.remade_by_op == {"_to_copy": 3, "gelu": 1, "mul": 1}, sc.report()


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")
def test_a_step_on_the_second_gpu_while_the_first_is_current(monkeypatch):
    """The model on cuda:1 with cuda:0 current: each check's copy and event on cuda:1's stream (the
    step waits for nothing), the forms made on it, and PyTorch's gradients, bitwise."""
    waits = _event_waits(monkeypatch)
    with torch.cuda.device(0), torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        model, x = _model().to("cuda:1"), X.to("cuda:1")
        want = _cuda_reference(_model().to("cuda:1"), x)
        sc = relu_ext.save_compact()
        with relu_ext.install(), sc:
            torch.manual_seed(1)
            loss = model(x).float().square().mean()
        assert all(c.form.stream.device == torch.device("cuda", 1) for c in sc._packer.waiting)
        loss.backward()
        assert not waits
        got = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sc.compacted and sc.replayed + sc.replay_misses, sc.report()


@needs_gpu
def test_a_forward_returns_while_the_device_is_busy():
    """With a long kernel queued first, a whole forward under save_compact() returns before it ends:
    no check is waited for; backward, before any is back, is exact."""
    model = _model().cuda()
    x = X.cuda()
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e9))  # a few seconds of GPU time
        busy = torch.cuda.Event()
        busy.record()
        sc = relu_ext.save_compact()
        with relu_ext.install(), sc:
            torch.manual_seed(1)
            loss = model(x).square().mean()
        assert not busy.query() and sc._packer.waiting
        loss.backward()
        got = [p.grad.clone() for p in model.parameters()]
        ref = _model().cuda()
        with relu_ext.install():
            want = train_step(ref, x, contextlib.nullcontext())[1]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sc.replayed + sc.replay_misses > 0 and sc.compacted > 0


@needs_gpu
def test_capture_in_a_cuda_graph_keeps_tensors_as_they_are():
    """Under CUDA-graph capture the hooks keep what is saved as it is: nothing to wait for in a replay."""
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    x = torch.randn(64, 256, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(x).sum().backward()  # (warm-up, as capture asks)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    sc = relu_ext.save_compact()
    with torch.cuda.graph(graph), sc:
        out = model(x)
    assert sc.compacted == 0 and sc.kept == 0 and not sc._packer.waiting
    graph.replay()
    assert torch.equal(out, model(x))


def test_unpacks_on_several_threads_while_checks_come_back(events, monkeypatch):
    """Backward of eight graphs made in one block, each on a thread of its own (as autograd runs a
    device's backward), while another thread completes checks in random order: no check resolves
    twice, no held byte is lost, and every gradient is exact. Many rounds, with the interpreter
    switching threads every 10 microseconds."""
    reference = _reference()
    asked = _Event.query

    def query(self: _Event) -> bool:
        time.sleep(0)  # (a query takes time, as cudaEventQuery does: another thread may run meanwhile)
        return asked(self)

    monkeypatch.setattr(_Event, "query", query)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for round_ in range(10):
            models = [_model() for _ in range(8)]
            sc = relu_ext.save_compact()
            losses = []
            with relu_ext.install(), sc:
                for m in models:
                    torch.manual_seed(1)  # (train_step's seed: the same dropout noise)
                    losses.append(m(X).float().square().mean())
            packer, errors, done = sc._packer, [], threading.Event()
            assert packer.waiting

            def backward(loss: torch.Tensor) -> None:
                try:
                    loss.backward()
                except BaseException as e:  # (reported below: a thread's exception is not raised by join)
                    errors.append(e)

            def come_back(rng: random.Random) -> None:
                while not done.wait(1e-4):
                    for e in events:  # (about half of what is out comes back at once)
                        e.complete = e.complete or rng.random() < 0.5

            threads = [threading.Thread(target=backward, args=(loss,)) for loss in losses]
            helper = threading.Thread(target=come_back, args=(random.Random(round_),))
            for t in (helper, *threads):
                t.start()
            for t in threads:
                t.join()
            done.set()
            helper.join()
            assert not errors, errors
            assert packer.waiting_bytes == sum(c.nbytes for c in packer.waiting)
            assert len({id(c) for c in packer.waiting}) == len(packer.waiting)
            for m in models:
                grads = [p.grad for p in m.parameters()]
                assert all(torch.equal(a, b) for a, b in zip(grads, reference[1])), round_
            assert sc.replayed == 8 and sc.pooled == 8 and packer.waiting_bytes == 0
    finally:
        sys.setswitchinterval(interval)


def test_nothing_asks_the_device_under_cuda_graph_capture(events, monkeypatch):
    """Checks made before a capture began (on the device) are pending while it runs: packs (of CPU
    tensors too, past the budget too), unpacks and the block's exit query none of their events and
    wait for none while capturing (either would end the capture in an error); they resolve after
    it, and backward is exact. (Under capture, a CUDA tensor is kept as it is, and a CPU tensor's
    checks are back at once: their stand-ins do not count.)"""
    monkeypatch.setattr(hooks, "_capturing", lambda: _Event.capturing)
    monkeypatch.setattr(_Event, "capturing", False)

    before: list[_Event] = []

    def step(model: nn.Module, sc: relu_ext.save_compact | None) -> list[torch.Tensor]:
        with relu_ext.install(), sc or contextlib.nullcontext():
            y = model.bn1(model.conv1(X)).relu()
            if sc is not None:
                assert sc._packer.waiting  # (the recipe's check)
                before.extend(events)
                _Event.capturing, sc._packer.budget = True, 0  # (past it at each pack)
            loss = model.fc2(torch.relu(model.fc1(model.pool(y).flatten(1)))).square().mean()
        loss.backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    sc = relu_ext.save_compact()
    got = step(_model(), sc)
    assert sum(e.asked for e in before) == 0 and any(not e.complete for e in before)
    _Event.capturing = False
    want = step(_model(), None)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert sc.replayed == 1 and sc.compacted == 1  # (resolved once the capture is over)


def test_changed_in_place_before_its_check_is_back(events):
    """A compacted tensor changed in place before its count came back is not compacted from the new
    data: kept as it is, backward raises PyTorch's in-place error, as it does without hooks."""
    lin = nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    sc = relu_ext.save_compact()
    with relu_ext.install(), sc:
        h = torch.relu(x * 1)
        loss = lin(h).sum()
    with torch.no_grad():
        h.add_(1)
    _come_back(events, sc._packer)
    assert sc.compacted == 0 and sc.kept_by_reason["unsupported"] == 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _forms_made(monkeypatch: pytest.MonkeyPatch, hold: bool = True) -> list[tuple[torch.Tensor | None, forms._Shared]]:
    """Every form made from now on, with the tensor it stands for where `hold` (which keeps it alive)."""
    made: list[tuple[torch.Tensor | None, forms._Shared]] = []
    init = forms._Shared.__init__

    def spy(self, t, *args, **kwargs):
        made.append((t if hold else None, self))
        init(self, t, *args, **kwargs)

    monkeypatch.setattr(forms._Shared, "__init__", spy)
    return made


@pytest.mark.parametrize("changed", [True, False], ids=["changed", "unchanged"])
@pytest.mark.parametrize("then", ["alive", "freed"])
@pytest.mark.parametrize("back", ["pending", "back", "back_after"])
@pytest.mark.parametrize("kind", ["compacted", "replayed", "pooled", "concatenated", "two_valued"])
def test_changed_in_place_after_the_forward(events, monkeypatch, kind, back, then, changed):
    """A saved tensor kept in a form, changed in place after the forward: backward raises PyTorch's
    in-place error whether or not its check has come back (`back`: before the change, `back_after`
    it; until then the form holds the tensor itself, and keeps it where it changed meanwhile; after,
    it stands for it weakly, with its version counter), and whether the tensor lives or was freed
    since. Unchanged, the same step is PyTorch's."""
    sc = relu_ext.save_compact()
    packer = sc._packer
    formed = _forms_made(monkeypatch)
    model = _model()
    torch.manual_seed(1)
    with relu_ext.install(), sc:
        loss = model(X).float().square().mean()
    t, form = next((t, p) for t, p in formed if p.kind == kind and t is not X  # (X: no noise)
                   and (kind != "concatenated" or len(p.pieces) > 1))  # (the first of a chain holds the tensor)
    formed.clear()
    if back == "back":
        _come_back(events, packer)
    assert (form.whole is None) == (back == "back")
    if changed:
        with torch.no_grad():
            t.add_(1)
    if back == "back_after":
        _come_back(events, packer)
        assert (form.whole is not None) == changed  # (kept as it is where it changed before its check)
    if then == "freed":
        alive = weakref.ref(t)
        del t
        assert alive() is None
    if changed:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
        return
    loss.backward()
    assert_same_step((loss.detach(), [p.grad for p in model.parameters()]), _reference())


class _Streams(streams.Streams):
    """Streams named on the CPU: ``current`` is the one work runs on now. Records the work run on a
    form's stream (``ran``: the caller and the stream), the waits of one stream for another
    (``waits``), and the tensors marked as in use on the waiting stream (``marked``, ids)."""

    def __init__(self) -> None:
        self.current = "forward"
        self.ran: list[tuple[str, str]] = []
        self.waits: list[tuple[str, str]] = []
        self.marked: set[int] = set()

    def of(self, t: torch.Tensor) -> str:
        return self.current

    def on(self, stream: str) -> contextlib.AbstractContextManager:
        self.ran.append((sys._getframe(1).f_code.co_name, stream))
        return self._switched(stream)

    @contextlib.contextmanager
    def _switched(self, stream: str) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before

    def after(self, stream: str, tensors) -> None:
        if stream != self.current:
            self.waits.append((self.current, stream))
            self.marked.update(id(t) for t in tensors)


def test_forms_are_filled_on_their_stream_and_read_after_it(events, monkeypatch):
    """On CUDA a form is made on the forward's stream, and its checks may come back, and backward run,
    on another. With streams named on the CPU: the work that fills a form later (a compaction once
    its count is back, an integer tensor's range and narrowing) runs on the form's stream, and each
    rebuild on another stream first waits for the form's and marks what it reads as in use there."""
    named = _Streams()
    monkeypatch.setattr(forms, "STREAMS", named)
    made = _forms_made(monkeypatch, hold=False)
    model = _model()
    torch.manual_seed(1)
    with relu_ext.install(), relu_ext.save_compact() as sc:
        loss = model(X).float().square().mean()
    named.current = "backward"
    _come_back(events, sc._packer)
    sc._packer.settle()
    loss.backward()
    assert_same_step((loss.detach(), [p.grad for p in model.parameters()]), _reference())
    made_forms = [f for _, f in made]
    assert {f.kind for f in made_forms} >= {"compacted", "replayed", "pooled", "concatenated", "narrowed", "two_valued"}
    assert all(f.stream == "forward" for f in made_forms)
    assert {caller for caller, _ in named.ran} == {"checked", "measure", "settle"}
    assert {stream for _, stream in named.ran} == {"forward"}
    assert named.waits and set(named.waits) == {("backward", "forward")}
    rebuilt = [f for f in made_forms  # (a Narrowed form not narrowed holds the tensor: nothing to rebuild)
               if f.whole is None and (f.kind != "narrowed" or f.narrow is not None)]
    assert {f.kind for f in rebuilt} >= {"compacted", "replayed", "pooled", "concatenated", "narrowed", "two_valued"}
    assert {id(t) for f in rebuilt for t in f._reads()} <= named.marked


def test_checks_come_back_in_the_middle_of_backward(events, monkeypatch):
    """Checks come back while backward runs: at every third unpack, half of those still out complete
    first. Forms switch from the tensor they held to their rebuild between one unpack and the next,
    nothing is waited for, and the step is exact."""
    sc = relu_ext.save_compact()
    model = _model()
    torch.manual_seed(1)
    with relu_ext.install(), sc:
        loss = model(X).float().square().mean()
    packer = sc._packer
    out_at_start = len(packer.waiting)
    assert out_at_start >= 3
    polls, left = 0, []
    poll = hooks._Packer.poll

    def completing(self: hooks._Packer) -> None:
        nonlocal polls
        polls += 1
        if polls % 3 == 0:
            out = [e for e in events if not e.complete]
            for e in out[: (len(out) + 1) // 2]:
                e.complete = True
        poll(self)
        left.append(len(self.waiting))

    monkeypatch.setattr(hooks._Packer, "poll", completing)
    loss.backward()
    assert left[0] == out_at_start and any(0 < n < out_at_start for n in left) and not any(e.waited for e in events)
    assert_same_step((loss.detach(), [p.grad for p in model.parameters()]), _reference())


def test_a_late_miss_of_the_nodes_mask_compacts_with_a_bitmap(events):
    """relu_ext's mask does not restore relu(-0.0) = -0.0; found after the pack hook returned, the
    tensor gets its own bitmap, counted again, and backward is exact."""
    lin = nn.Linear(256, 256)
    x = torch.randn(64, 256)
    x[::2] = -0.0  # (its mask bit is 0, its value not +0)
    x.requires_grad_()
    sc = relu_ext.save_compact()
    with relu_ext.install(), sc:
        loss = lin(torch.relu(x * 1)).square().sum()
    made = len(events)
    _come_back(events, sc._packer)
    assert len(events) == made + 2  # (after the count: the mask's check, then the bitmap's count)
    loss.backward()
    got = x.grad, lin.weight.grad
    x.grad = lin.weight.grad = None
    lin(torch.relu(x * 1)).square().sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], lin.weight.grad)
    assert sc.compacted == 1


def test_double_backward_before_any_check_is_back(events):
    """Gradients of gradients (create_graph=True), the checks not back: PyTorch's, bit for bit."""

    def run(sc) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 256), nn.Softplus(),
                            nn.Linear(256, 1))
        x = torch.randn(128, 64, generator=torch.Generator().manual_seed(1))
        with sc:
            loss = net(x).square().mean()
        grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
        sum(g.square().sum() for g in grads).backward()
        return [p.grad for p in net.parameters()]

    sc = relu_ext.save_compact()
    got = run(sc)
    assert events and not any(e.waited for e in events)
    want = run(contextlib.nullcontext())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sc.replayed == 1


@pytest.mark.parametrize("back", [True, False], ids=["back", "not_back"])
@pytest.mark.parametrize("eps", [1e-5, 1e-12, 1e-3], ids=["eps1e-5", "eps1e-12", "eps_unknown"])
def test_a_cast_of_a_layer_norm_output_is_remade_in_steps(events, eps, back):
    """Where checks come back later (as on CUDA), the bfloat16 cast of a LayerNorm output that a Linear
    keeps under autocast is remade through the LayerNorm in steps, its eps found without a wait: the
    probe of which eps give the node's rstd, then each of those in turn on the whole tensor. Backward
    before or after the checks are back: PyTorch's gradients, bit for bit; an eps it does not try
    keeps the cast as it is; nothing waited for."""
    torch.manual_seed(0)
    norm, lin = nn.LayerNorm(256, eps=eps), nn.Linear(256, 64)
    x = torch.randn(4, 32, 256) * 3 + 1
    x[1, :2] = adversarial(2 * 256, torch.float32).view(2, 256)  # (rows of NaN, ±inf, ±0, denormals)
    x.requires_grad_()
    params = [x, lin.weight, norm.weight]

    def loss_of(ctx) -> torch.Tensor:
        with ctx, torch.autocast("cpu", torch.bfloat16):
            return lin(norm(x)).nan_to_num().float().sum()

    want = torch.autograd.grad(loss_of(contextlib.nullcontext()), params)
    sc = relu_ext.save_compact()
    loss = loss_of(sc)
    if back:
        _come_back(events, sc._packer)
    got = torch.autograd.grad(loss, params)
    assert not any(e.waited for e in events)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"gradient {i}")
    # (The Linear's weight cast is remade from the parameter; the LayerNorm output's, where eps is tried.)
    assert sc.remade_by_op == {"_to_copy": 1 if eps == 1e-3 else 2}, sc.report()


@pytest.mark.parametrize("back", [False, True], ids=["backward-first", "back-first"])
def test_a_widening_casts_copy_gives_way_once_its_comparison_is_back(events, back):
    """Where values come back later (as on CUDA): at the exit the widened cast's copy (forms.Widened) is
    compared with its input, which a later node keeps. Until that comparison and the cast's own check
    are back, the form holds its copy, and a backward reads that; once they are (the next poll, without
    waiting), it reads the input and holds nothing. PyTorch's gradients, bit for bit, either way."""
    leaf = adversarial(65536, torch.bfloat16, seed=10).nan_to_num().requires_grad_()
    w = torch.randn(65536, dtype=torch.bfloat16, requires_grad=True)

    def loss_of(ctx) -> torch.Tensor:
        with ctx:
            h = leaf.flip(0)
            return h.to(torch.float32).pow(2).sum() + (h * w).float().sum()

    want = torch.autograd.grad(loss_of(contextlib.nullcontext()), [leaf, w])
    sc = relu_ext.save_compact()
    loss = loss_of(sc)
    packer = sc._packer
    (form,) = [f for f in packer.after_exit if isinstance(f, forms.Widened)]
    assert form.own and form.same is not None  # (the copy, while the comparison is out)
    if back:
        for e in events:
            e.complete = True
        packer.poll()
        assert not form.own and not packer.after_exit
    got = torch.autograd.grad(loss, [leaf, w])
    assert not any(e.waited for e in events)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, f"gradient {i}")
    assert bool(form.own) is not back
    assert "held in 0 B" in next(line for line in sc.report().splitlines() if "remade:" in line)  # (waits)
