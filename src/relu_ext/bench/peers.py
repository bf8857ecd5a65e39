"""The implementations timed against each other, and what each case runs.

torch (torch.relu / nn.ReLU), torch_out (torch.clamp with out=, forward only),
compile (torch.compile of F.relu), triton (a plain Triton ReLU, CUDA only),
seed (the tutorial autograd.Function: clamp, then grad[x < 0] = 0), relu_ext,
installed (PyTorch's own F.relu / nn.ReLU under relu_ext.install(); small
section only: its kernels are relu_ext's).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import relu_ext
from relu_ext.activations import ACTIVATIONS

ops = torch.ops.relu_ext
IMPLS = ["torch", "torch_out", "compile", "triton", "seed", "relu_ext", "installed"]
CASES = ["fwd", "fwd (train)", "bwd", "fwd+bwd", "in-place", "compact", "expand", "bn check", "bn rebuild"]
SMALL_CASES = ["fwd", "fwd+bwd", "module fwd", "module fwd+bwd"]

# {case: {impl: (fn, bytes it must move at least)}}
Cases = dict[str, dict[str, tuple[Callable[[], object], int]]]


class SeedReLU(torch.autograd.Function):
    """The tutorial ReLU: saves its input and masks the gradient by indexing."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return seed_grad(grad, x)


def seed_grad(grad: Tensor, x: Tensor) -> Tensor:
    """The tutorial's backward: a copy of the gradient, zeroed where x < 0."""
    grad = grad.clone()
    grad[x < 0] = 0
    return grad


class SeedReLUModule(nn.Module):
    """SeedReLU as a module, for the models."""

    def forward(self, x: Tensor) -> Tensor:
        return SeedReLU.apply(x)


MODULES: dict[str, type[nn.Module]] = {"torch": nn.ReLU, "relu_ext": relu_ext.ReLU, "seed": SeedReLUModule,
                                       "installed": nn.ReLU}


@functools.lru_cache(maxsize=None)
def compiled_relu() -> Callable[[Tensor], Tensor]:
    """torch.compile(F.relu), dynamic from the start: one compile per dtype and
    grad mode instead of one per size (each costs seconds on 2 cores)."""
    return torch.compile(F.relu, dynamic=True)


@functools.lru_cache(maxsize=None)
def triton_relu() -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor, Tensor], Tensor], type] | None:
    """(forward, backward(grad, y), autograd.Function) of a plain Triton ReLU,
    or None without triton. Contiguous tensors only. Runs on CPU tensors under
    TRITON_INTERPRET=1 (how the tests check it)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    block = 1024

    @triton.jit
    def fwd_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        x = tl.load(x_ptr + offs, mask=keep)
        # Compared in float32: Triton 3.9's interpreter compares bfloat16 as raw bits.
        tl.store(y_ptr + offs, tl.where(x.to(tl.float32) < 0, 0.0, x).to(x.dtype), mask=keep)

    @triton.jit
    def bwd_kernel(g_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        g = tl.load(g_ptr + offs, mask=keep)
        y = tl.load(y_ptr + offs, mask=keep)
        tl.store(out_ptr + offs, tl.where(y.to(tl.float32) <= 0, 0.0, g).to(g.dtype), mask=keep)

    def forward(x: Tensor) -> Tensor:
        assert x.is_contiguous()
        y = torch.empty_like(x)
        fwd_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), BLOCK=block)
        return y

    def backward(grad: Tensor, y: Tensor) -> Tensor:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        bwd_kernel[(triton.cdiv(grad.numel(), block),)](grad, y, out, grad.numel(), BLOCK=block)
        return out

    class TritonReLU(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            y = forward(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            return backward(grad, ctx.saved_tensors[0])

    return forward, backward, TritonReLU


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: how tables, JSON and labels name a dtype."""
    return str(dtype).removeprefix("torch.")


def available_impls(device: str) -> list[str]:
    """The implementations that run on `device` here (triton: CUDA with triton)."""
    out = list(IMPLS)
    if device != "cuda" or triton_relu() is None:
        out.remove("triton")
    return out


def activation(impl: str) -> Callable[[Tensor], Tensor]:
    """The differentiable activation of each implementation."""
    if impl == "torch":
        return torch.relu
    if impl == "compile":
        return compiled_relu()
    if impl == "triton":
        return triton_relu()[2].apply
    if impl == "seed":
        return SeedReLU.apply
    if impl == "relu_ext":
        return relu_ext.relu
    if impl == "installed":
        return F.relu  # timed under install() (see installed())
    raise ValueError(f"{impl} has no autograd path")


