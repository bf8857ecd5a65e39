"""The activation table (tests/cases.py: relu and the family: hardtanh / relu6, leaky_relu, threshold,
hardsigmoid) against PyTorch, bit for bit, and the batteries every op passes, run as one table over the
ops (test_exact.py and the other files test relu in more depth)."""

from __future__ import annotations

import contextlib
import io
import re
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap

import relu_ext
from cases import (BY_ID, CASE_IDS, CASES, FUNC_CASES, ONE_PER_OP, REPRESENTATIVE_IDS, REPRESENTATIVES, assert_family_equal,
                   grad_at_nan, run_case, with_edges)
from conftest import DEVICES, DTYPES, adversarial, bits, layouts, node_names

pytestmark = pytest.mark.native  # the risk it checks: see tests/tiers.py

ops = torch.ops.relu_ext

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 63, 65, 4097, 100_003])
@pytest.mark.parametrize("case", CASE_IDS)
def test_bitwise_against_pytorch(case, n, dtype, device, cpu_isa):
    c = BY_ID[case]
    x = with_edges(adversarial(n, dtype, device, seed=n), c[4])
    for name, v in layouts(x).items():
        assert_family_equal(run_case(c, "relu_ext", v), run_case(c, "torch", v), f"forward {name}", case=c)
        g = adversarial(v.numel(), dtype, device, seed=n + 1).view(v.shape)
        a, b = v.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
        run_case(c, "relu_ext", a).backward(g)
        run_case(c, "torch", b).backward(g)
        assert_family_equal(a.grad, b.grad, f"gradient {name}", v, grad_at_nan(c, g))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [c for c in CASE_IDS if c != "leaky_negative"])
def test_inplace_bitwise_against_pytorch(case, dtype, device, cpu_isa):
    c = BY_ID[case]
    base = with_edges(adversarial(4097, dtype, device, seed=3), c[4])
    for name in layouts(base):
        la, lb = base.clone().requires_grad_(), base.clone().requires_grad_()
        va, vb = layouts(la * 1)[name], layouts(lb * 1)[name]
        ya, yb = run_case(c, "relu_ext", va, inplace=True), run_case(c, "torch", vb, inplace=True)
        assert ya is va
        assert_family_equal(ya, yb, f"in-place forward {name}", case=c)
        g = adversarial(ya.numel(), dtype, device, seed=5).view(ya.shape)
        ya.backward(g)
        yb.backward(g)
        src = layouts(base)[name]
        assert_family_equal(layouts(la.grad)[name], layouts(lb.grad)[name], f"in-place gradient {name}", src,
                             grad_at_nan(c, g))
        vc = layouts(base.clone())[name]
        vd = layouts(base.clone())[name]
        with torch.no_grad():
            run_case(c, "relu_ext", vc, inplace=True)
            run_case(c, "torch", vd, inplace=True)
        assert_family_equal(vc, vd, f"in-place no-grad {name}", case=c)


@pytest.mark.parametrize("device", DEVICES)
def test_every_op_of_the_table(device):
    """The two tests above for one row per op of the table, at a few sizes and one dtype each: the
    test bench/gpu_check.sh's sanitizer runs for every op, so that an op added to the tables runs
    under compute-sanitizer without a line of its own."""
    for c in ONE_PER_OP:
        for n, dtype in ((65, torch.float16), (4097, torch.float32), (1023, torch.float64), (100_003, torch.bfloat16)):
            test_bitwise_against_pytorch(c.id, n, dtype, device, None)
        test_inplace_bitwise_against_pytorch(c.id, torch.float32, device, None)


OPINFO = {f"nn.functional.{c.name}": getattr(relu_ext, c.name) for c in REPRESENTATIVES}


