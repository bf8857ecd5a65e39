"""save_compact()'s recompute: activation outputs after a BatchNorm kept as recipes (the BatchNorm's
input and two numbers per channel), verified bit for bit when saved, rebuilt in backward; the ops
relu_ext::bn_terms / bn_act_verify / bn_act_rebuild against PyTorch's own BatchNorm and activations."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import relu_ext
from relu_ext import compact
from relu_ext.compact import forms
from conftest import INT_OF, assert_bitwise_equal, assert_same_step, train_step

_ops = torch.ops.relu_ext
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

from cases import REPRESENTATIVES, torch_fn  # noqa: E402  (the table of activations)

pytestmark = [pytest.mark.native, pytest.mark.torch_version]  # the risk it checks: see tests/tiers.py

# (op name, its arguments, PyTorch's function of the BatchNorm output): one per public function of the table.
ACTS: dict[str, tuple[str, list[float], Callable[[torch.Tensor], torch.Tensor]]] = {
    c.id: (c.op, list(c.args), torch_fn(c)) for c in REPRESENTATIVES
}


def _layout(x: torch.Tensor, name: str) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if name == "channels_last" else x


def _bn_case(dtype: torch.dtype, shape: tuple[int, ...], layout: str, training: bool, affine: bool, seed: int = 0):
    """An input, PyTorch's BatchNorm output of it, and the BatchNorm's terms as its node saved them."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = _layout((torch.randn(shape, generator=g) * 3 + 0.5).to(dtype), layout)
    w = (torch.rand(c, generator=g) + 0.5).to(dtype) if affine else None
    b = (torch.randn(c, generator=g)).to(dtype) if affine else None
    rm, rv = torch.randn(c, generator=g).to(dtype), (torch.rand(c, generator=g) + 0.1).to(dtype)
    eps = 1e-5
    y, save_mean, save_invstd = torch.native_batch_norm(x, w, b, rm.clone(), rv.clone(), training, 0.1, eps)
    mean, var = (save_mean, save_invstd) if training else (rm, rv)
    return x, y, w, b, mean, var, eps


# Planes of odd sizes (PyTorch's vector loop and its tail), channels_last rows, BatchNorm1d's (N, C) and (N, C, L).
# Runs of one channel (contiguous) or rows of channels (channels_last) shorter
# than a block of 64, of one block and a tail, and of several blocks and a tail.
SHAPES = [((4, 8, 9, 7), "contiguous"), ((3, 5, 33, 3), "contiguous"), ((4, 8, 9, 7), "channels_last"),
          ((2, 37, 5, 3), "channels_last"), ((64, 20), "contiguous"), ((2, 7, 41), "contiguous"),
          ((2, 70, 3, 3), "channels_last"), ((2, 3, 130), "contiguous")]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape,layout", SHAPES, ids=[f"{s}-{l}" for s, l in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_replay_matches_pytorch(dtype, shape, layout, training, cpu_isa):
    """What PyTorch's CPU BatchNorm and each activation computed, rebuilt bit for bit, on every kernel set."""
    x, bn, w, b, mean, var, eps = _bn_case(dtype, shape, layout, training, affine=True)
    alpha, beta = _ops.bn_terms(w, b, mean, var, training, eps, dtype)
    assert alpha.dtype == beta.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _replays_every_activation(x, bn, alpha, beta)


