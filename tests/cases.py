"""The test table of activations: one row per case (an op with its arguments), and every list of
activations the tests run derived from it, with the helpers that run a row.

Adding an activation to relu_ext takes one row here (two or more for an op with arguments
worth several cases); test_family.py runs every row through its batteries, the other files
take REPRESENTATIVES or ONE_PER_OP, and tests/activations/test_tables.py fails while this
table, relu_ext's Python table (relu_ext.activations.ACTIVATIONS, with relu) and its C++
trait table (relu_ext._C.install_targets()) disagree.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import relu_ext
from conftest import bits, known_torch_cuda_zero_difference


class Case(NamedTuple):
    """One row of the table. The first seven fields keep the order of the tuples the table was
    written as (so c[3] is the op, c[4] its arguments)."""

    id: str  # the test id
    ours: Callable  # relu_ext's function (called as run_case calls it)
    theirs: Callable  # PyTorch's function
    op: str  # the op: relu_ext::<op>, aten::<op>, a C++ trait, a row of relu_ext.activations.ACTIVATIONS
    args: tuple  # the op's Scalar arguments, in schema order
    module: type  # the torch.nn class
    module_args: tuple  # its positional arguments (the function's too, after the input)
    name: str  # the public function: relu_ext.<name>, torch.nn.functional.<name>
    ours_module: type  # relu_ext's class for `module`
    node: str  # relu_ext's backward node (grad_fn.name())
    representative: bool = False  # the row the one-per-function lists take: one per `name`


def _relu6(t: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return relu_ext.relu6(t, inplace)


def _torch_relu6(t: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return F.relu6(t, inplace)


_HT = ("hardtanh", relu_ext.Hardtanh, "HardtanhExtBackward0")
_LR = ("leaky_relu", relu_ext.LeakyReLU, "LeakyReluExtBackward0")
_TH = ("threshold", relu_ext.Threshold, "ThresholdExtBackward0")

CASES: list[Case] = [
    Case("relu", relu_ext.relu, F.relu, "relu", (), torch.nn.ReLU, (), "relu", relu_ext.ReLU, "ReluExtBackward0", True),
    Case("hardtanh", relu_ext.hardtanh, F.hardtanh, "hardtanh", (-1.0, 1.0), torch.nn.Hardtanh, (), *_HT),
    Case("relu6", _relu6, _torch_relu6, "hardtanh", (0.0, 6.0), torch.nn.ReLU6, (), "relu6", relu_ext.ReLU6,
         "HardtanhExtBackward0", True),
    Case("hardtanh_min_eq_max", relu_ext.hardtanh, F.hardtanh, "hardtanh", (0.5, 0.5), torch.nn.Hardtanh, (0.5, 0.5),
         *_HT),
    Case("hardtanh_odd", relu_ext.hardtanh, F.hardtanh, "hardtanh", (-2.5, 3.0), torch.nn.Hardtanh, (-2.5, 3.0), *_HT,
         True),
    Case("hardtanh_inexact", relu_ext.hardtanh, F.hardtanh, "hardtanh", (-0.1, 0.7), torch.nn.Hardtanh, (-0.1, 0.7),
         *_HT),
    Case("leaky", relu_ext.leaky_relu, F.leaky_relu, "leaky_relu", (0.01,), torch.nn.LeakyReLU, (), *_LR, True),
    Case("leaky_zero_slope", relu_ext.leaky_relu, F.leaky_relu, "leaky_relu", (0.0,), torch.nn.LeakyReLU, (0.0,), *_LR),
    Case("leaky_steep", relu_ext.leaky_relu, F.leaky_relu, "leaky_relu", (1.5,), torch.nn.LeakyReLU, (1.5,), *_LR),
    Case("leaky_negative", relu_ext.leaky_relu, F.leaky_relu, "leaky_relu", (-0.3,), torch.nn.LeakyReLU, (-0.3,),
         *_LR),
    Case("threshold", relu_ext.threshold, F.threshold, "threshold", (0.0, 0.0), torch.nn.Threshold, (0.0, 0.0), *_TH),
    Case("threshold_odd", relu_ext.threshold, F.threshold, "threshold", (0.1, 20.0), torch.nn.Threshold, (0.1, 20.0),
         *_TH, True),
    Case("threshold_nan_value", relu_ext.threshold, F.threshold, "threshold", (-1.0, float("nan")), torch.nn.Threshold,
         (-1.0, float("nan")), *_TH),
    Case("hardsigmoid", relu_ext.hardsigmoid, F.hardsigmoid, "hardsigmoid", (), torch.nn.Hardsigmoid, (),
         "hardsigmoid", relu_ext.Hardsigmoid, "HardsigmoidExtBackward0", True),
]
CASE_IDS = [c.id for c in CASES]
BY_ID = {c.id: c for c in CASES}
# Every op (relu and the C++ traits), in table order.
OPS = list(dict.fromkeys(c.op for c in CASES))
# One row per public function (relu, hardtanh, relu6, leaky_relu, threshold, hardsigmoid), in table order.
REPRESENTATIVES = [c for c in CASES if c.representative]
REPRESENTATIVE_IDS = [c.id for c in REPRESENTATIVES]
# One row per op: the first representative of each (relu6's for hardtanh).
ONE_PER_OP = list({c.op: c for c in reversed(REPRESENTATIVES)}.values())[::-1]
ONE_PER_OP_IDS = [c.id for c in ONE_PER_OP]
# The rows torch.func, gradcheck and opcheck run (a NaN value has no finite difference).
FUNC_CASES = [c for c in CASE_IDS if c not in ("threshold_nan_value",)]


def run_case(case: Case, impl: str, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """The row's function, relu_ext's (impl "relu_ext") or PyTorch's, on `x` with the row's arguments."""
    fn = case.ours if impl == "relu_ext" else case.theirs
    if case.name == "relu6" or not case.args:
        return fn(x, inplace=inplace)
    return fn(x, *case.args, inplace=inplace)


@functools.cache
def torch_fn(case: Case) -> Callable[[torch.Tensor], torch.Tensor]:
    """PyTorch's function of `case` with its arguments bound (one object per case, for the cache
    of known_torch_cuda_zero_difference)."""
    return lambda t: run_case(case, "torch", t)


def with_edges(x: torch.Tensor, args: tuple) -> torch.Tensor:
    """`x` with the op's thresholds (and ±3, hardsigmoid's) written exactly at every 5th element."""
    edges = [a for a in args if a == a] + [3.0, -3.0, 0.0, -0.0]
    vals = torch.tensor(edges, dtype=torch.float64).to(x.dtype).to(x.device)
    x = x.clone()
    k = x[::5].numel()
    if k:
        x[::5] = vals.repeat(k // len(edges) + 1)[:k]
    return x


def assert_family_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str, x: torch.Tensor | None = None,
                        nan_input_grad: torch.Tensor | None = None, case: Case | None = None) -> None:
    """Bit for bit, except: a NaN only has to meet a NaN (PyTorch's vectorized CPU
    loops rewrite NaN payloads, its scalar tail keeps them); where `x` is NaN,
    the gradient must be `nan_input_grad` (relu_ext follows PyTorch's scalar
    predicate there, which its vectorized hardtanh backward does not); and, for
    the outputs of `case` on a GPU whose torch turns that op's -0.0 into +0.0
    (torch 2.11's CUDA relu and clamp), relu_ext's -0.0 may meet torch's +0.0."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype and ours.stride() == theirs.stride(), what
    a, e = bits(ours), bits(theirs)
    both_nan = (ours.isnan() & theirs.isnan()).contiguous()
    a, e = a.masked_fill(both_nan, 0), e.masked_fill(both_nan, 0)
    if case is not None:
        known = known_torch_cuda_zero_difference(a, e, theirs, torch_fn(case))
        a, e = a.masked_fill(known, 0), e.masked_fill(known, 0)
    if x is not None and nan_input_grad is not None:
        at_nan = x.isnan().contiguous()
        want = nan_input_grad.detach()
        same = (bits(ours) == bits(want)) | (ours.isnan() & want.isnan()).contiguous()
        assert bool(same[at_nan].all()), f"{what}: gradient at NaN inputs"
        a, e = a.masked_fill(at_nan, 0), e.masked_fill(at_nan, 0)
    diff = (a != e).flatten().nonzero()
    if diff.numel():
        i = diff[0].item()
        raise AssertionError(f"{what}: {diff.numel()} of {a.numel()} differ; first at {i}: got "
                             f"{ours.flatten()[i].item()!r}, want {theirs.flatten()[i].item()!r}")


def grad_at_nan(case: Case, g: torch.Tensor) -> torch.Tensor | None:
    """hardtanh: PyTorch's scalar predicate !(x <= min || x >= max) passes g at a NaN input."""
    return g if case.op == "hardtanh" else None