@pytest.mark.parametrize("name", list(OPINFO))
def test_pytorch_opinfo_samples_bitwise(name):
    """PyTorch's own OpInfo samples (its test suite's inputs and arguments) for
    each op, on every dtype it supports on CPU: same outputs and gradients."""
    pytest.importorskip("expecttest")  # torch.testing._internal needs it
    from torch.testing._internal.common_methods_invocations import op_db

    (info,) = [o for o in op_db if o.name == name and o.variant_test_name == ""]
    for dtype in sorted(info.supported_dtypes("cpu"), key=str):
        grad = dtype.is_floating_point
        for sample in info.sample_inputs("cpu", dtype, requires_grad=grad):
            x, args, kwargs = sample.input, sample.args, sample.kwargs
            ours, theirs = OPINFO[name](x, *args, **kwargs), info.op(x, *args, **kwargs)
            what = f"{name} {dtype} {tuple(x.shape)} {args} {kwargs}"
            if not grad:
                assert torch.equal(ours, theirs), what
                continue
            assert_family_equal(ours, theirs, what)
            g = torch.randn(x.shape, dtype=torch.float64).to(dtype)
            (ga,), (gb,) = torch.autograd.grad(ours, x, g), torch.autograd.grad(theirs, x, g)
            assert_family_equal(ga, gb, f"gradient {what}")


