"""Shared helpers: bitwise comparison, adversarial data, device / CPU-ISA parametrization."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest

# pytest-xdist runs a worker per core here, and torch gives each worker an OpenMP thread per
# core. libgomp's default wait spins at every barrier, so one worker's idle threads burn the core
# the other worker needs: the suite ran several times slower. Passive waiting changes no result
# and no code path, only how idle threads wait. libgomp reads it when it loads (import torch),
# so it is set before that; a caller's own setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after the OpenMP setting)

import relu_ext
import tiers
from relu_ext import _C

def pytest_addoption(parser: pytest.Parser) -> None:
    tiers.add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    tiers.configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.select(config, items)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16, torch.bfloat16: torch.int16}
SIZES = [0, 1, 31, 33, 1023, 4097, 1_000_003]

HAS_GPU = torch.cuda.is_available()
# CUDA runs wherever a GPU is visible, whether or not this build has CUDA
# kernels: a build that lacks them then fails instead of skipping.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU visible"))]


def tool_env() -> dict[str, str]:
    """This process's environment without the sanitizer leg's preloaded ASan runtime and its
    options: for a compiler or tool run from a test (it must not run under them)."""
    return {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}


def _supported_isas() -> list[str]:
    previous = _C.cpu_isa()
    _C.set_cpu_isa("auto")
    best = _C.cpu_isa()
    _C.set_cpu_isa(previous)
    order = ["scalar", "avx2", "avx512"]
    return order[: order.index(best) + 1]


CPU_ISAS = _supported_isas()


@pytest.fixture(params=CPU_ISAS)
def cpu_isa(request):
    """Runs a test once per CPU kernel set this machine supports."""
    previous = _C.cpu_isa()
    _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa(previous)


def node_names(*outputs: torch.Tensor) -> list[str]:
    """Every node of the autograd graph behind `outputs`, by name, once each."""
    seen, names, todo = set(), [], [o.grad_fn for o in outputs if o.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(fn.name())
        todo.extend(f for f, _ in fn.next_functions)
    return names


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(INT_OF[t.dtype])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal bit for bit (so NaN payloads and the sign of zero count).

    Two exceptions, both PyTorch's own:
    - its CPU float16 / bfloat16 kernels go through float32 in their
      vectorized body, which rewrites NaN payloads there (fp16: signalling NaNs
      are quieted; bf16: every NaN becomes 0xFFFF) but not in the scalar tail.
      So there a NaN only has to meet a NaN; relu_ext itself keeps every NaN's
      bits (tested separately), as PyTorch's CUDA kernel does;
    - on a GPU whose torch.relu turns -0.0 into +0.0 (torch 2.11), relu_ext's
      -0.0 may meet torch's +0.0 (see torch_cuda_relu_clears_negative_zero).
    """
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.device == expected.device, f"{what}: device {actual.device} != {expected.device}"
    a, e = bits(actual), bits(expected)
    if expected.dtype in (torch.float16, torch.bfloat16) and expected.device.type == "cpu":
        both_nan = actual.detach().isnan() & expected.detach().isnan()
        a, e = a.masked_fill(both_nan.contiguous(), 0), e.masked_fill(both_nan.contiguous(), 0)
    known = known_torch_cuda_zero_difference(a, e, expected)
    a, e = a.masked_fill(known, 0), e.masked_fill(known, 0)
    diff = (a != e).flatten().nonzero()
    if diff.numel():
        i = diff[0].item()
        raise AssertionError(
            f"{what}: {diff.numel()} of {a.numel()} elements differ; first at flat index {i}: "
            f"got {actual.detach().flatten()[i].item()!r} (bits {a.flatten()[i].item():#x}), "
            f"want {expected.detach().flatten()[i].item()!r} (bits {e.flatten()[i].item():#x})"
        )


@functools.cache
def torch_cuda_clears_negative_zero(fn, dtype: torch.dtype) -> bool:
    """Whether this torch's CUDA kernel of `fn` gives +0.0 for -0.0 where its
    CPU kernel gives -0.0 (relu and hardtanh / relu6 with min_val 0 in torch
    2.11, whose CUDA clamp took ::max(x, min)): the one known difference, see
    torch_cuda_relu_clears_negative_zero. relu_ext gives -0.0 on both."""
    cpu, cuda = (fn(torch.tensor([-0.0], dtype=dtype, device=d)) for d in ("cpu", "cuda"))
    return bool(torch.signbit(cpu).item()) and not torch.signbit(cuda).item()


