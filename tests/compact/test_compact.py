"""relu_ext.save_compact(): ReLU outputs saved as bitmap + values, restored bit for bit; every
other saved tensor as usual, with PyTorch's in-place check."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import relu_ext
from relu_ext import _C, compact
from relu_ext.compact import forms, hooks
from conftest import DEVICES, DTYPES, INT_OF, adversarial, assert_bitwise_equal, assert_same_step, train_step

pytestmark = [pytest.mark.native, pytest.mark.torch_version]  # the risk it checks: see tests/tiers.py


# --- the ops: relu_ext::compact / expand / nonzero_mask ------------------------------------

_ops = torch.ops.relu_ext
_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
# Around the CPU kernels' chunks (32768 elements) and mask bytes, and several chunks in parallel.
OP_SIZES = [0, 1, 7, 8, 9, 63, 65, 32767, 32768, 32769, 32768 * 3 + 5, 300_001]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as integers."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset()).view(_INT[t.element_size()])


def _keep(mask: torch.Tensor, n: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(mask.cpu().numpy(), bitorder="little")[:n].astype(bool)).to(mask.device)


def _packbits(keep: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.packbits(keep.cpu().numpy(), bitorder="little")).to(keep.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", OP_SIZES)
def test_ops_against_a_reference(n, dtype, device, cpu_isa):
    """Every CPU kernel set (cpu_isa) and CUDA, on data with every special value,
    and on masks from relu, of nonzero bits, random (with set bits past n),
    all set and none set (nothing kept: empty values)."""
    x = adversarial(n, dtype, device, seed=n)
    y = torch.relu(x)
    bits = _bits(y)
    nonzero = _ops.nonzero_mask(y)
    assert torch.equal(nonzero, _packbits(bits != 0))
    _, relu_mask = _ops.relu_fwd(x)
    g = torch.Generator().manual_seed(n)
    random_mask = torch.randint(0, 256, ((n + 7) // 8,), generator=g, dtype=torch.uint8).to(device)
    full, empty = torch.full_like(random_mask, 255), torch.zeros_like(random_mask)
    for mask in (relu_mask, nonzero, random_mask, full, empty):
        keep = _keep(mask, n)
        values, missed = _ops.compact(y, mask)
        assert values.dtype == dtype and values.shape == (int(keep.sum()),)
        assert torch.equal(_bits(values), bits[keep])
        assert missed.item() == int((bits[~keep] != 0).sum())
        restored = _ops.expand(values, mask, y.shape, y.stride())
        assert torch.equal(_bits(restored), torch.where(keep, bits, 0))
        if mask is empty:
            assert missed.item() == int((bits != 0).sum()) and (missed.item() > 0 or n < 64)
        _check_two_steps(y, mask, values, missed, restored)


def _check_two_steps(y: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, missed: torch.Tensor,
                     restored: torch.Tensor) -> None:
    """compact_count + compact_into give compact's values and missed; expand without its host check
    gives the same; values of another size give a nonzero missed, and nothing is written past them."""
    ends = _ops.compact_count(y, mask)
    assert ends.dtype == torch.int64 and ends.dim() == 1 and ends[-1].item() == values.numel()
    poison = torch.finfo(y.dtype).max
    for size in (values.numel(), values.numel() - 1, values.numel() + 1):
        if size < 0:
            continue
        buffer = torch.full((size + 64,), poison, dtype=y.dtype, device=y.device)
        got = _ops.compact_into(y, mask, ends, buffer[:size])
        assert (buffer[size:] == poison).all(), size
        if size == values.numel():
            assert torch.equal(_bits(buffer[:size]), _bits(values)) and got.item() == missed.item()
        else:
            assert got.item() >= 1, size
    assert torch.equal(_bits(_ops.expand(values, mask, y.shape, y.stride(), False)), _bits(restored))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_keep_layouts(device, cpu_isa):
    for y in (torch.relu(torch.randn(4, 16, 12, 12, device=device)).contiguous(memory_format=torch.channels_last),
              torch.relu(torch.randn(64, 48, device=device)).t(),
              torch.relu(torch.randn(3, 5000, device=device))[1],  # a storage offset
              # unaligned for every vector width (16-, 32- and 64-byte loads and stores)
              torch.relu(torch.randn(70001, device=device))[1:],
              torch.relu(torch.randn(70001, device=device, dtype=torch.bfloat16))[3:],
              torch.relu(torch.randn(70001, device=device, dtype=torch.float64))[1:]):
        mask = _ops.nonzero_mask(y)
        values, missed = _ops.compact(y, mask)
        restored = _ops.expand(values, mask, y.shape, y.stride())
        assert missed.item() == 0 and restored.stride() == y.stride()
        assert_bitwise_equal(restored, y)


def test_ops_reject_bad_input():
    y = torch.relu(torch.randn(100))
    mask = _ops.nonzero_mask(y)
    values, _ = _ops.compact(y, mask)
    ends = _ops.compact_count(y, mask)
    bad = [
        (lambda: _ops.compact(y, mask[:5]), "mask has shape \\[5\\] but the tensor has 100 elements"),
        (lambda: _ops.compact(y, mask.int()), "mask has dtype Int; expected uint8"),
        (lambda: _ops.compact(y.int(), mask), "y has dtype Int; compaction takes float32"),
        (lambda: _ops.compact(torch.randn(200)[::2], mask), "y must be dense"),
        (lambda: _ops.nonzero_mask(torch.randn(3, 3).to_sparse()), "y has layout Sparse"),
        (lambda: _ops.expand(values[1:], mask, y.shape, y.stride()), "the mask keeps \\d+ elements but values has"),
        (lambda: _ops.expand(values, mask, (10, 10), (1, 1)), "are not a dense layout"),
        (lambda: _ops.expand(values.view(1, -1), mask, y.shape, y.stride()), "values must be 1-D"),
        (lambda: _ops.compact_count(y, mask[:5]), "mask has shape \\[5\\] but the tensor has 100 elements"),
        (lambda: _ops.compact_into(y, mask, ends, values.double()), "values is Double on cpu but y is Float"),
        (lambda: _ops.compact_into(y, mask, ends, values.view(1, -1)), "values must be 1-D and contiguous"),
        (lambda: _ops.compact_into(y, mask, ends, y[: values.numel()]), "values must not overlap y"),
        (lambda: _ops.compact_into(y, mask, ends.int(), values), "ends must be compact_count's"),
        (lambda: _ops.compact_into(y, mask, ends.repeat(2), values), "ends has 2 entries but compact_count gives 1"),
    ]
    for call, message in bad:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_ops_are_not_differentiable():
    y = torch.relu(torch.randn(100, requires_grad=True))
    mask = _ops.nonzero_mask(y)
    assert not mask.requires_grad
    with pytest.raises(RuntimeError, match="y requires grad, but compaction is not differentiable"):
        _ops.compact(y, mask)
    values, _ = _ops.compact(y.detach(), mask)
    with pytest.raises(RuntimeError, match="values requires grad, but compaction is not differentiable"):
        _ops.expand(values.requires_grad_(), mask, y.shape, y.stride())
    ends = _ops.compact_count(y, mask)
    with pytest.raises(RuntimeError, match="y requires grad, but compaction is not differentiable"):
        _ops.compact_into(y, mask, ends, values.detach().clone())
    with pytest.raises(RuntimeError, match="values requires grad, but compaction is not differentiable"):
        _ops.compact_into(y.detach(), mask, ends, values)


@pytest.mark.parametrize("op", ["compact", "compact_count", "compact_into", "expand", "nonzero_mask"])
def test_opcheck(op):
    y = torch.relu(torch.randn(4, 8, 5, 5)).contiguous(memory_format=torch.channels_last)
    mask = _ops.nonzero_mask(y)
    values, _ = _ops.compact(y, mask)
    args = {"compact": (y, mask), "compact_count": (y, mask),
            "compact_into": (y, mask, _ops.compact_count(y, mask), torch.empty_like(values)),
            "expand": (values, mask, list(y.shape), list(y.stride())), "nonzero_mask": (y,)}[op]
    torch.library.opcheck(getattr(_ops, op).default, args)


# --- save_compact ----------------------------------------------------------------------------


class _Probe(torch.autograd.Function):
    """Saves its input for backward and records what backward gets back."""

    restored: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        _Probe.restored.append(ctx.saved_tensors[0].detach().clone())
        return g


RELUS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "nn.ReLU": torch.relu,
    "nn.ReLU-inplace": torch.relu_,
    "relu_ext": relu_ext.relu,
    "relu_ext-inplace": lambda t: relu_ext.relu(t, inplace=True),
}


def _saved_and_restored(relu: Callable, x: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The ReLU output at forward time, and what the next layer's backward got back."""
    _Probe.restored = []
    leaf = x.clone().requires_grad_()
    with ctx:
        y = relu(leaf * 1)
        saved = y.detach().clone()
        out = _Probe.apply(y)
    out.backward(torch.ones_like(out))
    return saved, _Probe.restored[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("relu", RELUS)
def test_restored_bit_for_bit(relu, dtype, device):
    """Adversarial data: NaN payloads, ±0.0, ±inf, denormals, every bit pattern."""
    x = adversarial(100_003, dtype, device, seed=11)
    saved, restored = _saved_and_restored(RELUS[relu], x, relu_ext.save_compact(min_saving=0.0))
    assert_bitwise_equal(restored, saved, "restored ReLU output")


@pytest.mark.parametrize("relu", RELUS)
def test_layouts_come_back(relu):
    x = torch.randn(4, 16, 12, 12).contiguous(memory_format=torch.channels_last).permute(0, 2, 1, 3)
    saved, restored = _saved_and_restored(RELUS[relu], x, relu_ext.save_compact())
    assert restored.stride() == saved.stride()
    assert_bitwise_equal(restored, saved)


def _count_compactions(monkeypatch) -> list[Any]:
    """The compactions the pack hook makes, listed as made, by its Python path or its C++ one (which
    compacts at once): the Compacted form, or None where it missed."""
    made: list[Any] = []
    real, real_at_once = hooks._Packer._form, hooks._AtOnce.__call__

    def counting(packer: Any, t: torch.Tensor, rows: Any) -> Any:
        form = real(packer, t, rows)
        if any(row.form is compact.Compacted and row.applies(t, packer.recompute) for row in rows):
            made.append(form if isinstance(form, compact.Compacted) else None)
        return form

    def at_once(self: Any, *args: Any) -> Any:
        made.append(real_at_once(self, *args))
        return made[-1]

    monkeypatch.setattr(hooks._Packer, "_form", counting)
    monkeypatch.setattr(hooks._AtOnce, "__call__", at_once)
    return made


@pytest.mark.parametrize("relu", ["nn.ReLU", "relu_ext"])
def test_compacted_once_when_saved_by_several_nodes(relu, monkeypatch):
    """nn.ReLU's node saves its output and the conv after it saves it again: one compaction."""
    made = _count_compactions(monkeypatch)
    conv = torch.nn.Conv2d(8, 8, 3)
    x = torch.randn(2, 8, 16, 16, requires_grad=True)
    with relu_ext.save_compact():
        y = RELUS[relu](x * 1)
        z = conv(y) + conv(y)  # and twice more
    assert len(made) == 1 and isinstance(made[0], compact.Compacted)
    expands = []
    real_expand = forms._C.expand
    monkeypatch.setattr(forms._C, "expand", lambda *args: expands.append(args) or real_expand(*args))
    grads = torch.autograd.grad(z.sum(), [x, conv.weight])
    # Expanded once for all its nodes, and not kept once the last has unpacked it.
    assert len(expands) == 1 and made[0].restored is None and made[0].pending == 0
    assert_bitwise_equal(grads[1], torch.autograd.grad((conv(RELUS[relu](x * 1)) * 2).sum(), conv.weight)[0])


def test_forms_by_tensor_go_with_their_tensor():
    """The pack hook's form of a tensor is found again while the tensor lives (saved again: the same
    form), and held by nothing of the hook's once the tensor and the graph's reference are gone; a
    new tensor under a freed one's id finds nothing (hooks._ByTensor)."""
    sc = relu_ext.save_compact()
    noise = torch.rand(64, 128) > 0.5  # (a bool tensor no node made: a TwoValued form)
    form = sc.pack_hook(noise)
    assert isinstance(form, forms.TwoValued) and sc.pack_hook(noise) is form
    key, form_ref, tensor_ref = id(noise), weakref.ref(form), weakref.ref(noise)
    del noise, form
    assert tensor_ref() is None and form_ref() is None
    assert key not in sc.pack_hook.__self__.cache.entries
    by_tensor = hooks._ByTensor()
    other = torch.zeros(3)
    by_tensor.put(other, "other")
    gone = torch.zeros(3)
    by_tensor.entries[id(gone)] = (weakref.ref(other), "stale")  # (another tensor's entry under its id)
    assert by_tensor.get(other) == "other" and by_tensor.get(gone) is None
    del other
    assert list(by_tensor.entries) == [id(gone)]  # (the entry under other's id went with it)


def test_relu_ext_mask_is_reused(monkeypatch):
    made = _count_compactions(monkeypatch)
    x = torch.randn(64, 128, requires_grad=True)
    with relu_ext.save_compact():
        y = relu_ext.relu(x * 1)
        out = _Probe.apply(y)
    assert made[0].mask is y.grad_fn._saved_mask or made[0].mask.data_ptr() == y.grad_fn._saved_mask.data_ptr()
    out.sum().backward()


def test_negative_zero_gets_its_own_bitmap(monkeypatch):
    """relu(-0.0) is -0.0 with mask bit 0: relu_ext's mask cannot restore it, a bitmap of nonzero bits can."""
    made = _count_compactions(monkeypatch)
    x = torch.randn(8192)
    x[::7] = -0.0
    saved, restored = _saved_and_restored(relu_ext.relu, x, relu_ext.save_compact())
    assert_bitwise_equal(restored, saved)
    assert restored.signbit().sum() == (x == 0).sum() > 0
    ext_mask = torch.ops.relu_ext.relu_fwd(x)[1]
    assert not torch.equal(made[0].mask, ext_mask)


def test_a_tensor_kept_as_it_is_is_counted_once_per_tensor():
    """Saved again at the same version, a tensor kept as it is is the same packed object, asked nothing
    more; changed in place and saved again, it is packed anew (backward checks the new version), and
    still counted once: it holds its storage once."""
    sc = relu_ext.save_compact()
    x = torch.randn(64, 128)
    first = sc.pack_hook(x)
    assert isinstance(first, forms._Dense) and sc.pack_hook(x) is first
    x.add_(1)
    second = sc.pack_hook(x)
    assert second is not first and second.version == x._version
    assert sc.kept == 1 and sc.bytes_saved_for_backward == x.nbytes
    assert_bitwise_equal(sc.unpack_hook(second), x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        sc.unpack_hook(first)


def test_views_of_a_parameter_are_counted_as_it_once():
    """Every view of a leaf that requires grad (a parameter: a Linear's ``weight.t()``, a slice of
    it), however many nodes save one, is counted as that leaf once, held outside the graph (the
    graph holds its storage); a frozen parameter no node made, held by its module when the block
    exits, is held outside too. Each is restored as the view it was, with PyTorch's gradients."""
    torch.manual_seed(0)
    w, frozen = torch.nn.Parameter(torch.randn(96, 64)), torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
    x = torch.randn(32, 64, requires_grad=True)

    def loss() -> torch.Tensor:  # w.t() twice (tied), a slice of w, frozen saved by mm
        return (F.linear(x, w).sum() + F.linear(torch.relu(x), w).pow(2).sum() + (x @ w[:64].t()).sum()
                + torch.mm(x, frozen).sum())

    expected = torch.autograd.grad(loss(), (x, w))
    with relu_ext.save_compact() as sc:
        out = loss()
    for got, want in zip(torch.autograd.grad(out, (x, w)), expected):
        assert_bitwise_equal(got, want)
    apart = x.nbytes + w.nbytes + frozen.nbytes
    assert sc.report().splitlines()[-1] == (f"  held outside the graph: 3 tensors, {apart / 1024:.2f} KiB "
                                            "(parameters, buffers, inputs and views of them)"), sc.report()


class _Mixed(torch.nn.Module):
    """Every kind of saved tensor the pack hook sees: a convolution's output and BatchNorm's statistics,
    buffers, activation outputs after a BatchNorm and mostly zeros, a residual add, a max-pool's input and
    indices, a Linear's weight.t(), a frozen parameter, a tensor saved by two nodes, integer indices,
    dropout's noise, GELU and LayerNorm outputs, small tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.pool = torch.nn.MaxPool2d(2)
        self.lin, self.norm = torch.nn.Linear(2048, 256), torch.nn.LayerNorm(256)
        self.emb = torch.nn.Embedding(64, 256)
        self.frozen = torch.nn.Parameter(torch.randn(256, 256), requires_grad=False)
        self.register_buffer("scale", torch.rand(256) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.relu(self.bn(self.conv(x)))
        b = torch.relu(self.bn2(self.conv2(a)) + a)
        h = self.pool(b).flatten(1)  # (4, 2048): 8192 indices
        h = F.gelu(self.norm(self.lin(h.repeat(32, 1))))  # (128, 256)
        h = F.dropout(h, 0.2) * self.scale + self.emb(torch.arange(128) % 64)
        h2 = torch.relu(h @ self.frozen)
        y = h2 * 1.5
        few_zeros = torch.relu(h.abs() + 1) * F.hardsigmoid(h)  # (compacting them saves too little)
        return (y * h2 + y.pow(2)).sum() + (torch.relu(h[:2, :8]) * 3).sum() + few_zeros.sum()  # (y saved by two nodes)


@pytest.mark.parametrize("install", [False, True])
@pytest.mark.parametrize("recompute", [True, False])
def test_the_cpp_path_keeps_and_counts_as_the_python_path(install, recompute, monkeypatch):
    """_C.NativePacker, the pack hook's C++ path for the tensors kept as they are and the compactions at once,
    changes nothing but the hook's time: with it turned off (every tensor through hooks._Packer's Python
    path) the same forms, the same counts and report, and the same step, bit for bit."""

    class PythonOnly:  # (_C.NativePacker taking nothing)
        def __init__(self, *args: Any) -> None:
            pass

        def keep(self, t: torch.Tensor) -> None:
            return None

        def counted(self, t: torch.Tensor) -> bool:
            return False

        def take(self) -> tuple[int, int, int, int]:
            return 0, 0, 0, 0

        def outside(self) -> tuple[int, int]:
            return 0, 0

    def run(python_only: bool) -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = _Mixed().train()
        x = torch.randn(4, 3, 32, 32)
        packed: list[str] = []
        with pytest.MonkeyPatch.context() as patch:
            if python_only:
                patch.setattr(hooks._C, "NativePacker", PythonOnly)
            at_once = hooks._AtOnce.__call__
            patch.setattr(hooks._AtOnce, "__call__", lambda *args: packed.append("at once") or at_once(*args))
            sc = relu_ext.save_compact(recompute=recompute)
            pack = sc.pack_hook
            sc.pack_hook = lambda t: packed.append(type(p := pack(t)).__name__) or p
            torch.manual_seed(1)
            with relu_ext.install() if install else contextlib.nullcontext(), sc:
                loss = model(x)
            loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return repr(sc), sc.report(), sc.kept_by_reason, packed, loss.detach(), grads

    fast, slow = run(False), run(True)
    assert "at once" in fast[3] and "at once" not in slow[3]  # (the C++ path compacted some: the only difference)
    fast = (*fast[:3], [kind for kind in fast[3] if kind != "at once"], *fast[4:])
    assert fast[:4] == slow[:4]
    assert {"_Dense", "Compacted", "Narrowed", "TwoValued"} <= set(fast[3]), fast[3]
    assert {"Replayed", "Remade", "RemadeNorm"} <= set(fast[3]) or not recompute, fast[3]
    assert_bitwise_equal(fast[4], slow[4])
    assert len(fast[5]) == len(slow[5])
    for a, b in zip(fast[5], slow[5]):
        assert_bitwise_equal(a, b)


def test_the_cpp_path_takes_what_no_form_takes():
    """What _C.NativePacker keeps (a parameter, a view of one, a relu_ext mask, a convolution's output, small
    tensors), what it compacts (a ReLU output, by its own bitmap or by relu_ext's mask) and what it
    leaves to the Python path (an activation output after a BatchNorm, with too few zeros, or of an
    activation whose arguments say whether it is mostly zeros; an integer tensor to narrow, a float
    tensor no node made, a subclass, a view of a non-leaf)."""
    from relu_ext.compact.forms import _Dense

    packer = relu_ext.save_compact()._packer
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    conv = torch.nn.functional.conv2d(x, torch.randn(4, 3, 3, 3))
    y = torch.relu(torch.randn(64, 128, requires_grad=True))
    ours = relu_ext.relu(torch.randn(64, 128, requires_grad=True))
    for t in (w, w.t(), torch.zeros(1024, dtype=torch.uint8), conv, torch.randn(100), torch.arange(100)):
        assert isinstance(packer.native.keep(t), _Dense)
    for t, shared in ((y, False), (ours, True)):
        form = packer.native.keep(t)
        assert isinstance(form, compact.Compacted) and form.shared == shared and form.pending == 1
        assert_bitwise_equal(form.restore(), t.detach())

    class Sub(torch.Tensor):
        pass

    after_bn = torch.relu(torch.nn.functional.batch_norm(torch.randn(64, 128, requires_grad=True), None, None,
                                                         training=True))
    few_zeros = torch.relu(torch.rand(64, 128, requires_grad=True) + 0.5)
    relu6 = torch.nn.functional.relu6(torch.randn(64, 128, requires_grad=True))
    for t in (after_bn, few_zeros, relu6, torch.arange(8192), torch.randn(8192), y[:, :64],
              torch.randn(8).as_subclass(Sub)):
        assert packer.native.keep(t) is None
    assert packer.native.take() == (5, w.nbytes + 1024 + conv.nbytes + 400 + 800, 1, w.nbytes)
    assert packer.stats.count["compacted"] == 2


def test_dense_at_least_is_plain_dense():
    """_C.dense_at_least (the pack hook's test of a tensor it may keep smaller) says what bits._is_dense
    and a count of elements say, layout by layout; a nested tensor is never taken."""
    from relu_ext.compact.bits import _is_dense

    base = torch.randn(4, 6, 8, 10)
    layouts = {"contiguous": base, "transposed": base.transpose(1, 3),
               "channels_last": base.contiguous(memory_format=torch.channels_last),
               "permuted": base.permute(2, 0, 3, 1), "sliced": base[:, :3], "stepped": base[..., ::2],
               "expanded": base[:, :1].expand(4, 6, 8, 10),
               "size_one_odd_stride": torch.randn(320).as_strided((4, 1, 80), (80, 7, 1)),
               "offset": torch.randn(1930)[10:].view(4, 480), "one_dim_strided": torch.randn(200)[::2]}
    for layout, t in layouts.items():
        for numel in (0, t.numel(), t.numel() + 1):
            assert _C.dense_at_least(t, numel) == (_is_dense(t) and t.numel() >= numel), (layout, numel)
    assert sum(_is_dense(t) for t in layouts.values()) == 6  # (the layouts above: both answers occur)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nested tensors' prototype warning)
        nested = torch.nested.nested_tensor([torch.randn(8, 4), torch.randn(8, 4)])
    assert not _C.dense_at_least(nested, 0)


def test_dense_outputs_stay_dense(monkeypatch):
    made = _count_compactions(monkeypatch)
    x = torch.rand(8192) + 0.5  # all kept: nothing to gain
    saved, restored = _saved_and_restored(torch.relu, x, relu_ext.save_compact())
    assert made == [None]
    assert_bitwise_equal(restored, saved)


def test_what_is_not_a_relu_output_is_saved_as_usual(monkeypatch):
    made = _count_compactions(monkeypatch)
    x = torch.randn(64, 128, requires_grad=True)
    with relu_ext.save_compact():
        y = torch.relu(x)
        z = (y[:, :64] * 2).sum() + (torch.sigmoid(x) * x).sum() + (torch.relu(x[:4, :4]) * 3).sum()
    # A view (y[:, :64]), no ReLU output (sigmoid), too small (4x4): saved as usual; y itself compacted.
    assert len(made) == 1 and isinstance(made[0], compact.Compacted) and made[0].size == y.size()
    z.backward()


def test_report_lists_parameters_apart():
    """report()'s headline counts what the graph holds for the step; parameters, buffers and views of
    them, held outside the graph anyway, come on a line of their own; the counters count everything."""
    torch.manual_seed(0)
    lin, bn = torch.nn.Linear(128, 128), torch.nn.BatchNorm1d(128)
    x, w = torch.randn(64, 128, requires_grad=True), torch.randn(64, 128, requires_grad=True)
    with relu_ext.save_compact() as sc:
        loss = (torch.relu(bn(lin(x))) * w).sum()  # saved, not made here: x, lin.weight.t(), bn's weight, w
    loss.backward()
    # (and the BatchNorm's running mean and variance, which PyTorch's CPU kernel saves in training too)
    apart = x.nbytes + lin.weight.nbytes + bn.weight.nbytes + w.nbytes + 2 * bn.running_mean.nbytes
    lines = sc.report().splitlines()
    assert lines[-1] == (f"  held outside the graph: 6 tensors, {apart / 1024:.2f} KiB "
                         "(parameters, buffers, inputs and views of them)"), lines
    made = sc.bytes_saved_for_backward - apart
    held = sc.bytes_held - apart
    assert lines[0] == (f"relu_ext.save_compact: {sc.replayed + sc.compacted + sc.kept - 6} tensors saved for "
                        f"backward, {made / 1024:.2f} KiB, held in {held / 1024:.2f} KiB ({100 * held / made:.1f}%)"), lines
    assert sc.replayed == 1 and sc.kept_by_reason["not_activation"] > 4, sc.report()


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_report_lists_buffers_and_inputs_apart(mode):
    """What no node made and the graph saves as it is: held outside the graph where something else
    still holds it when the block exits (a BatchNorm's running statistics, the step's input, which
    requires no grad), not where only the graph does (the batch statistics it saves in training, a
    temporary tensor)."""
    torch.manual_seed(0)
    lin, bn = torch.nn.Linear(128, 128), torch.nn.BatchNorm1d(128)
    getattr(bn, mode)()
    x = torch.randn(64, 128)
    with relu_ext.save_compact() as sc:
        loss = torch.relu(bn(lin(x))).sum() + (torch.randn(64, 128) * lin(x)).sum()
    lines = sc.report().splitlines()
    # x (saved twice: counted once), bn.weight, its running mean and variance (not lin.weight.t(): x
    # requires no grad); not the temporary, nor the saved batch statistics
    apart = x.nbytes + bn.weight.nbytes + 2 * bn.running_mean.nbytes
    assert lines[-1].startswith(f"  held outside the graph: 4 tensors, {apart / 1024:.2f} KiB"), lines
    loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.uint8], ids=str)
def test_same_bits(dtype):
    """_C.same_bits (save_compact's check of a concatenation's pieces): bits, not numbers (NaN payloads
    equal themselves, -0.0 differs from +0.0), in any strides, one differing element anywhere."""
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(-(2**62), 2**62, (3, 70, 9, 11), generator=g).view(torch.uint8)[..., : 11 * dtype.itemsize]
    a = bits.contiguous().view(dtype).contiguous(memory_format=torch.channels_last)[:, 5:61]  # (not dense)
    b = a.contiguous()
    assert _C.same_bits(a, b) and _C.same_bits(b, a) and _C.same_bits(a.transpose(0, 3), b.transpose(0, 3))
    for i in (0, 1, a.numel() // 2, a.numel() - 1):
        c = b.clone()
        c.view(-1).view(torch.uint8)[i * dtype.itemsize] ^= 1
        assert not _C.same_bits(a, c), i
    if dtype.is_floating_point:
        zeros = torch.zeros(4096, dtype=dtype)
        negative = zeros.clone()
        negative[4000] = -0.0
        assert not _C.same_bits(zeros, negative) and torch.equal(zeros, negative)
        nan = torch.full((4096,), float("nan"), dtype=dtype)
        assert _C.same_bits(nan, nan.clone()) and not torch.equal(nan, nan.clone())
    with pytest.raises(RuntimeError, match="differ in shape or dtype"):
        _C.same_bits(a, b[:, 1:])
    with pytest.raises(RuntimeError, match="differ in shape or dtype"):
        _C.same_bits(a, b.view(torch.uint8) if dtype.itemsize == 1 and dtype != torch.uint8 else b.to(torch.int32))
    with pytest.raises(RuntimeError, match="strided CPU tensors only"):
        _C.same_bits(a.to("meta"), b.to("meta"))


def test_compact_now_and_expand():
    """_C.compact_now and _C.expand (the hooks' entries to the ops, without torch.ops), in four dtypes:
    by the mask given where it restores the tensor, else by the tensor's own bitmap; the tensor back
    bit for bit, in its layout (NaN payloads, -0.0, denormals); the ops' errors for bad input."""
    ops = torch.ops.relu_ext
    for dtype in DTYPES:
        x = adversarial(6 * 50 * 7 * 9, dtype).view(6, 50, 7, 9).contiguous(memory_format=torch.channels_last)
        y = torch.where(x > 0, x, torch.zeros_like(x))  # (a ReLU's output: +0.0 where not above 0)
        relu_mask = ops.nonzero_mask(y)
        values, mask, shared = _C.compact_now(y, relu_mask)
        assert shared and mask is relu_mask and values.numel() == int((y.view(INT_OF[dtype]) != 0).sum())
        back = _C.expand(values, mask, y.size(), y.stride())
        assert_bitwise_equal(back, y)
        assert back.stride() == y.stride()
        other = torch.relu(x[:, :1].expand_as(x)).contiguous(memory_format=torch.channels_last)
        for given in (None, ops.nonzero_mask(other)):  # (x's -0.0, negatives, NaN: outside a ReLU's mask)
            values, mask, shared = _C.compact_now(x, given)
            assert not shared and torch.equal(mask, ops.nonzero_mask(x))
            assert_bitwise_equal(_C.expand(values, mask, x.size(), x.stride()), x)
        with pytest.raises(ValueError, match="CPU tensors only"):
            _C.compact_now(y.to("meta"), None)
        with pytest.raises(RuntimeError, match="need a contiguous 1-D mask"):
            _C.expand(values, mask[1:], x.size(), x.stride())
        with pytest.raises(RuntimeError, match="not a dense layout"):
            _C.expand(values, mask, x.size(), (0, 0, 0, 0))


# --- integer tensors (max-pool indices): narrowed ----------------------------------------


class _SavesInts(torch.autograd.Function):
    """Saves integer tensors it makes itself, which the graph alone then holds (as max-pool
    indices are), or the ones it is given; records what its backward gets back."""

    restored: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, make: Callable[[], list[torch.Tensor]]) -> torch.Tensor:
        ctx.save_for_backward(*make())
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        _SavesInts.restored.extend(ctx.saved_tensors)
        return g, None


# (source dtype, value range) -> the type it is kept in; None: no narrower type holds it.
_RANGES = {
    (torch.int64, 0, 255): torch.uint8,
    (torch.int64, -128, 127): torch.int8,
    (torch.int64, -32768, 32767): torch.int16,
    (torch.int64, 0, 65535): torch.uint16,
    (torch.int64, -(2**31), 2**31 - 1): torch.int32,
    (torch.int64, -(2**31) - 1, 0): None,
    (torch.int64, 0, 2**31): None,
    (torch.int32, -5, 40000): None,
    (torch.int32, 0, 40000): torch.uint16,
    (torch.int16, -128, 200): None,
    (torch.int16, 0, 200): torch.uint8,
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", _RANGES, ids=lambda c: f"{str(c[0])[6:]}:{c[1]}..{c[2]}")
def test_integer_tensor_narrowed_bit_for_bit(case, device):
    """Kept in the narrowest type that holds its values (both ends of the range present), widened back
    bit for bit in its own layout (channels_last, then permuted); in no narrower type, kept as it is."""
    dtype, lo, hi = case
    g = torch.Generator().manual_seed(3)
    values = torch.randint(lo, hi + 1, (2, 5, 33, 17), generator=g, dtype=torch.int64)
    values.view(-1)[[7, 501]] = torch.tensor([lo, hi])
    values = values.to(dtype).contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).to(device)
    expect = values.clone(memory_format=torch.preserve_format)
    x = torch.randn(8, device=device, requires_grad=True)
    _SavesInts.restored = []
    with relu_ext.save_compact() as sc:
        out = _SavesInts.apply(x, lambda: [values.clone(memory_format=torch.preserve_format)])
    narrow = _RANGES[case]
    assert (sc.narrowed, sc.kept) == ((1, 0) if narrow is not None else (0, 1))  # (x: saved by none)
    held = values.numel() * (narrow.itemsize if narrow is not None else dtype.itemsize)
    assert sc.bytes_saved_for_backward == values.nbytes and sc.bytes_held == held
    out.sum().backward(retain_graph=True)
    out.sum().backward()  # retain_graph: widened again
    assert len(_SavesInts.restored) == 2
    for got in _SavesInts.restored:
        assert got.dtype == dtype and got.stride() == expect.stride() and torch.equal(got, expect)


def test_integer_tensor_held_elsewhere_is_kept_as_it_is():
    """A narrowed copy of a tensor that something else keeps alive adds bytes: max-pool indices the
    caller asked for (return_indices=True), an embedding's ids, a tensor saved twice (once narrowed)."""
    x = torch.randn(2, 4, 64, 64, requires_grad=True)
    ids = torch.randint(0, 100, (8192,))
    emb = torch.nn.Embedding(100, 4)

    def step(ctx: Any) -> tuple[list[torch.Tensor], Any]:
        x.grad = emb.weight.grad = None
        _SavesInts.restored = []
        with ctx as sc:
            pooled = F.max_pool2d(x * 1, 3, 2)  # indices: the graph's alone
            pooled2, indices = F.max_pool2d(x * 2, 2, 2, return_indices=True)
            twice = torch.arange(4096 * 3)
            loss = pooled.sum() + (pooled2 * 3).sum() + emb(ids).sum()
            loss = loss + _SavesInts.apply(x, lambda: [twice, twice]).sum()
            del twice
        loss.backward()
        return [x.grad, emb.weight.grad, *_SavesInts.restored], sc

    got, sc = step(relu_ext.save_compact())
    want, _ = step(contextlib.nullcontext())
    assert sc.narrowed == 2 and sc.kept_by_reason["not_activation"] == 2  # indices, ids
    assert sc.remade == 2  # x * 1, x * 2: from x, a leaf
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b) if a.dtype == torch.int64 else assert_bitwise_equal(a, b) is None


def test_integer_tensor_held_in_cpp_is_kept_as_it_is():
    """Held by C++ alone (a node that saved it outside save_compact): its Python object outlives the
    hook's reference (PyTorch keeps the object of a live tensor), so it is not narrowed."""
    x = torch.randn(2, 4, 64, 64, requires_grad=True)
    pooled, indices = F.max_pool2d(x * 1, 2, 2, return_indices=True)  # indices: kept by its node (C++)
    with relu_ext.save_compact() as sc:
        out = _SavesInts.apply(x, lambda: [indices])
        del indices  # (now only the two nodes hold it)
    assert (sc.narrowed, sc.kept) == (0, 1), sc.report()
    _SavesInts.restored = []
    (out.sum() + pooled.sum()).backward()
    assert _SavesInts.restored[0].dtype == torch.int64


def test_integer_tensor_changed_in_place_raises_pytorchs_error():
    x = torch.randn(2, 4, 64, 64, requires_grad=True)
    for ctx in (relu_ext.save_compact(), contextlib.nullcontext()):
        with ctx:
            pooled, indices = F.max_pool2d(x * 1, 2, 2, return_indices=True)
            indices.add_(0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            pooled.sum().backward()


# --- tensors of zeros and one other value (CPU dropout's noise): a bitmap ---------------------

def _two_valued(n: int, dtype: torch.dtype, value: float | int, seed: int, p: float = 0.5) -> torch.Tensor:
    """n elements, each +0 or `value` (a float, or an int: the bit pattern), at random."""
    g = torch.Generator().manual_seed(seed)
    v = (torch.tensor([value]).to(_INT[dtype.itemsize]).view(dtype) if isinstance(value, int)  # (wraps: the low bytes)
         else torch.tensor([value], dtype=dtype))
    return torch.where(torch.rand(n, generator=g) < p, v, torch.zeros(1, dtype=dtype))


# Bit patterns of 4 bytes (others are taken as floats): 1 / 0.9, a NaN with a payload, -0.0,
# a denormal, -inf; all-ones bits (the value's own NaN).
_VALUES = [1 / 0.9, 0x7FC01234, 0x80000000, 0x00000003, float("-inf"), 0xFFFFFFFF]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", OP_SIZES)
def test_binary_ops_against_a_reference(n, dtype, cpu_isa):
    """binary_mask gives nonzero_mask's bitmap and the one nonzero bit pattern; binary_expand gives
    the tensor back bit for bit (every element written: with every bit set, an unwritten element
    would read +0 or the poison of the memory freed before it)."""
    for k, value in enumerate(_VALUES):
        for p in (0.5, 1.0):
            y = _two_valued(n, dtype, value, seed=n + k, p=p)
            mask, v, ok = _ops.binary_mask(y)
            assert bool(ok) and v.dim() == 0 and v.dtype == dtype
            assert torch.equal(mask, _ops.nonzero_mask(y))
            nonzero = _bits(y)[_bits(y) != 0]
            assert _bits(v.view(1)).item() == (nonzero[0].item() if len(nonzero) else 0)
            del y
            torch.full((n,), -1, dtype=_INT[dtype.itemsize]).view(dtype)  # (poison, freed)
            got = _ops.binary_expand(mask, v, [n], [1])
            assert torch.equal(_bits(got), _bits(_two_valued(n, dtype, value, seed=n + k, p=p)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_binary_mask_rejects_a_second_value(dtype, cpu_isa):
    """A second nonzero bit pattern anywhere (first element, last, another chunk; -0.0 next to +x;
    a NaN payload next to another) gives ok False; all zeros gives +0 and an empty bitmap."""
    n = 32768 * 3 + 5
    for where in (0, 1, 4096, 32768, 70000, n - 1):
        for other in (2.0, -0.0, float("nan")):
            y = _two_valued(n, dtype, 1.0, seed=where)
            y[where] = other
            assert not bool(_ops.binary_mask(y)[2]), (where, other)
    zeros = torch.zeros(n, dtype=dtype)
    mask, v, ok = _ops.binary_mask(zeros)
    assert bool(ok) and not bool(mask.any()) and _bits(v.view(1)).item() == 0


def test_binary_ops_keep_layouts(cpu_isa):
    for y in (_two_valued(4 * 16 * 144, torch.float32, 1.25, 0).view(4, 16, 12, 12).contiguous(memory_format=torch.channels_last),
              _two_valued(64 * 48, torch.float32, 2.0, 1).view(64, 48).t(),
              _two_valued(70001, torch.float64, 3.0, 2)[1:]):  # unaligned
        mask, v, ok = _ops.binary_mask(y)
        got = _ops.binary_expand(mask, v, y.shape, y.stride())
        assert bool(ok) and got.stride() == y.stride()
        assert_bitwise_equal(got, y)


def test_binary_ops_reject_bad_input():
    y = _two_valued(100, torch.float32, 2.0, 0)
    mask, v, _ = _ops.binary_mask(y)
    bad = [
        (lambda: _ops.binary_mask(y.int()), "y has dtype Int; compaction takes float32"),
        (lambda: _ops.binary_mask(torch.randn(200)[::2]), "y must be dense"),
        (lambda: _ops.binary_mask(torch.randn(3, 3).to_sparse()), "y has layout Sparse"),
        (lambda: _ops.binary_expand(mask[:5], v, y.shape, y.stride()), "mask has shape \\[5\\] but the tensor has 100"),
        (lambda: _ops.binary_expand(mask, v.view(1), y.shape, y.stride()), "value must be a scalar"),
        (lambda: _ops.binary_expand(mask, v, (10, 10), (1, 1)), "are not a dense layout"),
        (lambda: _ops.binary_expand(mask.int(), v, y.shape, y.stride()), "mask has dtype Int; expected uint8"),
        (lambda: _ops.binary_mask(y.requires_grad_()), "y requires grad, but compaction is not differentiable"),
    ]
    if torch.cuda.is_available():
        bad.append((lambda: _ops.binary_mask(y.detach().cuda()), "has CPU kernels only so far"))
    for call, message in bad:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("op", ["binary_mask", "binary_expand"])
def test_binary_opcheck(op):
    y = _two_valued(4 * 8 * 25, torch.float32, 2.0, 0).view(4, 8, 5, 5).contiguous(memory_format=torch.channels_last)
    mask, v, _ = _ops.binary_mask(y)
    args = {"binary_mask": (y,), "binary_expand": (mask, v, list(y.shape), list(y.stride()))}[op]
    torch.library.opcheck(getattr(_ops, op).default, args)


class _Dropouts(torch.nn.Module):
    """Dropout as PyTorch runs it on the CPU (its graph keeps a noise tensor of 0 and 1 / (1 - p)),
    around a ReLU and a Linear; `mask` (held by the module) multiplied in as well."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(64, 64).to(dtype)
        self.mask = torch.where(torch.rand(128, 64) < 0.5, 0.0, -1e4).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.lin(x)), 0.1, training=True)
        return F.dropout(self.lin(h) * self.mask, 0.2, training=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_dropout_noise_kept_as_a_bitmap(dtype):
    """The two noise tensors and the module's mask are kept as bitmaps (the mask, held by the
    module, stays too); the step is bitwise the same, twice (retain_graph)."""
    model = _Dropouts(dtype)
    x = torch.randn(128, 64, dtype=dtype)
    sc = relu_ext.save_compact()
    got = train_step(model, x, sc, retain_graph=True)
    want = train_step(model, x, contextlib.nullcontext(), retain_graph=True)
    assert_same_step(got, want)
    assert sc.two_valued == 3 and "two-valued: 3 tensors" in sc.report(), sc.report()
    noise, bitmaps = 3 * x.nbytes, 3 * (x.numel() // 8 + x.element_size())
    assert sc.bytes_saved_for_backward - sc.bytes_held >= noise - bitmaps, sc.report()


# Dropout after a ReLU: on the CPU its noise times the ReLU's output (MulBackward0), through
# torch.native_dropout (CUDA's dropout) its own node.
_DROPOUTS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "F.dropout": lambda y, p: F.dropout(y, p, training=True),
    "native_dropout": lambda y, p: torch.native_dropout(y, p, True)[0],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("relu", ["nn.ReLU", "relu_ext"])
@pytest.mark.parametrize("dropout", _DROPOUTS)
def test_dropout_after_a_relu_is_compacted(dropout, relu, dtype):
    """Dropout's output after a ReLU is mostly zeros too: compacted with its own bitmap where nothing
    remakes it (relu_ext's ReLU keeps a mask, not its output; native_dropout's node is no op of the
    table), restored bit for bit on adversarial data (NaN payloads, ±0.0, ±inf, denormals). With too few
    zeros (a ReLU of positive numbers, a dropout of 1 %) kept as it is, counted as such."""
    drop, act = _DROPOUTS[dropout], RELUS[relu]
    # (PyTorch's ReLU keeps its output, compacted, and F.dropout's product of it and the noise is remade.)
    ours, remade = relu == "relu_ext", relu == "nn.ReLU" and dropout == "F.dropout"
    torch.manual_seed(3)
    sc = relu_ext.save_compact()
    saved, restored = _saved_and_restored(lambda t: drop(act(t), 0.3), adversarial(100_003, dtype, seed=5), sc)
    assert_bitwise_equal(restored, saved, "restored dropout output")
    assert (sc.compacted, sc.remade) == (2 - ours - remade, remade), sc.report()
    few = relu_ext.save_compact()
    positive = torch.rand(100_003, dtype=dtype) + 1
    saved, restored = _saved_and_restored(lambda t: drop(act(t), 0.01), positive, few)
    assert_bitwise_equal(restored, saved, "dropout output kept as it is")
    assert (few.compacted, few.remade, few.kept_by_reason.get("too_few_zeros", 0)) == (0, remade, 2 - ours - remade), \
        few.report()


class _DropoutMLP(torch.nn.Module):
    """Linear -> ReLU -> Dropout -> Linear, twice (torchvision's VGG classifier, a transformer's
    feed-forward block)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(*(m for _ in range(2) for m in (
            torch.nn.Linear(64, 256), torch.nn.ReLU(inplace=True), torch.nn.Dropout(0.5), torch.nn.Linear(256, 64))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dropout_after_a_relu_trains_bit_for_bit(dtype, device):
    """A training step of an MLP with dropout after each ReLU, under install() + save_compact(): the loss
    and every gradient PyTorch's, each dropout output (kept by the next Linear) compacted (on CUDA
    native_dropout's output, compacted in steps)."""
    model = _DropoutMLP().to(device, dtype)
    x = torch.randn(128, 64, dtype=dtype).to(device)
    want = train_step(model, x, contextlib.nullcontext())
    sc = relu_ext.save_compact()
    with relu_ext.install():
        got = train_step(model, x, sc)
    assert_same_step(got, want)
    assert sc.compacted == 2, sc.report()


def test_two_valued_tensor_changed_in_place():
    """Changed in place after it was saved: backward raises PyTorch's error, as without hooks, whether
    the tensor lives (its holder changed it) or is gone since; never the changed values."""
    w = torch.randn(8192, requires_grad=True)
    noise = torch.where(torch.rand(8192) < 0.5, 0.0, 2.0)
    for ctx in (relu_ext.save_compact(), contextlib.nullcontext()):
        with ctx:
            z = (w * noise.clone()).sum()
            held = noise.clone()
            z2 = (w * held).sum()
        held.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z2.backward()
        w.grad = None
        z.backward()
        assert torch.equal(w.grad, noise)
    sc = relu_ext.save_compact()
    for ctx in (sc, contextlib.nullcontext()):
        with ctx:
            gone = noise.clone()
            z = (w * gone).sum()
            gone.mul_(2)
            del gone
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.backward()
    assert sc.two_valued == 1


def test_two_valued_not_kept_on_cuda_or_when_a_node_made_it():
    """Only tensors no node made (a tensor with a grad_fn may be an activation output, handled
    elsewhere), and floating-point ones only on the CPU (CUDA: no kernel; bools are, below)."""
    w = torch.randn(8192, requires_grad=True)
    with relu_ext.save_compact() as sc:
        plain = torch.where(w > 0, 2.0, 0.0)  # (no node: w > 0 is not differentiable)
        made = w * 0 + 2  # all 2.0, AddBackward0's output
        z = (plain * w).sum() + (made * w).sum()
        del plain, made
    z.backward()
    assert sc.two_valued == 1, sc.report()  # where's result only
    assert_bitwise_equal(w.grad, torch.where(w > 0, 2.0, 0.0) + 2)
    if torch.cuda.is_available():
        w = w.detach().cuda().requires_grad_()
        with relu_ext.save_compact() as sc:
            z = (torch.where(w > 0, 2.0, 0.0) * w).sum()
        assert sc.two_valued == 0 and sc.kept == 1, sc.report()


@pytest.mark.parametrize("device", DEVICES)
def test_bool_tensors_kept_as_bits(device):
    """A saved bool tensor that no node made (CUDA dropout's mask, a where's condition) is kept as
    1 bit an element and comes back equal, in its own layout: odd sizes, channels_last, a
    transposed one; also one whose bytes are not all 0 and 1 (viewed from uint8: True, as
    PyTorch reads it, comes back as 1). Smaller ones, views that are not dense, and tensors a
    node made are kept as they are."""
    g = torch.Generator().manual_seed(7)
    dense = [torch.rand(n, generator=g) < 0.4 for n in (4096, 4099, 10007)]
    dense.append((torch.rand(2, 5, 31, 17, generator=g) < 0.7).contiguous(memory_format=torch.channels_last))
    dense.append((torch.rand(97, 131, generator=g) < 0.5).t())
    odd = torch.randint(0, 4, (8192,), dtype=torch.uint8, generator=g)
    dense.append(odd.view(torch.bool))
    # The strided view is taken on the device: .to() of a view that is not dense copies it densely.
    left = [(torch.rand(4095, generator=g) < 0.5).to(device), (torch.rand(200, 100, generator=g) < 0.5).to(device)[:, ::2]]
    x = torch.randn(8, device=device, requires_grad=True)
    ts = [t.to(device) for t in dense] + left
    _SavesInts.restored = []
    with relu_ext.save_compact() as sc:
        out = _SavesInts.apply(x, lambda: ts)
    assert (sc.two_valued, sc.kept) == (len(dense), len(left)), sc.report()
    assert sc.bytes_held == sum((t.numel() + 7) // 8 for t in dense) + sum(t.nbytes for t in left), sc.report()
    out.sum().backward()
    for i, (got, want) in enumerate(zip(_SavesInts.restored, ts)):
        assert got.dtype == torch.bool and got.device == want.device and got.stride() == want.stride(), i
        assert torch.equal(got, want), i
        if i != len(dense) - 1:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), i
    assert torch.equal(_SavesInts.restored[len(dense) - 1].view(torch.uint8).cpu(), (odd != 0).view(torch.uint8))


class _WhereDropout(torch.nn.Module):
    """A graph that keeps bool tensors: torch.where's condition, and on CUDA dropout's mask (on the
    CPU, dropout keeps float noise of 0 and 1 / (1 - p), also two-valued)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(64, 64).to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = torch.where(h > 0.1, h, h * 0.5)  # keeps `h > 0.1` for backward
        return F.dropout(self.lin(h), 0.25, training=True)


@pytest.mark.parametrize("device", DEVICES)
def test_where_condition_and_dropout_mask_kept_as_bits(device):
    """The step is bitwise the same as without the hooks; the condition and the dropout's
    mask or noise are kept as bitmaps."""
    net, x = _WhereDropout(device), torch.randn(256, 64, device=device)
    sc = relu_ext.save_compact()
    assert_same_step(train_step(net, x, sc), train_step(net, x, contextlib.nullcontext()))
    assert sc.two_valued == 2, sc.report()
    bools = 2 if device == "cuda" else 1  # 1 byte an element each, kept in 1 bit
    assert sc.bytes_saved_for_backward - sc.bytes_held >= bools * (x.numel() - x.numel() // 8), sc.report()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.complex64], ids=str)
def test_two_valued_leaves_other_dtypes_alone(dtype):
    """A tensor of 0 and 2 in a dtype the kernels do not take is saved as it is, not an error."""
    x = torch.randn(8, requires_grad=True)
    t = torch.where(torch.rand(8192) < 0.5, 0.0, 2.0).to(dtype)
    _SavesInts.restored = []
    with relu_ext.save_compact() as sc:
        out = _SavesInts.apply(x, lambda: [t.clone()])
    assert (sc.two_valued, sc.kept) == (0, 1), sc.report()
    out.sum().backward()
    assert torch.equal(_SavesInts.restored[0].view(torch.uint8), t.view(torch.uint8))


def _cnn(act: Callable[[], torch.nn.Module], dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), act(),
        torch.nn.Conv2d(16, 16, 3, padding=1), act(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), act(),
        torch.nn.Flatten(), torch.nn.Dropout(0.1), torch.nn.Linear(32 * 8 * 8, 10),
    ).to(dtype)


ACTS = {
    "nn.ReLU": lambda: torch.nn.ReLU(),
    "nn.ReLU-inplace": lambda: torch.nn.ReLU(inplace=True),
    "relu_ext.ReLU": lambda: relu_ext.ReLU(),
    "relu_ext.ReLU-inplace": lambda: relu_ext.ReLU(inplace=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ACTS)
def test_training_step_is_bitwise_the_same(act, dtype):
    model = _cnn(ACTS[act], dtype).train()
    x = torch.randn(4, 3, 16, 16, dtype=dtype)
    assert_same_step(train_step(model, x, relu_ext.save_compact()), train_step(model, x, contextlib.nullcontext()))


def test_relu_output_changed_in_place_after_save():
    """Compacted and changed in place: PyTorch's error, whether the tensor lives or was freed since, and
    changed through a view of it. Saved as it is: PyTorch's error."""
    w = torch.randn(8192, requires_grad=True)
    x = torch.randn(8192)

    def run(change: str, free: bool = True) -> torch.Tensor:
        w.grad = None
        with relu_ext.save_compact() as sc:
            y = torch.relu(x.clone().requires_grad_() * 1)
            z = (y * w).sum()
        view = y[::2]
        if change == "before the free":
            with torch.no_grad():
                y.add_(1.0)
        if free:
            del y
        if change == "through a view":
            with torch.no_grad():
                view.mul_(2.0)
        assert sc.compacted == 1
        z.backward()
        return w.grad.clone()

    for change in ("before the free", "through a view"):
        for free in (True, False):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                run(change, free)
    assert_bitwise_equal(run("none", free=False), run("none"))
    assert_bitwise_equal(run("none"), torch.relu(x))
    v = torch.randn(64, requires_grad=True)
    with relu_ext.save_compact():
        s = torch.sigmoid(v * 1)
        z = (s * v).sum()
    with torch.no_grad():
        s.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "compact"])
def test_double_backward_and_retain_graph(recompute):
    """(The BatchNorm -> ReLU outputs of _cnn are rebuilt with recompute, compacted without.)"""
    model = _cnn(ACTS["nn.ReLU"], torch.float64).train()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, requires_grad=True)

    def penalty(ctx: Any) -> list[torch.Tensor]:
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1)
        with ctx:
            out = model(x).sum()
            (gx,) = torch.autograd.grad(out, x, create_graph=True)
            loss = gx.square().sum()
        loss.backward(retain_graph=True)
        loss.backward()  # retain_graph: the compacted tensors are restored again
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    sc = relu_ext.save_compact(recompute=recompute)
    got, want = penalty(sc), penalty(contextlib.nullcontext())
    assert len(got) == len(want) > 4 and (sc.replayed > 0) == recompute
    for a, b in zip(got, want):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "compact"])