def _every_value(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 values of a 16-bit float dtype, NaNs and infinities included."""
    return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_hardsigmoid_on_every_value_near_its_corners(dtype, cpu_isa):
    """Every float16 / bfloat16 value, and every float32 in [-3, -2] and [2, 3]
    (where x + 3 and the division round most), against PyTorch's
    hardsigmoid, forward and backward."""
    if dtype == torch.float32:
        lo, hi = (torch.tensor(v).view(torch.int32).item() for v in (2.0, 3.0))
        pos = torch.arange(lo, hi + 1, dtype=torch.int32).view(torch.float32)
        x = torch.cat([pos, -pos])
    else:
        x = _every_value(dtype)
    x = x.clone().requires_grad_()
    g = torch.randn(x.shape, dtype=torch.float64).to(dtype)
    ours, theirs = relu_ext.hardsigmoid(x), F.hardsigmoid(x)
    assert_family_equal(ours, theirs, f"hardsigmoid {dtype}")
    (ga,), (gb,) = torch.autograd.grad(ours, x, g), torch.autograd.grad(theirs, x, g)
    assert_family_equal(ga, gb, f"hardsigmoid gradient {dtype}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_hardtanh_bounds_that_round_twice(dtype, cpu_isa):
    """Every 16-bit value through hardtanh with bounds a float32 rounding puts
    on a 16-bit midpoint (the float16 kernels clamp in float and round the
    bound after; PyTorch rounds it through float too)."""
    tie = 2.0 ** -11 if dtype == torch.float16 else 2.0 ** -8
    x = _every_value(dtype).clone().requires_grad_()
    g = torch.randn(x.shape, dtype=torch.float64).to(dtype)
    for lo, hi in [(-(1 + tie + 2.0 ** -30), 1 + tie + 2.0 ** -30), (-(3 + 2 * tie), 1 + tie - 2.0 ** -30)]:
        ours, theirs = relu_ext.hardtanh(x, lo, hi), F.hardtanh(x, lo, hi)
        assert_family_equal(ours, theirs, f"hardtanh({lo}, {hi}) {dtype}")
        (ga,), (gb,) = torch.autograd.grad(ours, x, g), torch.autograd.grad(theirs, x, g)
        assert_family_equal(ga, gb, f"hardtanh({lo}, {hi}) gradient {dtype}", x, g)


@pytest.mark.parametrize("kind", ["int", "numpy", "tensor"])
@pytest.mark.parametrize("mode", [False, True], ids=["eager", "function_mode"])
def test_scalar_arguments_as_pytorch_takes_them(kind, mode):
    """Python ints and bools, numpy scalars and 0-dim tensors as the Scalar
    arguments, as torch.nn.functional takes them, on the C++ eager path and
    on the torch.ops one (under a __torch_function__ mode)."""
    from torch.overrides import TorchFunctionMode

    np = pytest.importorskip("numpy")
    wrap = {"int": int, "numpy": np.float32, "tensor": torch.tensor}[kind]

    class Through(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = adversarial(4097, torch.float32)
    calls = [(relu_ext.hardtanh, F.hardtanh, (wrap(-1), wrap(2))), (relu_ext.leaky_relu, F.leaky_relu, (wrap(2),)),
             (relu_ext.threshold, F.threshold, (wrap(1), wrap(-3))), (relu_ext.leaky_relu, F.leaky_relu, (True,))]
    for ours, theirs, args in calls:
        with Through() if mode else contextlib.nullcontext():
            got = ours(x, *args)
        assert_family_equal(got, theirs(x, *args), f"{ours.__name__}{args}")


def test_leaky_inplace_negative_slope_raises_at_backward_as_pytorch():
    x = torch.randn(8, requires_grad=True)
    for fn in (F.leaky_relu, relu_ext.leaky_relu):
        y = fn(x * 1, -0.1, inplace=True)  # the forward works
        with pytest.raises(RuntimeError, match="In-place leakyReLu backward calculation is triggered with a negative slope"):
            y.sum().backward()
    with fwAD.dual_level():
        for fn in (F.leaky_relu, relu_ext.leaky_relu):
            with pytest.raises(RuntimeError, match="negative slope"):
                fn(fwAD.make_dual(torch.randn(4), torch.ones(4)) * 1, -0.1, inplace=True)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8], ids=str)
@pytest.mark.parametrize("case", CASE_IDS)
def test_integer_dtypes_like_pytorch(case, dtype):
    """Where PyTorch takes integers (hardtanh, threshold) the same values; where it
    refuses them (leaky_relu, hardsigmoid) the same error."""
    c = BY_ID[case]
    info = torch.iinfo(dtype)
    x = torch.randint(info.min, info.max, (333,), dtype=torch.int64, generator=torch.Generator().manual_seed(0)).to(dtype)

    def outcome(impl: str, inplace: bool) -> Any:
        v = x.clone()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return ("value", run_case(c, impl, v, inplace).tolist(), v.tolist())
        except Exception as e:  # noqa: BLE001  (PyTorch's own error is the expected answer)
            return ("error", type(e), str(e).splitlines()[0])

    for inplace in (False, True):
        assert outcome("relu_ext", inplace) == outcome("torch", inplace)


def test_hardtanh_min_above_max_raises_like_pytorch():
    for fn in (F.hardtanh, relu_ext.hardtanh):
        with pytest.raises(ValueError, match="min_val cannot be greater than max_val"):
            fn(torch.randn(3), 2.0, 1.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bounds", [(float("nan"), 1.0), (-1.0, float("nan")), (float("nan"), float("nan"))], ids=str)
def test_hardtanh_with_a_nan_bound_is_all_nan_as_pytorch(bounds, dtype, device, _pytorch_kernels_around):
    """PyTorch's hardtanh is clamp, which writes NaN everywhere where a bound is NaN (the dtype's
    quiet NaN, whatever the input); so does relu_ext's, functional and in place, through install()
    too. The gradient is PyTorch's scalar loop's, !(x <= min || x >= max) (its vectorized loop gives
    0 there: docs/design.md)."""
    x = adversarial(100_003, dtype, device, seed=3)
    want = F.hardtanh(x, *bounds)
    assert want.isnan().all()
    inplace = x.clone()
    relu_ext.hardtanh(inplace, *bounds, inplace=True)
    with relu_ext.install("hardtanh"):
        installed = F.hardtanh(x, *bounds)
    for got, how in ((relu_ext.hardtanh(x, *bounds), "functional"), (inplace, "in place"), (installed, "installed")):
        assert torch.equal(bits(got), bits(want)), f"{how}: not PyTorch's NaN in every element"
    g = adversarial(x.numel(), dtype, device, seed=4)
    xr = x.clone().requires_grad_()
    relu_ext.hardtanh(xr, *bounds).backward(g)
    lo, hi = bounds
    passes = ~((x.double() <= lo) | (x.double() >= hi))
    assert torch.equal(bits(xr.grad), bits(torch.where(passes, g, torch.zeros_like(g))))
    if dtype == torch.float16:  # (PyTorch converts neither bound to the dtype then: 7e4 does not overflow)
        big = (lo, 7e4) if lo != lo else (-7e4, hi)
        assert torch.equal(bits(relu_ext.hardtanh(x, *big)), bits(F.hardtanh(x, *big)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_hardtanh_bounds_that_round_to_zero_keep_the_sign_of_zero(dtype):
    """PyTorch's clamp compares with the bounds rounded to the dtype (its backward, in float): a bound
    that rounds to +0.0 keeps a -0.0 input, std::max(-0.0, +0.0) being -0.0, and one that rounds to
    -0.0 keeps +0.0. (Six elements, PyTorch's scalar loop; its vectorized loop gives the same here.)"""
    x = torch.tensor([-0.0, 0.0, -1.0, 1.0, 0.5, -0.5], dtype=dtype)
    for lo, hi, want in [(1e-45, 1.0, [-0.0, 0.0, 0.0, 1.0, 0.5, 0.0]), (-1.0, -1e-45, [-0.0, 0.0, -1.0, -0.0, -0.0, -0.5])]:
        got = relu_ext.hardtanh(x, lo, hi)
        assert torch.equal(bits(got), bits(torch.tensor(want, dtype=dtype))), (lo, hi, got)
        assert torch.equal(bits(got), bits(F.hardtanh(x, lo, hi)))
        xr = x.clone().requires_grad_()
        relu_ext.hardtanh(xr, lo, hi).backward(torch.ones_like(x))
        assert xr.grad.tolist() == [float(lo < v < hi) for v in x.tolist()]


def test_half_overflow_of_the_value_raises_like_pytorch():
    x = torch.randn(10, dtype=torch.float16)
    with pytest.raises(RuntimeError) as theirs:
        F.threshold(x, 0.0, 1e10)
    with pytest.raises(RuntimeError) as ours:
        relu_ext.threshold(x, 0.0, 1e10)
    assert "cannot be converted to type" in str(theirs.value) and "cannot be converted to type" in str(ours.value)


@pytest.mark.parametrize("case", CASE_IDS)
def test_only_the_mask_is_saved(case):
    c = BY_ID[case]
    saved: list[torch.Tensor] = []
    x = torch.randn(1000, 37, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = run_case(c, "relu_ext", x * 1)
    ours = [t for t in saved if t.numel() * t.element_size() >= 1000]
    assert len(ours) == 1 and ours[0].dtype == torch.uint8 and ours[0].numel() == (x.numel() + 7) // 8, saved
    assert y.grad_fn.name() == c.node
    assert torch.equal(y.grad_fn._saved_mask, saved[-1] if saved[-1].dtype == torch.uint8 else ours[0])


def test_modules_are_drop_in_subclasses():
    """Every row's module, and with inplace=True, as its torch.nn class (and two more spellings)."""
    rows = [(torch.nn.Hardtanh, relu_ext.Hardtanh, (-2.0, 2.0), {}), (torch.nn.LeakyReLU, relu_ext.LeakyReLU, (0.2, True), {})]
    rows += [(c.module, c.ours_module, c.module_args, kw) for c in CASES for kw in ({}, {"inplace": True})]
    for theirs, ours, args, kw in rows:
        try:
            a = theirs(*args, **kw)
        except Exception as e:  # (Hardtanh(0.5, 0.5): torch.nn refuses min_val == max_val, so must relu_ext)
            with pytest.raises(type(e), match=f"^{re.escape(str(e))}$"):
                ours(*args, **kw)
            continue
        b = ours(*args, **kw)
        assert isinstance(b, theirs) and repr(a) == repr(b) and a.state_dict() == b.state_dict()
        x = torch.randn(50)
        assert_family_equal(b(x.clone()), a(x.clone()), f"{theirs.__name__}{args}")


def test_convert_and_revert_swap_every_family_module():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.ReLU6(inplace=True),
                                torch.nn.LeakyReLU(0.1), torch.nn.Hardtanh(-2.0, 2.0), torch.nn.Threshold(0.1, 0.0),
                                torch.nn.Hardsigmoid(), torch.nn.ReLU(), torch.nn.GELU()).eval()
    assert {type(m) for m in model} >= {c.module for c in CASES}, "a module of the table (tests/cases.py) is missing"
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 5, 5)
    ref = model(x)
    relu_ext.convert(model)
    kinds = [type(m) for m in model]
    assert kinds[2:8] == [relu_ext.ReLU6, relu_ext.LeakyReLU, relu_ext.Hardtanh, relu_ext.Threshold,
                          relu_ext.Hardsigmoid, relu_ext.ReLU] and kinds[8] is torch.nn.GELU
    assert model[2].inplace and model[3].negative_slope == 0.1 and model[4].min_val == -2.0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert torch.equal(model(x), ref)
    relu_ext.revert(model)
    assert [type(m) for m in model][2:8] == [torch.nn.ReLU6, torch.nn.LeakyReLU, torch.nn.Hardtanh, torch.nn.Threshold,
                                             torch.nn.Hardsigmoid, torch.nn.ReLU]