def _replays_every_activation(x: torch.Tensor, bn: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor,
                              why: str = "") -> None:
    """Each activation of PyTorch's BatchNorm output `bn` verified and rebuilt bit for bit from `x`
    and the terms; one flipped bit of the real output fails the check."""
    for name, (act, args, fn) in ACTS.items():
        want = fn(bn)
        assert bool(_ops.bn_act_verify(x, alpha, beta, act, args, want)), f"{name}{why}: verification missed"
        got = _ops.bn_act_rebuild(x, alpha, beta, act, args)
        assert got.stride() == want.stride(), name
        assert_bitwise_equal(got, want, name)
        other = want.clone()
        torch.as_strided(other.view(INT_OF[want.dtype]), (other.numel(),), (1,))[other.numel() // 2] ^= 1
        assert not bool(_ops.bn_act_verify(x, alpha, beta, act, args, other)), name


@pytest.mark.parametrize("shape,layout", SHAPES, ids=[f"{s}-{l}" for s, l in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_residual_replay_matches_pytorch(dtype, shape, layout, cpu_isa):
    """act(bn(x) + bn2(x2)) (a ResNet block's downsample) and act(bn(x) + r) (r added as it is,
    with the terms 1 and -0.0), as PyTorch computes `out += identity` then the activation."""
    x, bn, w, b, mean, var, eps = _bn_case(dtype, shape, layout, True, affine=True)
    x2, bn2, w2, b2, mean2, var2, _ = _bn_case(dtype, shape, layout, False, affine=True, seed=1)
    alpha, beta = _ops.bn_terms(w, b, mean, var, True, eps, dtype)
    alpha2, beta2 = _ops.bn_terms(w2, b2, mean2, var2, False, eps, dtype)
    c = shape[1]
    one, minus_zero = torch.ones(c, dtype=alpha.dtype), torch.full((c,), -0.0, dtype=alpha.dtype)
    r = x2.clone()
    # (No NaN: PyTorch's vector bfloat16 relu and hardsigmoid write it as all ones, their scalar
    # tails as it comes, and the replay computes the latter everywhere; verification sees that.)
    specials = [0.0, -0.0, float("inf"), -float("inf"), 1e-40, -1e-40, 3.0, -3.0]
    torch.as_strided(r, (r.numel(),), (1,))[:8] = torch.tensor(specials).to(dtype)  # the first in memory
    for second, terms, added in [(x2, (alpha2, beta2), bn2), (r, (one, minus_zero), r)]:
        for name, (act, args, fn) in ACTS.items():
            out = bn.clone()
            out += added  # torchvision's BasicBlock / Bottleneck
            want = fn(out)
            assert bool(_ops.bn_act_verify(x, alpha, beta, act, args, want, second, *terms)), f"{name}: missed"
            got = _ops.bn_act_rebuild(x, alpha, beta, act, args, second, *terms)
            assert got.stride() == want.stride(), name
            assert_bitwise_equal(got, want, name)
            assert not bool(_ops.bn_act_verify(x, alpha, beta, act, args, want)), name  # (the add counts)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_vector_sets_replay_every_16_bit_pattern_as_the_portable_loop(dtype, layout, cpu_isa):
    """The vector sets take the 16-bit types through float a block at a time (float16 with the
    hardware's conversions, bfloat16 on the bits, or with AVX512_BF16's conversion where sixteen hold no
    denormal and no NaN), the portable set computes on the type itself:
    every one of the 65536 bit patterns (NaNs, ±inf, ±0.0, denormals, rounding ties after the fma) as x
    and as the residual's second input must rebuild to the same values in each (the same bits in
    bfloat16), and verification must see one flipped bit."""
    if cpu_isa == "scalar":
        pytest.skip("the portable loop is the reference here")
    g = torch.Generator().manual_seed(3)
    c = 5
    shape = (1, c, 71, 185)  # planes of 205 blocks and a tail; channels_last rows shorter than a block
    n = 71 * 185 * c
    bits = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).repeat(2)[:n]
    x = _layout(bits[torch.randperm(n, generator=g)].view(dtype).reshape(shape), layout)
    x2 = _layout(bits.view(dtype).reshape(shape), layout)  # (in order: ties next to their neighbours)
    alpha = torch.tensor([1.0, -1.5, 3.0e-3, 0.75, 1.0 + 2.0**-9])
    beta = torch.tensor([-0.0, 0.5, -7.0, 2.0**-130, 1.0e4])
    cases = [(), (x2, torch.ones(c), torch.full((c,), -0.0)), (x2, alpha.flip(0), beta.flip(0))]
    for name, (act, args, _) in ACTS.items():
        for extra in cases:
            got = _ops.bn_act_rebuild(x, alpha, beta, act, args, *extra)
            relu_ext._C.set_cpu_isa("scalar")
            want = _ops.bn_act_rebuild(x, alpha, beta, act, args, *extra)
            relu_ext._C.set_cpu_isa(cpu_isa)
            what = f"{name}, {len(extra)} extra"
            if dtype == torch.bfloat16:  # (every NaN is 0x7FC0 in both, as c10's conversion writes it)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), what
            else:  # (the hardware's conversion keeps a NaN's payload, c10's does not, as in PyTorch's loops)
                assert_bitwise_equal(got, want, what)
            assert bool(_ops.bn_act_verify(x, alpha, beta, act, args, got, *extra)), what
            flipped = got.clone()
            torch.as_strided(flipped.view(torch.int16), (n,), (1,))[-1] ^= 1  # the last in memory: a tail
            assert not bool(_ops.bn_act_verify(x, alpha, beta, act, args, flipped, *extra)), what
            torch.as_strided(flipped.view(torch.int16), (n,), (1,))[-1] ^= 1
            torch.as_strided(flipped.view(torch.int16), (n,), (1,))[64 * 5 + 1] ^= 2  # inside a block
            assert not bool(_ops.bn_act_verify(x, alpha, beta, act, args, flipped, *extra)), what


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_verification_sees_one_changed_element(dtype, cpu_isa):
    x, bn, w, b, mean, var, eps = _bn_case(dtype, (4, 8, 16, 16), "contiguous", True, affine=True)
    alpha, beta = _ops.bn_terms(w, b, mean, var, True, eps, dtype)
    y = torch.relu(bn)
    for i in (0, 1000, y.numel() - 1):  # first, middle, last (the tail of a run)
        z = y.clone()
        z.view(-1)[i] = z.view(-1)[i] + 1 if z.view(-1)[i] != 0 else 1e-3
        assert not bool(_ops.bn_act_verify(x, alpha, beta, "relu", [], z)), i
    z = y.clone()
    flat = z.view(-1)
    i = int((flat == 0).nonzero()[0])
    flat[i] = -flat[i]  # +0.0 <-> -0.0: only the sign bit differs
    assert not bool(_ops.bn_act_verify(x, alpha, beta, "relu", [], z))


def test_ops_reject_bad_input():
    x = torch.randn(4, 8, 5, 5)
    a, b = torch.ones(8), torch.zeros(8)
    cases = [
        (lambda: _ops.bn_act_rebuild(x, a[:4], b, "relu", []), "alpha must be a contiguous Float tensor of shape \\[8\\]"),
        (lambda: _ops.bn_act_rebuild(x, a.double(), b, "relu", []), "alpha must be a contiguous Float"),
        (lambda: _ops.bn_act_rebuild(x, a, b, "gelu", []), "no activation 'gelu' to replay"),
        (lambda: _ops.bn_act_rebuild(x, a, b, "hardtanh", [0.0]), "hardtanh takes 2 arguments, got 1"),
        (lambda: _ops.bn_act_rebuild(x[:, :, ::2], a, b, "relu", []), "x must be dense"),
        (lambda: _ops.bn_act_rebuild(torch.randn(8), a, b, "relu", []), "expected \\(N, C, ...\\)"),
        (lambda: _ops.bn_act_rebuild(x.int(), a, b, "relu", []), "x has dtype Int"),
        (lambda: _ops.bn_act_verify(x, a, b, "relu", [], x.transpose(2, 3)), "y must have x's dtype, device, shape and"),
        (lambda: _ops.bn_act_rebuild(x, a, b, "relu", [], x.transpose(2, 3), a, b), "x2 must have x's dtype, device, sha"),
        (lambda: _ops.bn_act_rebuild(x, a, b, "relu", [], x.double(), a, b), "x2 must have x's dtype"),
        (lambda: _ops.bn_act_rebuild(x, a, b, "relu", [], x), "x2 needs its terms alpha2 and beta2"),
        (lambda: _ops.bn_act_rebuild(x, a, b, "relu", [], None, a, b), "got them without x2"),
        (lambda: _ops.bn_act_rebuild(x, a, b, "relu", [], x, a[:4], b), "alpha must be a contiguous Float tensor of s"),
        (lambda: _ops.bn_terms(None, None, torch.zeros(8), torch.ones(4), True, 1e-5, torch.float32),
         "var has shape \\[4\\]; expected \\[8\\]"),
        (lambda: _ops.bn_terms(None, None, torch.zeros(8), torch.ones(8), True, 1e-5, torch.int32),
         "dtype Int is not a float dtype"),
    ]
    if torch.cuda.is_available():  # (CUDA's terms have two rows: bn_terms makes them)
        cases.append((lambda: _ops.bn_act_rebuild(x.cuda(), a.cuda(), b.cuda(), "relu", []),
                      "alpha must be a contiguous Float tensor of shape \\[2, 8\\]"))
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_ops_are_not_differentiable():
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="x requires grad, but compaction is not differentiable"):
        _ops.bn_act_rebuild(x, torch.ones(4), torch.zeros(4), "relu", [])


@pytest.mark.parametrize("op", ["bn_terms", "bn_act_verify", "bn_act_rebuild", "residual_verify", "residual_rebuild"])
def test_opcheck(op):
    x, bn, w, b, mean, var, eps = _bn_case(torch.float32, (2, 4, 5, 5), "contiguous", True, affine=True)
    alpha, beta = _ops.bn_terms(w, b, mean, var, True, eps, torch.float32)
    args = {
        "bn_terms": (w, b, mean, var, True, eps, torch.float32),
        "bn_act_verify": (x, alpha, beta, "leaky_relu", [0.1], F.leaky_relu(bn, 0.1)),
        "bn_act_rebuild": (x, alpha, beta, "hardtanh", [0.0, 6.0]),
        "residual_verify": (x, alpha, beta, "relu", [], torch.relu(bn + bn), x, alpha, beta),
        "residual_rebuild": (x, alpha, beta, "relu", [], x, alpha, beta),
    }[op]
    torch.library.opcheck(getattr(_ops, op.replace("residual", "bn_act")).default, args)



# --- on CUDA: PyTorch's CUDA BatchNorm transform ------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")


def _cuda_bn_case(dtype: torch.dtype, shape: tuple[int, ...], layout: str, training: bool, seed: int = 0):
    """_bn_case on the GPU: PyTorch's native CUDA BatchNorm (torch.native_batch_norm, never cuDNN's);
    its saved mean and invstd (in eval, the running mean's copy and invstd it computed), and the
    running statistics."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = _layout((torch.randn(shape, generator=g) * 3 + 0.5).to(dtype), layout).cuda()
    w, b = (torch.rand(c, generator=g) + 0.5).to(dtype).cuda(), torch.randn(c, generator=g).to(dtype).cuda()
    rm, rv = torch.randn(c, generator=g).to(dtype).cuda(), (torch.rand(c, generator=g) + 0.1).to(dtype).cuda()
    y, save_mean, save_invstd = torch.native_batch_norm(x, w, b, rm.clone(), rv.clone(), training, 0.1, 1e-5)
    return x, y, w, b, (save_mean, save_invstd), (rm, rv)


@cuda
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape,layout", SHAPES, ids=["x".join(map(str, s)) + f"-{l}" for s, l in SHAPES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_replay_matches_pytorch(dtype, shape, layout, training):
    """What PyTorch's CUDA BatchNorm and each activation computed, rebuilt bit for bit from the saved
    statistics, and in eval from the running ones too (invstd computed as PyTorch's kernel does)."""
    x, bn, w, b, saved, running = _cuda_bn_case(dtype, shape, layout, training)
    stats = [(*saved, True)] + ([] if training else [(*running, False)])
    for mean, var, as_saved in stats:
        alpha, beta = _ops.bn_terms(w, b, mean, var, as_saved, 1e-5, dtype)
        assert alpha.shape == beta.shape == (2, shape[1]) and alpha.is_cuda
        _replays_every_activation(x, bn, alpha, beta, f", saved={as_saved}")


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_residual_replay_matches_pytorch(dtype):
    """act(bn(x) + bn2(x2)) and act(bn(x) + r), r added as it is, on CUDA."""
    x, bn, w, b, (mean, var), _ = _cuda_bn_case(dtype, (4, 8, 9, 7), "contiguous", True)
    x2, bn2, w2, b2, (mean2, var2), _ = _cuda_bn_case(dtype, (4, 8, 9, 7), "contiguous", False, seed=1)
    alpha, beta = _ops.bn_terms(w, b, mean, var, True, 1e-5, dtype)
    opmath = alpha.dtype
    zero, one = torch.zeros(8, dtype=opmath, device="cuda"), torch.ones(8, dtype=opmath, device="cuda")
    same = _ops.bn_terms(None, torch.full_like(zero, -0.0), zero, one, True, 0.0, dtype)
    r = x2.clone()
    r.view(-1)[:6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.0, -3.0]).to(dtype)
    for second, terms, added in [(x2, _ops.bn_terms(w2, b2, mean2, var2, True, 1e-5, dtype), bn2), (r, same, r)]:
        for name, (act, args, fn) in ACTS.items():
            out = bn.clone()
            out += added
            want = fn(out)
            assert bool(_ops.bn_act_verify(x, alpha, beta, act, args, want, second, *terms)), f"{name}: missed"
            assert_bitwise_equal(_ops.bn_act_rebuild(x, alpha, beta, act, args, second, *terms), want, name)


def _bn_nodes(model: torch.nn.Module, x: torch.Tensor) -> set[str]:
    """The names of the BatchNorm nodes a forward of `model` makes (cuDNN's or PyTorch's)."""
    seen, names, todo = set(), set(), [model(x).grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "BatchNorm" in fn.name():
            names.add(fn.name())
        todo.extend(f for f, _ in fn.next_functions)
    return names


@cuda
@pytest.mark.parametrize("cudnn", [False, True], ids=["native", "cudnn"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["nn.ReLU", "relu_ext.ReLU", "relu_ext.ReLU6"])
def test_cuda_training_step_replays(act, dtype, cudnn):
    """On CUDA the step is bitwise the same; PyTorch's own BatchNorm is replayed every time; cuDNN's
    (float32) is tried every time and replayed where verification says its bits are the formula's."""
    model = _net(NETS[act], dtype).train().cuda()
    x = torch.randn(4, 3, 16, 16, dtype=dtype, device="cuda")
    with torch.backends.cudnn.flags(enabled=cudnn):
        nodes = _bn_nodes(model, x)
        sc = relu_ext.save_compact()
        assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    if nodes == {"NativeBatchNormBackward0"}:
        assert sc.replayed == 3 and sc.replay_misses == 0, sc.report()
    else:
        assert sc.replayed + sc.replay_misses == 3, (nodes, sc.report())


# --- inside save_compact() ------------------------------------------------------------------


def _net(act: Callable[[], torch.nn.Module], dtype: torch.dtype, bn: Callable[[int], torch.nn.Module] | None = None):
    torch.manual_seed(0)
    bn = bn or torch.nn.BatchNorm2d
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), bn(16), act(),
        torch.nn.Conv2d(16, 16, 3, padding=1), bn(16), act(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1), bn(32), act(),
        torch.nn.Conv2d(32, 4, 1), torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 10),
    ).to(dtype)