@pytest.mark.parametrize("where", ["inside", "around"])
def test_activation_checkpointing(where, recompute):
    """save_compact() around a checkpointed forward, and checkpoint around a forward
    that runs under save_compact() (its recomputation included)."""
    from torch.utils.checkpoint import checkpoint

    model = _cnn(ACTS["nn.ReLU-inplace"], torch.float32).train()
    x = torch.randn(4, 3, 16, 16)

    def run(compacted: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ctx = relu_ext.save_compact(recompute=recompute) if compacted else contextlib.nullcontext()

        def compacted_forward() -> torch.Tensor:
            with relu_ext.save_compact(recompute=recompute) if compacted else contextlib.nullcontext():
                return model(x)

        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1)
        if where == "inside":
            with ctx:
                out = checkpoint(model, x, use_reentrant=False)
        else:
            out = checkpoint(compacted_forward, use_reentrant=False)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    assert_same_step(run(True), run(False))


def test_torch_compile_works_under_it():
    model = _cnn(ACTS["nn.ReLU"], torch.float32).train()
    x = torch.randn(4, 3, 16, 16)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    assert_same_step(train_step(compiled, x, relu_ext.save_compact()), train_step(model, x, contextlib.nullcontext()))


def test_torch_func_raises_pytorchs_clear_error():
    from torch.func import grad

    with relu_ext.save_compact(), pytest.raises(RuntimeError, match="don't yet support saved tensor hooks"):
        grad(lambda t: torch.relu(t).sum())(torch.randn(3))