# --- the batteries, one table over the ops -------------------------------------------------


def _kinkless(shape: tuple[int, ...], args: tuple, seed: int = 0) -> torch.Tensor:
    """float64 away from every kink of the ops (finite differences need that)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 4
    kinks = torch.tensor([a for a in args if a == a] + [0.0, 3.0, -3.0], dtype=torch.float64)
    near = (x.unsqueeze(-1) - kinks).abs().min(-1).values < 0.05
    return torch.where(near, x + 0.2, x)


def _fn(case: str, impl: str, inplace: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    c = BY_ID[case]
    if inplace:
        return lambda t: run_case(c, impl, t * 1, inplace=True)
    return lambda t: run_case(c, impl, t)


@pytest.mark.parametrize("case", FUNC_CASES)
def test_gradcheck_and_gradgradcheck(case):
    x = _kinkless((5, 7), BY_ID[case][4]).requires_grad_()
    for inplace in (False, True):
        if inplace and case == "leaky_negative":
            continue
        assert torch.autograd.gradcheck(_fn(case, "relu_ext", inplace), (x,))
        assert torch.autograd.gradgradcheck(_fn(case, "relu_ext", inplace), (x,))


TRANSFORMS: dict[str, Callable[[Callable, torch.Tensor], Any]] = {
    "grad": lambda f, x: grad(lambda t: (f(t) * t.sin()).sum())(x),
    "vjp": lambda f, x: vjp(f, x)[1](x.cos()),
    "jacrev": lambda f, x: jacrev(f)(x[0]),
    "jacfwd": lambda f, x: jacfwd(f)(x[0]),
    "jvp": lambda f, x: jvp(f, (x,), (x.cos(),)),
    "vmap": lambda f, x: vmap(f)(x),
    "vmap_of_grad": lambda f, x: vmap(grad(lambda t: (f(t) * t.sin()).sum()))(x),
    "grad_of_grad": lambda f, x: grad(lambda t: grad(lambda u: (f(u) * u.sin()).sum())(t).sum())(x),
}


def _same(a: Any, b: Any, what: str) -> None:
    if isinstance(b, torch.Tensor):
        assert torch.equal(bits(a), bits(b)), what
    else:
        for i, (p, q) in enumerate(zip(a, b)):
            _same(p, q, f"{what}[{i}]")


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("case", FUNC_CASES)
def test_torch_func_matches_pytorch(case, transform):
    x = _kinkless((4, 6), BY_ID[case][4])
    for inplace in (False, True):
        if inplace and case == "leaky_negative":
            continue  # PyTorch refuses its backward (test_leaky_inplace_negative_slope_raises_...)
        try:
            want = TRANSFORMS[transform](_fn(case, "torch", inplace), x)
        except RuntimeError as e:
            # PyTorch has no double backward for hardsigmoid; relu_ext's backward is linear in grad, so it has one.
            assert "derivative for aten::hardsigmoid_backward is not implemented" in str(e)
            continue
        got = TRANSFORMS[transform](_fn(case, "relu_ext", inplace), x)
        if transform == "grad_of_grad" and case == "leaky_zero_slope":
            # Nested torch.func levels: the outer level records relu_ext's backward op alone, without
            # the zero derivative in the input that PyTorch's formula adds (zeros_like(grad)), so a
            # -0.0 (g * 0) stays where PyTorch's sum gives +0.0. Plain autograd has that term
            # (test_layouts.py); values agree.
            got, want = got + 0.0, want + 0.0
        _same(got, want, transform)


@pytest.mark.parametrize("case", FUNC_CASES)
def test_forward_ad_matches_pytorch(case):
    x = _kinkless((4, 6), BY_ID[case][4])
    t = x.cos()
    out = {}
    for impl in ("relu_ext", "torch"):
        with fwAD.dual_level():
            out[impl] = fwAD.unpack_dual(_fn(case, impl)(fwAD.make_dual(x, t))).tangent
    _same(out["relu_ext"], out["torch"], "tangent")


@pytest.mark.parametrize("case", FUNC_CASES)
def test_opcheck(case):
    c = BY_ID[case]
    name, args = c[3], c[4]
    x = torch.randn(4, 3, 5, 7).contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(getattr(ops, name).default, (x, *args))
    torch.library.opcheck(getattr(ops, f"{name}_").default, (x.clone(), *args))
    torch.library.opcheck(getattr(ops, f"{name}_fwd").default, (x.clone().requires_grad_(), *args))
    torch.library.opcheck(getattr(ops, f"{name}_fwd_").default, (x.clone(), *args))
    y, mask = getattr(ops, f"{name}_fwd")(x, *args)
    g = torch.empty_like(y).copy_(torch.randn(x.shape))
    torch.library.opcheck(getattr(ops, f"{name}_bwd").default, (g.requires_grad_(), mask, *args))


def _net(case: str, impl: str) -> torch.nn.Module:
    c = BY_ID[case]
    torch.manual_seed(0)
    act = (lambda: relu_ext.convert(c[5](*c[6]))) if impl == "relu_ext" else (lambda: c[5](*c[6]))
    return torch.nn.Sequential(torch.nn.Linear(8, 16), act(), torch.nn.Linear(16, 8), act(), torch.nn.Linear(8, 2))


def _step(model: Any, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = list(getattr(model, "_orig_mod", model).parameters())
    for p in params:
        p.grad = None
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in params]


def _same_step(a: tuple, b: tuple) -> None:
    _same(a[0], b[0], "output")
    _same(a[1], b[1], "gradients")


NET_CASES = REPRESENTATIVE_IDS  # one row per public function


@pytest.mark.parametrize("case", NET_CASES)
def test_compile_matches_eager(case):
    x = torch.randn(5, 8)
    ref = _step(_net(case, "torch"), x)
    torch._dynamo.reset()
    _same_step(_step(torch.compile(_net(case, "relu_ext"), backend="aot_eager", fullgraph=True), x), ref)


@pytest.mark.filterwarnings("ignore:`torch.jit.*` is deprecated")
@pytest.mark.parametrize("case", NET_CASES)
def test_torchscript_script_trace_and_save(case):
    x = torch.randn(5, 8)
    ref = _step(_net(case, "torch"), x)
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(_net(case, "relu_ext")), buf)
    buf.seek(0)
    loaded = torch.jit.load(buf)
    assert f"relu_ext::{BY_ID[case][3]}" in str(loaded.inlined_graph)
    _same_step(_step(loaded, x), ref)
    _same_step(_step(torch.jit.trace(_net(case, "relu_ext"), (x,)), x), ref)


@pytest.mark.parametrize("case", NET_CASES)
def test_export_and_lowering(case):
    x = torch.randn(5, 8)
    ep = torch.export.export(_net(case, "relu_ext"), (x,))
    assert any(str(n.target).startswith("relu_ext.") for n in ep.graph.nodes)
    _same_step(_step(ep.module(), x), _step(_net(case, "torch"), x))
    lowered = ep.run_decompositions(relu_ext.aten_decompositions())
    assert not any("relu_ext" in str(n.target) for n in lowered.graph.nodes), lowered.graph
    assert torch.equal(lowered.module()(x), _net(case, "torch")(x))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript_exporter", "dynamo_exporter"])
@pytest.mark.parametrize("case", NET_CASES)
def test_onnx_writes_standard_ops(case, dynamo, tmp_path):
    """relu_ext's modules export as PyTorch's do: the same ONNX ops, or the same refusal."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    x = torch.randn(5, 8)

    def export(impl: str) -> Any:
        path = str(tmp_path / f"{impl}.onnx")
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if dynamo:
                    torch.onnx.export(_net(case, impl).eval(), (x,), dynamo=True, verbose=False).save(path)
                else:
                    torch.onnx.export(_net(case, impl).eval(), (x,), path, dynamo=False)
        except Exception as e:  # noqa: BLE001  (PyTorch's own refusal is the expected answer)
            return type(e), str(e).splitlines()[0]
        return path

    ours, theirs = export("relu_ext"), export("torch")
    if not isinstance(theirs, str):
        assert ours == theirs
        return
    kinds = [n.op_type for n in onnx.load(ours).graph.node]
    assert kinds == [n.op_type for n in onnx.load(theirs).graph.node], kinds
    session = ort.InferenceSession(ours, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(out), _net(case, "torch")(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("case", NET_CASES)
def test_checkpointing(case, use_reentrant):
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(5, 8, requires_grad=True)
    res = {}
    for impl in ("relu_ext", "torch"):
        model = _net(case, impl)
        out = checkpoint(model, x, use_reentrant=use_reentrant)
        out.square().sum().backward()
        res[impl] = (out.detach(), [p.grad for p in model.parameters()])
    _same_step(res["relu_ext"], res["torch"])


# --- install(): every way of calling the family reaches relu_ext ----------------------------


@torch.jit.script
def _scripted_relu6(t: torch.Tensor) -> torch.Tensor:
    return F.relu6(t)


def _table_entry_points() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]]:
    """Each public function of the family (its representative row): torch.nn.functional's and the
    in-place torch.nn module (relu's: test_install.py)."""
    entries = {}
    for c in REPRESENTATIVES:
        if c.op != "relu":
            kind = c.node.removesuffix("ExtBackward0")
            entries[f"F.{c.name}"] = (lambda t, f=getattr(F, c.name), a=c.module_args: f(t, *a), kind)
            entries[f"nn.{c.module.__name__}-inplace"] = (c.module(*c.module_args, inplace=True), kind)
    return entries