NETS = {
    "nn.ReLU": lambda: torch.nn.ReLU(),
    "nn.ReLU-inplace": lambda: torch.nn.ReLU(inplace=True),
    "relu_ext.ReLU": lambda: relu_ext.ReLU(),
    "nn.ReLU6-inplace": lambda: torch.nn.ReLU6(inplace=True),
    "relu_ext.ReLU6": lambda: relu_ext.ReLU6(),
    "nn.LeakyReLU": lambda: torch.nn.LeakyReLU(0.1),
    "relu_ext.LeakyReLU": lambda: relu_ext.LeakyReLU(0.1),
    "nn.Hardsigmoid": lambda: torch.nn.Hardsigmoid(),
    "relu_ext.Threshold": lambda: relu_ext.Threshold(0.1, 0.0),
}


def _recorded(monkeypatch) -> list[Any]:
    """The recipes save_compact makes (a list filled as it makes them)."""
    made: list[Any] = []
    real = compact.Replayed.__init__

    def init(self: Any, *args: Any) -> None:
        real(self, *args)
        made.append(self)

    monkeypatch.setattr(compact.Replayed, "__init__", init)
    return made


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", NETS)
def test_training_step_is_bitwise_the_same(act, dtype):
    model = _net(NETS[act], dtype).train()
    x = torch.randn(4, 3, 16, 16, dtype=dtype)
    with relu_ext.save_compact() as sc:
        pass
    got = train_step(model, x, sc)
    assert_same_step(got, train_step(model, x, contextlib.nullcontext()))
    assert sc.replayed == 3 and sc.replay_misses == 0, sc.report()