def test_bad_min_saving():
    with pytest.raises(ValueError, match="min_saving must be in"):
        relu_ext.save_compact(min_saving=1.0)
    for wrong, named in ((torch.zeros(3), "Tensor"), ("0.1", "str"), (True, "bool")):
        with pytest.raises(TypeError, match=f"min_saving must be a number, got {named}"):
            relu_ext.save_compact(wrong)
    assert relu_ext.save_compact(np.float32(0.25)).min_saving == 0.25


def _held_bytes(model: torch.nn.Module, x: torch.Tensor, compacted: bool) -> int:
    """Bytes of the distinct storages the autograd graph holds after forward, parameters
    aside, counted from what the saved-tensor hooks keep (allocator-independent)."""
    packed: list[Any] = []
    if compacted:
        ctx = relu_ext.save_compact()
        pack = ctx.pack_hook
        ctx.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]
    else:
        ctx = torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t)
    torch.manual_seed(1)
    with ctx:
        out = model(x)
    held = [t for p in packed for t in ((p,) if isinstance(p, torch.Tensor) else p.held())]  # (after the exit)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held}
    del out
    return sum(n for ptr, n in storages.items() if ptr not in params)


def test_real_model_holds_less_and_trains_the_same():
    """resnet18 (in-place ReLUs, then conv / max-pool / residual add): bitwise the same
    step, and less held by its graph."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.resnet18(weights=None).train()
    x = torch.randn(2, 3, 64, 64)
    assert_same_step(train_step(model, x, relu_ext.save_compact()), train_step(model, x, contextlib.nullcontext()))
    plain, small = _held_bytes(model, x, False), _held_bytes(model, x, True)
    assert small < 0.9 * plain, (small, plain)