# Those, and other spellings of the same ops.
ENTRY_POINTS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    **_table_entry_points(),
    "F.relu6-inplace": (lambda t: F.relu6(t, inplace=True), "Hardtanh"),
    "nn.ReLU6": (torch.nn.ReLU6(), "Hardtanh"),
    "F.hardtanh-odd": (lambda t: F.hardtanh(t, -0.5, 2.0), "Hardtanh"),
    "torchscript-relu6": (_scripted_relu6, "Hardtanh"),
    "F.leaky_relu-0.1": (lambda t: F.leaky_relu(t, 0.1), "LeakyRelu"),
    "F.threshold-odd": (lambda t: F.threshold(t, 0.1, 20.0), "Threshold"),
    "torch.threshold_": (lambda t: torch.threshold_(t, 0.0, 0.0), "Threshold"),
}


@pytest.fixture
def _pytorch_kernels_around():
    relu_ext.uninstall()
    yield
    relu_ext.uninstall()


def test_entry_points_cover_every_op_of_the_table():
    assert {kind for _, kind in ENTRY_POINTS.values()} == {c.node.removesuffix("ExtBackward0") for c in CASES
                                                           if c.op != "relu"}  # (relu's: test_install.py)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_install_reaches_every_entry_point(name, dtype, _pytorch_kernels_around):
    fn, kind = ENTRY_POINTS[name]
    x = adversarial(4097, dtype, seed=3)
    g = adversarial(4097, dtype, seed=4)

    def run() -> tuple[torch.Tensor, torch.Tensor, list[str]]:
        leaf = x.clone().requires_grad_()
        y = fn(leaf * 1)
        nodes = node_names(y)
        y.backward(g)
        return y.detach(), leaf.grad, nodes

    ref_y, ref_g, ref_nodes = run()
    with relu_ext.install():
        y, gr, nodes = run()
    assert f"{kind}ExtBackward0" in nodes and not any(n.startswith(kind + "Backward") for n in nodes), nodes
    assert any(n.startswith(kind + "Backward") for n in ref_nodes), ref_nodes
    assert_family_equal(y, ref_y, f"{name} output")
    assert_family_equal(gr, ref_g, f"{name} gradient", x, g if kind == "Hardtanh" else None)
    assert node_names(fn(x.clone().requires_grad_() * 1)) == ref_nodes, "uninstalled: PyTorch's nodes again"