class _Residual(torch.nn.Module):
    """Residual blocks as torchvision's BasicBlock adds them: `identity` is an average-pool output
    (kept as it is by the next conv), a downsample BatchNorm's output, then three times the
    previous block's output."""

    def __init__(self, act: Callable[[], torch.nn.Module], dtype: torch.dtype, alpha: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv, bn = torch.nn.Conv2d, torch.nn.BatchNorm2d
        self.stem = torch.nn.Sequential(conv(3, 16, 3, padding=1), bn(16), act(), torch.nn.AvgPool2d(2))
        self.blocks = torch.nn.ModuleList([
            torch.nn.Sequential(conv(16, 16, 3, padding=1), bn(16)),
            torch.nn.Sequential(conv(16, 32, 3, stride=2, padding=1), bn(32)),
            *(torch.nn.Sequential(conv(32, 32, 3, padding=1), bn(32)) for _ in range(3)),
        ])
        self.down = torch.nn.Sequential(conv(16, 32, 1, stride=2), bn(32))
        self.acts = torch.nn.ModuleList([act() for _ in self.blocks])
        self.head = torch.nn.Sequential(conv(32, 4, 1), torch.nn.Flatten(), torch.nn.Linear(4 * 8 * 8, 10))
        self.alpha = alpha
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, (block, act) in enumerate(zip(self.blocks, self.acts)):
            out = block(x)
            out.add_(self.down(x) if i == 1 else x, alpha=self.alpha)
            x = act(out)
        return self.head(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", NETS)
def test_residual_blocks_replay(act, dtype, monkeypatch):
    """Each block output is replayed from what the graph keeps anyway, with its identity
    rebuilt for it in at most one pass; the fourth block's identity would take two (a chain)
    so it is compacted or kept, and the fifth replays from that; bitwise the same step."""
    model = _Residual(NETS[act], dtype).train()
    x = torch.randn(4, 3, 32, 32, dtype=dtype)
    made = _recorded(monkeypatch)
    sc = relu_ext.save_compact()
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert (sc.replayed, sc.replay_misses) == (5, 0), sc.report()  # the stem's activation, blocks 1, 2, 3, 5
    stem, b1, b2, b3, b5 = made
    assert stem.x2 is None and isinstance(b1.x2, torch.Tensor) and b1.alpha2.eq(1).all()  # the pool's output
    assert isinstance(b2.x2, torch.Tensor) and b2.alpha2.ne(1).any()  # the downsample BatchNorm's input
    assert b3.x2 is b2 and b3.depth == 2
    # Block 4's output: compacted (ReLU's, about half zeros), else maybe kept as it is (too few zeros).
    relu = act in ("nn.ReLU", "nn.ReLU-inplace", "relu_ext.ReLU")
    assert isinstance(b5.x2, compact.Compacted if relu else (compact.Compacted, torch.Tensor)), type(b5.x2)


def test_a_recipe_verifies_with_its_identity_as_the_forward_holds_it():
    """A block's replay reads the block before it (replayed, or compacted) as its identity: verified
    with that tensor itself while the forward holds it unchanged, no pass to rebuild it; rebuilt in
    backward only. Bitwise the same step."""
    model = _Residual(NETS["nn.ReLU"], torch.float32).train()
    x = torch.randn(4, 3, 32, 32)
    rebuilt: list[str] = []
    real_expand, real_rebuild = forms._C.expand, forms._C.bn_act_rebuild

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(forms._C, "bn_act_rebuild", lambda *a: rebuilt.append("replay") or real_rebuild(*a))
        patch.setattr(forms._C, "expand", lambda *a: rebuilt.append("expand") or real_expand(*a))
        sc = relu_ext.save_compact()
        with sc:
            loss = model(x).sum()
        assert rebuilt == [] and sc.replayed == 5, sc.report()
        loss.backward()
        assert rebuilt.count("replay") >= 5 and "expand" in rebuilt, rebuilt
    assert_same_step(train_step(model, x, relu_ext.save_compact()), train_step(model, x, contextlib.nullcontext()))


class _DenseBlocks(torch.nn.Module):
    """Dense blocks as torchvision's DenseNet builds them: each layer concatenates the block's input
    and every earlier layer's output, then BatchNorm -> activation -> conv; then the block's whole
    concatenation goes to a transition (BatchNorm -> activation -> conv -> average pool), the last
    block's to the head (BatchNorm -> activation -> conv -> linear)."""

    def __init__(self, act: Callable[[], torch.nn.Module], dtype: torch.dtype, layers: int = 4, growth: int = 4,
                 dim: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv, bn = torch.nn.Conv2d, torch.nn.BatchNorm2d
        self.stem = conv(3, 8, 3, padding=1)
        self.blocks = torch.nn.ModuleList([
            torch.nn.ModuleList([torch.nn.Sequential(bn(c + growth * i), act(), conv(c + growth * i, growth, 3, padding=1))
                                 for i in range(layers)])
            for c in (8, 8)
        ])
        wide = 8 + growth * layers
        self.transition = torch.nn.Sequential(bn(wide), act(), conv(wide, 8, 1), torch.nn.AvgPool2d(2))
        self.head = torch.nn.Sequential(bn(wide), act(), conv(wide, 4, 1), torch.nn.Flatten(),
                                        torch.nn.Linear(4 * 16 * 16, 10))  # (for 32 x 32 inputs)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            features = [x]
            for layer in block:
                features.append(layer(torch.cat(features, 1)))
            x = torch.cat(features, 1)
            x = self.transition(x) if i == 0 else x
        return self.head(x)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", NETS)
def test_dense_blocks_keep_concatenations_in_pieces(act, dtype, layout):
    """Each block's concatenations after its first are kept as the one before plus what they add,
    the activations after them replayed from them; bitwise the same step."""
    model = _DenseBlocks(NETS[act], dtype).train()
    x = _layout(torch.randn(2, 3, 32, 32, dtype=dtype), layout)
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    sc = relu_ext.save_compact()
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    # Per block: layers 2-4 and the block's whole concatenation; every BatchNorm -> activation output.
    assert (sc.concatenated, sc.replayed, sc.replay_misses) == (8, 10, 0), sc.report()
    assert sc.kept_by_reason["not_activation"] > 0  # (the first of each block, as it is, among others)


def test_concatenation_pieces_come_back_bit_for_bit():
    """Concatenations along the last dimension of adversarial data (NaN payloads, -0.0, denormals),
    each beginning with the one before: kept in pieces, restored bit for bit in their own layout."""
    from conftest import adversarial

    restored: list[torch.Tensor] = []

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(t)
            return t.sum()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            restored.append(ctx.saved_tensors[0])
            return g.expand(restored[-1].shape)

    parts = [adversarial(128 * 40, torch.float32, seed=i).view(128, 40).requires_grad_() for i in range(4)]
    with relu_ext.save_compact() as sc:
        cats = [torch.cat(parts[: i + 1], -1) for i in range(len(parts))]
        want = [c.detach().clone() for c in cats]
        loss = sum(Keep.apply(c) for c in cats)
    assert sc.concatenated == 3, sc.report()
    assert sc.bytes_held < sum(t.nbytes for t in want) // 2
    del cats
    loss.backward()
    for got, expect in zip(restored[::-1], want):
        assert got.stride() == expect.stride()
        assert_bitwise_equal(got, expect)


def test_concatenation_whose_inputs_changed_is_not_chained_and_stays_exact():
    """The first layer's output changed in place (under no_grad) after the second layer's concatenation
    took it: the third's does not begin with the second's any more, so it starts a chain of its own
    (verified, not assumed from the graph); the step is still the same."""
    model = _DenseBlocks(NETS["nn.ReLU"], torch.float32).train()
    first: list[torch.Tensor] = []
    model.blocks[0][0].register_forward_hook(lambda m, args, out: first.append(out))

    def change(m: Any, args: Any, out: torch.Tensor) -> None:
        with torch.no_grad():
            first[-1][0, 0, 0, 0] += 1.0

    model.blocks[0][1].register_forward_hook(change)
    sc = relu_ext.save_compact()
    x = torch.randn(2, 3, 32, 32)
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert (sc.concatenated, sc.replay_misses) == (7, 0), sc.report()


def test_concatenation_changed_after_forward_raises():
    """The first of a chain (kept as it is, and read by every later one) changed in place after the
    forward: PyTorch's in-place error, as without hooks (its BatchNorm keeps it)."""
    model = _DenseBlocks(NETS["nn.ReLU"], torch.float32).train()
    for ctx in (relu_ext.save_compact(), contextlib.nullcontext()):
        first: list[torch.Tensor] = []
        handle = model.blocks[0][0].register_forward_pre_hook(lambda m, args: first.append(args[0]))
        with ctx:
            loss = model(torch.randn(2, 3, 32, 32)).sum()
        handle.remove()
        with torch.no_grad():
            first[0].add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_same_bits_on_device_compares_bits_not_values():
    """The comparison concatenations and pools are verified with off the CPU (integer views, one sync),
    run here on CPU tensors: -0.0 is not +0.0, NaN payloads count, NaN meets itself, strides do not
    matter, and one differing element among several pairs is seen."""
    from conftest import adversarial

    for dtype in DTYPES:
        a = adversarial(4096, dtype, seed=5).view(64, 64)
        b = a.t().contiguous().t()  # the same values, another layout
        assert compact._same_bits_on_device([(a, b), (a[1:], b[1:])])
        for i in (0, 2049, 4095):
            c = b.clone()
            torch.as_strided(c.view(INT_OF[dtype]), (4096,), (1,))[i] ^= 1  # one bit: a NaN's payload, a denormal, the last one
            assert not compact._same_bits_on_device([(a, b), (a, c)]), (dtype, i)
        z, mz = torch.zeros(4, dtype=dtype), torch.full((4,), -0.0, dtype=dtype)
        assert not compact._same_bits_on_device([(z, mz)]) and z.equal(mz)  # (equal as numbers)
    assert compact._same_bits_on_device([])
    with pytest.raises(ValueError, match="same shape"):
        compact._same_bits_on_device([(torch.zeros(3), torch.zeros(4))])


def test_the_fingerprint_of_a_remade_tensor_sees_one_bit():
    """forms._bits_sum, the fingerprint a remade tensor's rebuild is checked against: the same for the
    same bits in the same layout, whatever the thread count, the sizes (a last word partly filled) or
    where the tensor starts; another for one bit changed anywhere (a NaN's payload, the sign of zero,
    the last element); a tensor that is not dense refused with a message."""
    from conftest import adversarial

    for dtype in DTYPES:
        for n in (4096, 4099, 3):
            a = adversarial(n, dtype, seed=7)
            b = torch.empty(n + 1, dtype=dtype)[1:].copy_(a)  # (the same bits, starting elsewhere)
            threads = torch.get_num_threads()
            try:
                torch.set_num_threads(1)
                one = forms._bits_sum(a)
            finally:
                torch.set_num_threads(threads)
            assert forms._bits_sum(a) == forms._bits_sum(b) == one, (dtype, n)
            for i in sorted({0, n // 2, n - 1}):
                c = a.clone()
                c.view(INT_OF[dtype])[i] ^= 1
                assert forms._bits_sum(c) != one, (dtype, n, i)
        z, mz = torch.zeros(8, dtype=dtype), torch.zeros(8, dtype=dtype)
        mz[3] = -0.0  # (one element: changes of several can cancel out, as eight sign bits of float64 do)
        assert forms._bits_sum(z) != forms._bits_sum(mz)
    t = torch.randn(16, 8, 4).permute(2, 0, 1)  # (dense, another order)
    assert forms._bits_sum(t) == forms._bits_sum(t.clone())
    with pytest.raises(RuntimeError, match="dense strided CPU tensor"):
        forms._bits_sum(torch.randn(8, 8)[:, ::2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_concatenations_and_pools_are_kept_as_recipes_on_cuda(dtype):
    """On CUDA too: a dense block's concatenations kept in pieces, a max-pool output gathered from
    its input; bitwise the same step."""
    model = _DenseBlocks(NETS["nn.ReLU"], dtype).train().cuda()
    x = torch.randn(2, 3, 32, 32, dtype=dtype, device="cuda")
    sc = relu_ext.save_compact()
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert sc.concatenated == 8, sc.report()
    torch.manual_seed(0)
    pool = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(3, 2, 1), torch.nn.Conv2d(16, 4, 3, padding=1)).to("cuda", dtype)
    sc = relu_ext.save_compact()
    assert_same_step(train_step(pool, x, sc), train_step(pool, x, contextlib.nullcontext()))
    assert sc.pooled == 1, sc.report()


POOLS = {"2": dict(kernel_size=2), "3s2p1": dict(kernel_size=3, stride=2, padding=1),
         "3s2-ceil": dict(kernel_size=3, stride=2, ceil_mode=True), "3s2d2": dict(kernel_size=3, stride=2, dilation=2)}


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_pool_outputs_are_gathered(dtype, layout, pool):
    """A max-pool output kept by the next conv is kept as a recipe (the pool's input, itself replayed,
    at its indices, narrowed); bitwise the same step."""
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d, torch.nn.BatchNorm2d
    model = torch.nn.Sequential(conv(3, 16, 3, padding=1), bn(16), torch.nn.ReLU(), torch.nn.MaxPool2d(**POOLS[pool]),
                                conv(16, 4, 3, padding=1), torch.nn.Flatten(), torch.nn.LazyLinear(10)).to(dtype)
    x = _layout(torch.randn(2, 3, 32, 32, dtype=dtype), layout)
    model(x)  # (the lazy layer's size)
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    sc = relu_ext.save_compact()
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert (sc.pooled, sc.replayed, sc.narrowed) == (1, 1, 1), sc.report()


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_pool_of_adversarial_data_stays_exact(dtype, layout):
    """NaN payloads, ±0.0, ±inf, denormals in the pool's input: the recipe is used where the gather gives
    the pool's own bits (float32, float64: every element is a copy) and the step stays bitwise the same."""
    from conftest import adversarial

    x = _layout(adversarial(2 * 8 * 32 * 32, dtype, seed=4).view(2, 8, 32, 32), layout)
    w = torch.randn(2, 8, 16, 16, dtype=dtype, requires_grad=True)

    def step(ctx: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        leaf = x.clone().requires_grad_()
        w.grad = None
        with ctx:
            y = F.max_pool2d(leaf * 1, 2)
            loss = (y * w).sum()  # (the mul keeps y for w's gradient)
        loss.backward()
        return y.detach(), leaf.grad, w.grad

    sc = relu_ext.save_compact()
    for got, want in zip(step(sc), step(contextlib.nullcontext())):
        assert_bitwise_equal(got, want)
    if dtype in (torch.float32, torch.float64):
        assert sc.pooled == 1, sc.report()


class _PoolAfterAdd(torch.nn.Module):
    """A max-pool of relu(bn(conv(x)) + bn2(conv2(x))): the pool's input is a recipe with a second term."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(3, 8, 1)
        self.bn_a, self.bn_b = torch.nn.BatchNorm2d(8), torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.max_pool2d(torch.relu(self.bn_a(self.a(x)) + self.bn_b(self.b(x))), 3, 2, 1))


@pytest.mark.parametrize("second", [False, True], ids=["bn", "bn+bn"])
def test_max_pool_recipe_is_verified_at_the_indices_only(second, monkeypatch):
    """A max-pool output over a replayed input is verified from the BatchNorm inputs' elements at the
    indices: packing rebuilds nothing of the pool input's size (that pass would cost as much as the
    rebuild in backward); bitwise the same step."""
    model = (_PoolAfterAdd() if second else torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1),
        torch.nn.Conv2d(8, 4, 3))).train()
    x = torch.randn(2, 3, 32, 32)
    sizes: list[tuple[int, ...]] = []

    real = forms._C.bn_act_rebuild
    monkeypatch.setattr(forms._C, "bn_act_rebuild", lambda x, *args: sizes.append(tuple(x.shape)) or real(x, *args))
    sc = relu_ext.save_compact()
    with sc:
        model(x)
    assert (sc.pooled, sc.replayed) == (1, 1) and sizes == [(2, 8, 16, 16)], (sc.report(), sizes)
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))


class _PoolOfPool(torch.nn.Module):
    """googlenet's pattern: a stage's max-pool output goes to a conv and to another max-pool (an
    inception branch), whose output a conv keeps too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                        torch.nn.MaxPool2d(3, 2, ceil_mode=True))
        self.branch1, self.branch2 = torch.nn.Conv2d(16, 4, 1), torch.nn.Conv2d(16, 4, 1)
        self.pool = torch.nn.MaxPool2d(3, 1, padding=1, ceil_mode=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return torch.cat([self.branch1(x), self.branch2(self.pool(x))], 1)


def test_pool_of_pool_rebuilds_while_packing_and_keeps_nothing():
    """The second pool's recipe is verified against the first pool's output rebuilt from its recipe:
    nothing that rebuild reads is kept for backward then, and the first pool's indices are still
    narrowed when the context exits (nothing else holds them); bitwise the same step."""
    model = _PoolOfPool().train()
    x = torch.randn(2, 3, 32, 32)
    sc = relu_ext.save_compact()
    packed: list[Any] = []
    pack = sc.pack_hook
    sc.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert (sc.pooled, sc.narrowed, sc.replayed) == (2, 2, 1), sc.report()
    packed.clear()
    with sc:
        model(x)
    assert all(getattr(p, "restored", None) is None for p in packed)


def test_max_pool_input_changed_after_forward_raises():
    x = torch.randn(2, 8, 32, 32, requires_grad=True)
    for ctx in (relu_ext.save_compact(), contextlib.nullcontext()):
        with ctx:
            h = x * 1
            loss = (F.max_pool2d(h, 2) * torch.randn(8, 16, 16)).sum()
        with torch.no_grad():
            h.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("blocks", [_Residual, _DenseBlocks], ids=["residual", "dense"])
@pytest.mark.parametrize("where", ["retain_graph", "checkpoint"])
def test_blocks_replay_twice_and_under_checkpoint(where, blocks):
    """Recipes that read another recipe, a compacted tensor or a concatenation in pieces, rebuilt
    again (double backward, then backward with retain_graph twice), and inside a checkpointed forward."""
    from torch.utils.checkpoint import checkpoint

    model = blocks(NETS["nn.ReLU"], torch.float64).train()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64, requires_grad=True)

    def run(ctx: Any) -> list[torch.Tensor]:
        def forward() -> torch.Tensor:
            with ctx:  # (inside the checkpoint: its recomputation runs under it too)
                return model(x)

        for p in (*model.parameters(), x):
            p.grad = None
        if where == "checkpoint":
            loss = checkpoint(forward, use_reentrant=False).square().sum()
        else:
            (gx,) = torch.autograd.grad(forward().sum(), x, create_graph=True)
            loss = gx.square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    sc = relu_ext.save_compact()
    got, want = run(sc), run(contextlib.nullcontext())
    assert len(got) == len(want) > 10 and sc.replayed >= 5 and sc.replay_misses == 0, sc.report()
    assert (sc.concatenated > 0) == (blocks is _DenseBlocks), sc.report()
    for a, b in zip(got, want):
        assert_bitwise_equal(a, b)


def test_residual_add_with_another_alpha_is_not_replayed():
    model = _Residual(NETS["nn.ReLU-inplace"], torch.float32, alpha=2.0).train()
    x = torch.randn(4, 3, 32, 32)
    sc = relu_ext.save_compact()
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert (sc.replayed, sc.replay_misses) == (1, 0), sc.report()  # the stem's only


def test_residual_identity_changed_after_forward_raises():
    model = _Residual(NETS["nn.ReLU-inplace"], torch.float32).train()
    pooled: list[torch.Tensor] = []
    model.stem.register_forward_hook(lambda m, i, out: pooled.append(out))
    with relu_ext.save_compact() as sc:
        loss = model(torch.randn(4, 3, 32, 32)).sum()
    assert sc.replayed == 5
    with torch.no_grad():
        pooled[0].add_(1.0)  # the first block's identity, which its recipe reads
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("case", ["channels_last", "eval_with_grads", "affine_false", "momentum_none",
                                  "no_running_stats", "frozen_bias", "bias_zero_frozen", "computed_bias"])
def test_batchnorm_configurations(case, monkeypatch):
    """Every BatchNorm configuration trains bitwise the same; those whose terms the graph
    holds are replayed, the one it does not (a frozen nonzero bias) misses and is compacted. A bias
    computed in the graph (a parametrization; FSDP's views of its flat parameter), which no node
    keeps, is not tried: compacted, no check spent."""
    bn: Callable[[int], torch.nn.Module] = {
        "affine_false": lambda c: torch.nn.BatchNorm2d(c, affine=False),
        "momentum_none": lambda c: torch.nn.BatchNorm2d(c, momentum=None),
        "no_running_stats": lambda c: torch.nn.BatchNorm2d(c, track_running_stats=False),
    }.get(case, torch.nn.BatchNorm2d)
    model = _net(NETS["nn.ReLU-inplace"], torch.float32, bn).train()
    x = torch.randn(4, 3, 16, 16)
    if case == "channels_last":
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    if case == "eval_with_grads":  # frozen statistics, trained affine terms
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eval()
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
    if case in ("frozen_bias", "bias_zero_frozen"):
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.bias.copy_(torch.randn_like(m.bias) if case == "frozen_bias" else torch.zeros_like(m.bias))
                    m.bias.requires_grad_(False)
    if case == "computed_bias":
        from torch.nn.utils import parametrize

        class Doubled(torch.nn.Module):
            def forward(self, b: torch.Tensor) -> torch.Tensor:
                return b * 2

        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                torch.nn.init.uniform_(m.bias, -1, 1)
                parametrize.register_parametrization(m, "bias", Doubled())
    made = _recorded(monkeypatch)
    sc = relu_ext.save_compact()
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    if case == "frozen_bias":  # the bias is in no node: the replay with none misses; compaction serves
        assert (sc.replayed, sc.replay_misses, sc.compacted) == (0, 3, 3), sc.report()
    elif case == "computed_bias":
        assert (sc.replayed, sc.replay_misses, sc.compacted) == (0, 0, 3), sc.report()
    else:
        assert (sc.replayed, sc.replay_misses) == (3, 0), sc.report()
        assert len(made) == 3 and all(r.x.dim() == 4 for r in made)


def test_recompute_can_be_turned_off():
    model = _net(NETS["nn.ReLU"], torch.float32).train()
    x = torch.randn(4, 3, 16, 16)
    sc = relu_ext.save_compact(recompute=False)
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert (sc.replayed, sc.replay_misses, sc.compacted) == (0, 0, 3) and "recompute=False" in repr(sc)


def test_batchnorm_output_changed_before_the_activation_misses_and_stays_exact():
    """A BatchNorm output changed (without autograd) before the activation: the replay would
    differ, verification sees it, and the output is compacted instead."""
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
    w = torch.randn(8, 16, 16)
    x = torch.randn(2, 3, 16, 16)

    def run(ctx: Any) -> list[torch.Tensor]:
        for p in (*conv.parameters(), *bn.parameters()):
            p.grad = None
        with ctx:
            h = bn(conv(x))
            with torch.no_grad():
                h.view(-1)[5] += 1.0
            y = torch.relu(h)
            loss = (y * w).sum()  # saves y
        loss.backward()
        return [p.grad.clone() for p in (*conv.parameters(), *bn.parameters())]

    sc = relu_ext.save_compact()
    for a, b in zip(run(sc), run(contextlib.nullcontext())):
        assert_bitwise_equal(a, b)
    assert (sc.replayed, sc.replay_misses, sc.compacted) == (0, 1, 1), sc.report()


def test_batchnorm_input_changed_after_forward_raises():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(8)
    w = torch.randn(8, 16, 16)
    c = torch.randn(2, 8, 16, 16, requires_grad=True) * 1  # BatchNorm's input, kept by its node
    with relu_ext.save_compact() as sc:
        loss = (torch.relu(bn(c)) * w).sum()
    assert sc.replayed == 1
    with torch.no_grad():
        c.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_residual_identity_whose_recipe_went_stale_is_not_read():
    """An identity kept as a recipe whose BatchNorm input changed in place since: the next
    block's output is not rebuilt from it (the forward goes on), and backward raises
    PyTorch's in-place error, as it does without hooks."""
    torch.manual_seed(0)
    bn1, bn2, bn3 = (torch.nn.BatchNorm2d(8) for _ in range(3))
    c1, c2, c3 = (torch.randn(2, 8, 16, 16, requires_grad=True) * 1 for _ in range(3))
    with relu_ext.save_compact() as sc:
        h = torch.relu(bn1(c1) + bn2(c2))  # saved by its ReLU node as a recipe
        with torch.no_grad():
            c1.add_(1.0)
        y = torch.relu(bn3(c3) + h)
        loss = (y * torch.randn(8, 16, 16)).sum()
    assert (sc.replayed, sc.replay_misses) == (1, 0), sc.report()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_saved_tensors_of_other_hooks_are_not_unpacked():
    """A BatchNorm whose tensors other hooks packed (here: outside save_compact, under hooks
    that count their unpacks) is not replayed, and those hooks' unpack never runs for it."""
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(8)
    c = torch.randn(2, 8, 16, 16, requires_grad=True) * 1
    unpacked: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: unpacked.append(1) or t):
        h = bn(c)
    with relu_ext.save_compact() as sc:
        y = torch.relu(h)
        loss = (y * torch.randn(8, 16, 16)).sum()
    assert unpacked == [] and sc.replayed == 0 and sc.compacted == 1
    loss.backward()


def _real_model_steps(name: str) -> tuple[relu_ext.save_compact, relu_ext.save_compact]:
    """torchvision's `name` (random weights, 2 x 3 x 64 x 64): a step under save_compact(), bitwise
    the same as without hooks, and one with recompute=False; their two contexts."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = getattr(tv.models, name)(weights=None).train()
    x = torch.randn(2, 3, 64, 64)
    on, off = relu_ext.save_compact(), relu_ext.save_compact(recompute=False)
    assert_same_step(train_step(model, x, on), train_step(model, x, contextlib.nullcontext()))
    train_step(model, x, off)
    return on, off


def test_real_model_replays_and_trains_the_same():
    """resnet18: every BN -> ReLU output replayed, none missed; the step bitwise the same; less held."""
    on, off = _real_model_steps("resnet18")
    # resnet18's ReLUs: 1 stem + 2 per block x 8 blocks; one per block follows the residual add
    # (identity: the max-pool output, a downsample BatchNorm's, the stage's first block's output).
    # The max-pool output is a recipe of its own (its input at its indices), so the first block's
    # output, which would rebuild it too, is compacted instead (or kept: too few zeros).
    assert (on.replayed, on.replay_misses, on.pooled) == (16, 0, 1), on.report()
    assert on.compacted + on.kept_by_reason["too_few_zeros"] == 1, on.report()
    assert on.bytes_held < off.bytes_held < off.bytes_saved_for_backward


def test_real_densenet_keeps_concatenations_in_pieces():
    """densenet121: its blocks' concatenations kept in pieces, the activations after them replayed from
    them, none missed; the step bitwise the same; their pieces hold a fraction of their bytes."""
    on, off = _real_model_steps("densenet121")
    # 58 concatenations (6 + 12 + 24 + 16 layers, and three transitions) follow the first of a block;
    # at 64 x 64 the last block's (2 x 2) are too small to bother with.
    assert on.concatenated >= 30 and on.replay_misses == 0, on.report()
    assert on._stats.held["concatenated"] < on._stats.nbytes["concatenated"] / 4, on.report()
    assert on.bytes_held < off.bytes_held - on._stats.nbytes["concatenated"] / 2, (on.report(), off.report())


class _PassThrough(torch.autograd.Function):
    """What FSDP2 puts before each sharded module: its inputs returned as views of themselves."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


@pytest.mark.parametrize("alias", ["function", "view_as", "slice"])
@pytest.mark.parametrize("recompute", [True, False])
def test_an_alias_of_an_activation_output_is_kept_as_it(alias, recompute):
    """A layer that keeps a view of an activation output with all its elements (FSDP2's pass-through
    Function, view_as, [:]) holds the same bits as the output itself: it is kept as that output, once
    (a recipe or a compaction of it), not as a second full tensor; bitwise the same step. A view of
    part of it is not an alias (kept as it is)."""
    torch.manual_seed(0)
    lin, bn, out = torch.nn.Linear(16, 128), torch.nn.BatchNorm1d(128), torch.nn.Linear(128, 4)
    view = {"function": _PassThrough.apply, "view_as": lambda h: h.view_as(h), "slice": lambda h: h[:]}[alias]

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn, self.out = lin, bn, out

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.bn(self.lin(x)))  # (the ReLU keeps its output too)
            return self.out(view(h)) + self.out(view(h)[:32].repeat(2, 1))

    model, x = Net().train(), torch.randn(64, 16)
    sc = relu_ext.save_compact(recompute=recompute)
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert (sc.replayed, sc.compacted) == ((1, 0) if recompute else (0, 1)), sc.report()
    with relu_ext.save_compact(recompute=recompute) as plain:  # (the same, without the views)
        h = torch.relu(bn(lin(x)))
        (out(h) + out(h[:32].repeat(2, 1))).float().square().mean()
    assert sc.bytes_held == plain.bytes_held and sc.bytes_saved_for_backward == plain.bytes_saved_for_backward


class _FeedForward(torch.nn.Module):
    """A transformer's feed-forward block on (batch, tokens, features): Linear -> activation -> Linear.
    The second Linear keeps a 2-D view of the activation output (linear folds the batch dimensions),
    and `h.t() @ w` a transposed one: both have every element of the output."""

    def __init__(self, act: Callable[[], torch.nn.Module], dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.act, self.b = torch.nn.Linear(16, 128), act(), torch.nn.Linear(128, 16)
        self.w = torch.nn.Parameter(torch.randn(96, 8))
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.a(x))
        return self.b(h).sum() + torch.mm(h.reshape(96, 128).t(), self.w).sum()


@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["nn.ReLU", "relu_ext.ReLU", "relu_ext.ReLU6", "relu_ext.Threshold"])
def test_a_reshaped_or_transposed_activation_output_is_kept_as_the_output(act, dtype, recompute):
    """Views with every element of an activation output, in another shape or order, are kept as the
    output's form (compacted here, once for all its holders), not as second full tensors; bitwise the
    same step, and the same double backward. (Not in place: a Linear's 3-D output is itself a view,
    and an activation in place on a view leaves no activation node on the tensor the views share.)"""
    model, x = _FeedForward(NETS[act], dtype).train(), torch.randn(4, 24, 16, dtype=dtype)
    sc = relu_ext.save_compact(recompute=recompute)
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert sc.compacted == 1, sc.report()
    h_bytes = 4 * 24 * 128 * x.element_size()
    assert sc.bytes_held < h_bytes, sc.report()  # (kept as they are, the two views were two whole h)

    def second_order(ctx: Any) -> list[torch.Tensor]:
        with ctx:
            loss = model(x).float().square()
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        return list(torch.autograd.grad(sum(g.float().square().sum() for g in grads), list(model.parameters())))

    for got, want in zip(second_order(relu_ext.save_compact(recompute=recompute)), second_order(contextlib.nullcontext())):
        assert_bitwise_equal(got, want)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_a_flattened_activation_output_after_batchnorm_is_a_recipe(layout):
    """conv -> BatchNorm -> ReLU -> Flatten -> Linear: the Linear keeps a flattened view of the ReLU
    output, which is rebuilt from the BatchNorm's input (contiguous: a view with every element;
    channels_last: flatten copies, so there is no view, and the copy is kept as it is)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), relu_ext.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 4)).train()
    x = _layout(torch.randn(4, 3, 16, 16), layout)
    if layout == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    sc = relu_ext.save_compact()
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert sc.replayed == (1 if layout == "contiguous" else 0), sc.report()


def test_a_whole_view_kept_as_it_is_keeps_pytorchs_inplace_check():
    """A 2-D view of an activation output that is kept as the view itself (too few zeros to compact)
    keeps PyTorch's in-place check: the output changed after the forward makes backward raise."""
    torch.manual_seed(0)
    lin_a, lin_b = torch.nn.Linear(16, 128), torch.nn.Linear(128, 4)
    with torch.no_grad():
        lin_a.bias.fill_(100.0)  # (every ReLU output positive: nothing to compact)
    x = torch.randn(4, 24, 16)
    for ctx in (relu_ext.save_compact(), contextlib.nullcontext()):
        with ctx:
            h = torch.relu(lin_a(x))
            loss = lin_b(h).sum()
        with torch.no_grad():
            h.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


@pytest.mark.parametrize("recompute", [True, False])
def test_a_negated_view_is_not_an_alias(recompute):
    """torch._neg_view of an activation output has its base's bits and geometry but other values: a
    layer that keeps it gets it as it is (kept), never the base; bitwise the same step."""
    torch.manual_seed(0)
    bn, lin = torch.nn.BatchNorm1d(128), torch.nn.Linear(128, 4)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bn, self.lin = bn, lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch._neg_view(torch.relu(self.bn(x))))

    model, x = Net().train(), torch.randn(64, 128)
    sc = relu_ext.save_compact(recompute=recompute)
    assert_same_step(train_step(model, x, sc), train_step(model, x, contextlib.nullcontext()))
    assert sc.kept_by_reason["not_activation"] >= 1, sc.report()