def installed(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` to be run with relu_ext installed: the timer enters ``fn.context()``
    around each of its blocks (install() is process-wide, so the others' blocks
    must run without it)."""

    def run() -> object:
        return fn()

    run.context = relu_ext.install  # type: ignore[attr-defined]
    return run


def _no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return fn()

    return run


def fwd_bwd_bytes(impl: str, n: int, e: int) -> int:
    """Forward reads x, writes y; backward reads what was saved and the
    gradient, writes grad_in. relu_ext saves 1 bit per element."""
    return 4 * n * e + 2 * ((n + 7) // 8) if impl in ("relu_ext", "installed") else 5 * n * e


def kernel_cases(x: Tensor, impls: list[str]) -> Cases:
    """The kernel section's cases for one input."""
    n, e = x.numel(), x.element_size()
    mask_bytes = (n + 7) // 8
    g = torch.randn_like(x)
    y_ref = torch.relu(x)
    _, mask = ops.relu_fwd(x)
    xg = x.detach().clone().requires_grad_()
    buf = x.clone()
    out = torch.empty_like(x)
    cases: Cases = {c: {} for c in CASES}
    for impl in impls:
        if impl == "installed":
            continue  # the same kernels as relu_ext's; what install() changes is the per-call cost
        if impl == "torch_out":
            cases["fwd"][impl] = (_no_grad(lambda: torch.clamp(x, min=0, out=out)), 2 * n * e)
            continue
        act = activation(impl)
        cases["fwd"][impl] = (_no_grad(functools.partial(act, x)), 2 * n * e)
        cases["fwd+bwd"][impl] = (lambda act=act: torch.autograd.grad(act(xg), xg, g), fwd_bwd_bytes(impl, n, e))
        if impl == "torch":
            cases["fwd (train)"][impl] = (functools.partial(torch.relu, xg), 2 * n * e)
            cases["bwd"][impl] = (lambda: torch.ops.aten.threshold_backward(g, y_ref, 0), 3 * n * e)
            cases["in-place"][impl] = (_no_grad(lambda: torch.relu_(buf)), 2 * n * e)
        elif impl == "seed":
            cases["fwd (train)"][impl] = (functools.partial(SeedReLU.apply, xg), 2 * n * e)
            cases["bwd"][impl] = (lambda: seed_grad(g, x), 3 * n * e)
        elif impl == "triton":
            cases["bwd"][impl] = (lambda: triton_relu()[1](g, y_ref), 3 * n * e)
        elif impl == "relu_ext":
            cases["fwd (train)"][impl] = (lambda: ops.relu_fwd(x), 2 * n * e + mask_bytes)
            cases["bwd"][impl] = (lambda: ops.relu_bwd(g, mask), 2 * n * e + mask_bytes)
            cases["in-place"][impl] = (_no_grad(lambda: relu_ext.relu(buf, inplace=True)), 2 * n * e)
            # save_compact's ops on a ReLU output with its mask: read it all, write what is kept, and back.
            values, _ = ops.compact(y_ref, mask)
            kept = values.numel() * e
            cases["compact"][impl] = (lambda: ops.compact(y_ref, mask), n * e + mask_bytes + kept)
            cases["expand"][impl] = (lambda: ops.expand(values, mask, y_ref.shape, y_ref.stride()),
                                     kept + mask_bytes + n * e)
            if x.device.type == "cpu":
                # save_compact's recipe of a BatchNorm -> ReLU output (one channel, so one run of n elements):
                # checked (reads the BatchNorm's input and the output), rebuilt (reads the one, writes the other).
                xb = x.view(1, 1, n)
                opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
                alpha, beta = torch.full((1,), 1.5, dtype=opmath), torch.full((1,), -0.25, dtype=opmath)
                yb = ops.bn_act_rebuild(xb, alpha, beta, "relu", [])
                cases["bn check"][impl] = (lambda: ops.bn_act_verify(xb, alpha, beta, "relu", [], yb), 2 * n * e)
                cases["bn rebuild"][impl] = (lambda: ops.bn_act_rebuild(xb, alpha, beta, "relu", []), 2 * n * e)
    return {c: v for c, v in cases.items() if v}


def small_cases(x: Tensor, impls: list[str]) -> Cases:
    """The per-call (small tensor) cases: function and module, no-grad forward
    and forward+backward."""
    n, e = x.numel(), x.element_size()
    g = torch.randn_like(x)
    xg = x.detach().clone().requires_grad_()
    cases: Cases = {c: {} for c in SMALL_CASES}
    for impl in impls:
        if impl == "torch_out":
            continue
        act = activation(impl)
        wrap = installed if impl == "installed" else (lambda fn: fn)
        # x needs no grad: the plain call is the no-grad forward (no no_grad() context to time).
        # Lambdas, not partials, so that every implementation is called from Python code, as users do.
        cases["fwd"][impl] = (wrap(lambda act=act: act(x)), 2 * n * e)
        cases["fwd+bwd"][impl] = (wrap(lambda act=act: torch.autograd.grad(act(xg), xg, g)), fwd_bwd_bytes(impl, n, e))
        if impl in MODULES:
            module = MODULES[impl]()
            cases["module fwd"][impl] = (wrap(lambda m=module: m(x)), 2 * n * e)
            cases["module fwd+bwd"][impl] = (wrap(lambda m=module: torch.autograd.grad(m(xg), xg, g)),
                                             fwd_bwd_bytes(impl, n, e))
    return {c: v for c, v in cases.items() if v}


# The arguments the family's kernel rows measure, where an op's defaults are not the typical use
# (labelled as that use); any other activation of the table is measured with its schema's defaults.
_TYPICAL = {"hardtanh": ("relu6", (0.0, 6.0)), "leaky_relu": ("leaky_relu", (0.1,)), "threshold": ("threshold", (0.1, 0.0))}


def _family_row(name: str) -> tuple[str, str, tuple[float, ...], Callable[..., Tensor], Callable[..., Tensor]]:
    """(label, op name, Scalar arguments, PyTorch's forward, PyTorch's backward) of one activation:
    ``F.<name>`` and ``aten.<name>_backward``, which reads the saved input, with those arguments."""
    params = [a for a in getattr(torch.ops.aten, name).default._schema.arguments[1:]]
    label, args = _TYPICAL.get(name, (name, tuple(float(a.default_value) if a.has_default_value() else 0.0
                                                  for a in params)))
    named = {a.name: v for a, v in zip(params, args)}
    backward = getattr(torch.ops.aten, f"{name}_backward").default
    # Its other arguments: the saved tensor is the input (leaky_relu_backward's self_is_result).
    extra = [named.get(a.name, False) for a in backward._schema.arguments[2:]]
    return (label, name, args, lambda x: getattr(F, name)(x, *args), lambda g, x: backward(g, x, *extra))


# The family's kernel rows: every activation of the table but relu (which has its own section).
FAMILY = [_family_row(act.name) for act in ACTIVATIONS if act.name != "relu"]
FAMILY_CASES = [f"{label} {case}" for label, *_ in FAMILY for case in ("fwd", "fwd (train)", "bwd", "in-place")]


def family_cases(x: Tensor, impls: list[str]) -> Cases:
    """The family section's cases for one input: PyTorch's op (backward: its
    *_backward, which reads the saved input) against relu_ext's (backward from
    the 1-bit mask)."""
    n, e = x.numel(), x.element_size()
    mask_bytes = (n + 7) // 8
    g = torch.randn_like(x)
    xg = x.detach().clone().requires_grad_()
    buf = x.clone()
    cases: Cases = {c: {} for c in FAMILY_CASES}
    for label, name, args, fwd, bwd in FAMILY:
        ours, ours_ = getattr(ops, name), getattr(ops, f"{name}_")
        ours_fwd, ours_bwd = getattr(ops, f"{name}_fwd"), getattr(ops, f"{name}_bwd")
        _, mask = ours_fwd(x, *args)
        if "torch" in impls:
            cases[f"{label} fwd"]["torch"] = (_no_grad(functools.partial(fwd, x)), 2 * n * e)
            cases[f"{label} fwd (train)"]["torch"] = (functools.partial(fwd, xg), 2 * n * e)
            cases[f"{label} bwd"]["torch"] = (functools.partial(bwd, g, x), 3 * n * e)
            torch_ = getattr(torch.ops.aten, f"{name}_")
            cases[f"{label} in-place"]["torch"] = (_no_grad(lambda t=torch_, a=args: t(buf, *a)), 2 * n * e)
        if "relu_ext" in impls:
            cases[f"{label} fwd"]["relu_ext"] = (_no_grad(lambda o=ours, a=args: o(x, *a)), 2 * n * e)
            cases[f"{label} fwd (train)"]["relu_ext"] = (lambda o=ours_fwd, a=args: o(x, *a), 2 * n * e + mask_bytes)
            cases[f"{label} bwd"]["relu_ext"] = (lambda o=ours_bwd, m=mask, a=args: o(g, m, *a), 2 * n * e + mask_bytes)
            cases[f"{label} in-place"]["relu_ext"] = (_no_grad(lambda o=ours_, a=args: o(buf, *a)), 2 * n * e)
    return {c: v for c, v in cases.items() if v}