def test_install_a_subset(_pytorch_kernels_around):
    x = torch.randn(10, requires_grad=True)
    with relu_ext.install(ops=["hardtanh"]) as hold:
        assert hold.ops == ("hardtanh",) and relu_ext.installed("hardtanh") and not relu_ext.installed("relu")
        assert F.relu6(x).grad_fn.name() == "HardtanhExtBackward0"
        assert F.relu(x).grad_fn.name() == "ReluBackward0" and F.leaky_relu(x).grad_fn.name() == "LeakyReluBackward0"
        with relu_ext.install("relu"):
            assert F.relu(x).grad_fn.name() == "ReluExtBackward0"
        assert F.relu(x).grad_fn.name() == "ReluBackward0" and relu_ext.installed("hardtanh")
    assert not relu_ext.installed()
    with pytest.raises(ValueError, match="unknown op.*'gelu'"):
        relu_ext.install(ops=["gelu"])
    for wrong, named in ((5, "got int"), (torch.zeros(1 << 20), "got Tensor"), (["relu", None], "got NoneType")):
        with pytest.raises(TypeError, match=f"relu_ext.install: ops must be .*{named}"):
            relu_ext.install(ops=wrong)
    assert not relu_ext.installed()
    assert list(relu_ext.install_targets()) == [c.op for c in ONE_PER_OP]  # every op of the table