@functools.cache
def torch_cuda_relu_clears_negative_zero(dtype: torch.dtype) -> bool:
    """Whether this torch's CUDA relu gives +0.0 for -0.0. torch 2.11's does
    (pytorch/pytorch#181533, #181801: its CUDA clamp_min took ::max(x, 0));
    its CPU kernel keeps -0.0, and so does the CUDA kernel in PyTorch's main
    branch since pytorch/pytorch#185354 (it returns x when x == 0). relu_ext
    follows the fixed behaviour, -0.0, on every device."""
    return torch_cuda_clears_negative_zero(torch.relu, dtype)


def known_torch_cuda_zero_difference(a: torch.Tensor, e: torch.Tensor, expected: torch.Tensor,
                                     fn: Any = torch.relu) -> torch.Tensor:
    """Where `a` (relu_ext's bits) is -0.0 and `e` (PyTorch's bits) is +0.0,
    only when `expected` was made on a GPU whose torch `fn` (relu by default)
    clears the sign of -0.0: the one known difference, in one direction
    (relu_ext giving -0.0 for a negative input still fails, and relu_ext's CUDA
    kernels are compared with its CPU kernels, strictly, in test_cuda.py)."""
    if not (expected.is_cuda and expected.is_floating_point() and torch_cuda_clears_negative_zero(fn, expected.dtype)):
        return torch.zeros_like(a, dtype=torch.bool)
    return minus_zero_meets_plus_zero(a, e)


def minus_zero_meets_plus_zero(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Where the integer bits `a` are -0.0 (the sign bit alone) and `e` are +0.0."""
    return (a == torch.iinfo(a.dtype).min) & (e == 0)


def adversarial(n: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """Random values of every kind: normals, raw random bit patterns (all NaN
    payloads, denormals, infinities of both signs), and explicit ±0, ±inf, NaN,
    ±denormal, ±max and ±tiny at random positions."""
    g = torch.Generator().manual_seed(seed)
    it = INT_OF[dtype]
    info = torch.finfo(dtype)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    width = torch.iinfo(it).bits
    raw = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1) - 1, (n,), generator=g, dtype=torch.int64).to(it).view(dtype)
    pick = torch.randint(0, 3, (n,), generator=g)
    x = torch.where(pick == 1, raw, x)
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), info.max, -info.max,
         info.tiny, -info.tiny, info.smallest_normal / 4, -info.smallest_normal / 4, 1.0, -1.0],
        dtype=dtype,
    )
    which = torch.randint(0, len(specials), (n,), generator=g)
    x = torch.where(pick == 2, specials[which], x)
    return x.to(device)


def layouts(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of the same kind of data in the layouts a model produces."""
    n = x.numel()
    out = {"contiguous": x}
    if n >= 2:
        out["offset"] = x[1:]  # storage offset: misaligned for vector loads
    if n >= 8:
        m = (n // 4) * 4
        out["transposed"] = x[:m].view(4, m // 4).t()
        out["strided"] = x[::2]
    if n >= 24:
        m = (n // 24) * 24
        out["channels_last"] = x[:m].view(2, 3, 2, m // 12).contiguous(memory_format=torch.channels_last)
        out["permuted_slice"] = x[:m].view(2, 3, 2, m // 12).permute(0, 2, 3, 1)[:, :, ::2]
    return out


@pytest.fixture
def ext():
    return relu_ext


def train_step(model: torch.nn.Module, x: Any, ctx: Any, **backward: Any) -> tuple[torch.Tensor, list]:
    """One seeded step under `ctx` (the forward only): the loss (the mean square of the output; for a dict
    of inputs, a transformers model's own) and every parameter's gradient (None where none)."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(1)
    with ctx:
        loss = model(**x).loss if isinstance(x, dict) else model(x).float().square().mean()
    loss.backward(**backward)
    return loss.detach(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def assert_same_step(a: tuple, b: tuple) -> None:
    """Two train_step results, bit for bit, each gradient in the same strides."""
    assert_bitwise_equal(a[0], b[0], "loss")
    assert len(a[1]) == len(b[1])
    for i, (ga, gb) in enumerate(zip(a[1], b[1])):
        assert (ga is None) == (gb is None), f"gradient {i}"
        if ga is not None:
            assert ga.stride() == gb.stride(), f"gradient {i}: strides {ga.stride()} != {gb.stride()}"
            assert_bitwise_equal(ga, gb, f"gradient {i}")