def test_install_keeps_pytorchs_kernel_for_integers(_pytorch_kernels_around):
    i = torch.arange(-5, 5)
    ref = (F.relu6(i), F.hardtanh(i, -2, 3), F.threshold(i, 1, 7))
    with relu_ext.install():
        got = (F.relu6(i), F.hardtanh(i, -2, 3), F.threshold(i, 1, 7))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


# --- save_compact and real models ----------------------------------------------------------


@pytest.mark.parametrize("case", ["relu6", "threshold", "hardsigmoid"])
def test_save_compact_restores_family_outputs_bitwise(case, _pytorch_kernels_around):
    c = BY_ID[case]
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 4, 3)
    x = with_edges(adversarial(2 * 4 * 40 * 40, torch.float32, seed=1), c[4]).view(2, 4, 40, 40)
    x = x.nan_to_num(1.0, 2.0, -2.0)  # finite: a NaN or inf would reach every gradient through the conv
    results = []
    for impl, ctx in (("torch", None), ("relu_ext", None), ("relu_ext", relu_ext.save_compact(min_saving=0.0)),
                      ("torch", relu_ext.save_compact(min_saving=0.0))):
        leaf = x.clone().requires_grad_()
        conv.zero_grad()
        made: list[Any] = []
        if ctx is not None:
            inner = ctx.pack_hook
            ctx.pack_hook = lambda t: made.append(inner(t)) or made[-1]
        with ctx if ctx is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            y = conv(run_case(c, impl, leaf * 1))
        y.square().sum().backward()
        results.append([leaf.grad, conv.weight.grad.clone()])
        if ctx is not None and impl == "relu_ext":  # PyTorch's ThresholdBackward0 does not keep `value`
            assert any(type(m).__name__ == "Compacted" for m in made), f"{impl}: nothing was compacted"
    for r in results[1:]:
        assert_family_equal(r[1], results[0][1], "weight gradient")
        assert_family_equal(r[0], results[0][0], "input gradient", x, results[0][0] if c[3] == "hardtanh" else None)


def test_mobilenet_v2_holds_less_and_trains_bitwise(_pytorch_kernels_around):
    tv = pytest.importorskip("torchvision")
    from relu_ext.bench import real

    torch.manual_seed(0)
    model = tv.models.mobilenet_v2(weights=None).train()
    x = torch.randn(2, 3, 64, 64)
    configs = ("nn.ReLU", "install", "install+compact", "install+recompute")
    held = {config: real.held_bytes(model, x, config) for config in configs}
    assert held["install"] <= 0.75 * held["nn.ReLU"], held
    assert held["install+compact"] <= 0.65 * held["nn.ReLU"], held
    assert held["install+recompute"] <= 0.50 * held["nn.ReLU"], held  # the BN -> ReLU6 outputs rebuilt

    def step(config: str) -> list[torch.Tensor]:
        model.zero_grad()
        torch.manual_seed(1)
        with real.installing(config)(), real.saving(config) or torch.enable_grad():
            loss = real.loss_of(model, x)
        with real.installing(config)():
            loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    ref = step("nn.ReLU")
    for config in configs[1:]:
        for a, b in zip(step(config), ref):
            assert torch.equal(bits(a), bits(b)), config
