"""The tables of activations agree: the C++ trait table (relu_ext._C.activation_table(), from
csrc/activations/activations.h), the Python table (relu_ext.activations.ACTIVATIONS, whose nodes and
parameters are read from it), the test table (tests/cases.py), and the lists outside Python that run
activations (the CUDA emulation's cases, bench/gpu_check.sh's sanitizer selection, the benchmark's
family rows). A row added to one and not to the others fails here."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import relu_ext
from cases import BY_ID, CASES, ONE_PER_OP, OPS, REPRESENTATIVES, run_case
from relu_ext import _C
from relu_ext.activations import ACTIVATIONS

pytestmark = pytest.mark.torch_version  # the risk it checks: see tests/tiers.py

ROOT = Path(__file__).resolve().parents[2]
PY = {a.name: a for a in ACTIVATIONS}


def test_every_op_is_in_every_table():
    """Each C++ trait has a Python row and a test row, in the same order, and each of these a trait;
    the Python rows' nodes and parameters are the C++ traits' and the registered schemas'."""
    cpp = [name for name, _, _ in _C.activation_table()]
    assert len(set(cpp)) == len(cpp), cpp
    assert list(PY) == cpp, f"C++ traits {cpp} vs Python table {list(PY)}"
    assert OPS == cpp, f"test table {OPS} vs C++ traits {cpp}"
    assert list(relu_ext.install_targets()) == cpp
    for (name, node, params), act in zip(_C.activation_table(), ACTIVATIONS):
        schema = getattr(torch.ops.relu_ext, name).default._schema
        assert act.node == node and act.params == tuple(params) == tuple(a.name for a in schema.arguments[1:]), name
        aten = [a.name for a in getattr(torch.ops.aten, name).default._schema.arguments[1:]]
        assert list(act.params) == aten, f"{name}: relu_ext's Scalars {act.params} vs aten's {aten}"
    with pytest.raises(ValueError, match="no C.. trait"):
        type(ACTIVATIONS[0])("gelu", (), (), lambda a: False)


def test_public_names_come_from_the_table():
    """relu_ext exports each row's functions and modules, and nothing of the table is spelled twice."""
    names = [f.__name__ for a in ACTIVATIONS for f in a.functions] + [m.__name__ for a in ACTIVATIONS
                                                                      for _, m in a.modules]
    assert set(names) <= set(relu_ext.__all__) and len(set(names)) == len(names), names
    for name in names:
        assert getattr(relu_ext, name).__module__ == "relu_ext", name


def test_rows_match_the_python_table():
    """Each test row's arguments, modules and node are the Python table's for its op."""
    for c in CASES:
        params = PY[c.op].params
        assert len(c.args) == len(params), f"{c.id}: {c.args} for {c.op}{params}"
        assert c.node == PY[c.op].node, c.id
        assert (c.module, c.ours_module) in PY[c.op].modules, f"{c.id}: {c.module.__name__} is not a module of {c.op}"
    in_python = {m for a in ACTIVATIONS for m in a.modules}
    assert {(c.module, c.ours_module) for c in CASES} == in_python, "a module with no test row, or a row with none"


def test_public_functions_and_representatives():
    """Each row's function is public in relu_ext and in torch.nn.functional; each function has
    exactly one representative row (the one-per-function lists), and each op one in ONE_PER_OP."""
    for c in CASES:
        assert c.name in relu_ext.__all__ and callable(getattr(F, c.name, None)), c.id
        assert c.ours_module.__name__ in relu_ext.__all__, c.id
    names = [c.name for c in REPRESENTATIVES]
    assert len(set(names)) == len(names) and set(names) == {c.name for c in CASES}, names
    assert [c.op for c in ONE_PER_OP] == OPS


def test_rows_run_as_their_op():
    """Each row's relu_ext function makes its op's node, PyTorch's function PyTorch's node of that op."""
    x = torch.randn(16, requires_grad=True)
    for c in CASES:
        assert run_case(c, "relu_ext", x * 1).grad_fn.name() == c.node, c.id
        assert run_case(c, "torch", x * 1).grad_fn.name() == PY[c.op].torch_node, c.id


def _trait(op: str) -> str:
    return "".join(p.capitalize() for p in op.split("_"))  # leaky_relu -> LeakyRelu, csrc/activations/activations.h's


def test_cuda_emulation_checks_every_trait():
    """tests/activations/cuda_emulation.cpp checks the family rows of the test table that
    tests/activations/test_cuda_emulation.py passes it (which cover every family trait of the C++
    table; relu has its own checks), dispatched by name over RELU_EXT_FAMILY with each trait's own
    params: it spells no family trait, so that none is checked, or left out, by hand."""
    from test_cuda_emulation import family_cases

    family = set(_C.install_targets()) - {"relu"}
    argv = family_cases()
    assert set(argv[1::4]) == family, f"the emulation's cases run {sorted(set(argv[1::4]))} of {sorted(family)}"
    text = (Path(__file__).with_name("cuda_emulation.cpp")).read_text()
    assert "RELU_EXT_FAMILY(" in text, "the harness no longer finds the family's ops in RELU_EXT_FAMILY"
    assert not re.findall(r"check_family\w*<relu_ext::", text), "a family check for a trait spelled by hand"
    for op in sorted(family):
        assert f"relu_ext::{_trait(op)}>" not in text, f"cuda_emulation.cpp spells {op}'s trait"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_check_sanitizer_selection_covers_every_op():
    """bench/gpu_check.sh's sanitizer selection runs each op's CUDA kernels: every op of the test
    table through test_family.py's test_every_op_of_the_table, relu through test_exact.py too, and
    some family rows (named by the test table's ids) at more sizes and dtypes."""
    out = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--list-sanitizer-tests"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    covered = set()
    for entry in out:
        if entry.startswith("tests/activations/test_exact.py::"):
            covered.add("relu")
        if entry == "tests/activations/test_family.py::test_every_op_of_the_table[cuda]":
            covered.update(OPS)  # it loops over one row per op of the table
        elif entry.startswith("tests/activations/test_family.py::"):
            case = entry.split("[", 1)[1].rstrip("]").split("-")[1]
            assert case in BY_ID, f"{entry}: no row {case!r} in tests/cases.py"
            covered.add(BY_ID[case].op)
    assert covered == set(OPS), f"the sanitizer runs {sorted(covered)} of {OPS}"


def test_benchmark_measures_every_family_op():
    """relu_ext.bench's family rows (src/relu_ext/bench/peers.py's FAMILY; relu has its own) cover
    every op of the family, with the op's arity."""
    from relu_ext.bench.peers import FAMILY

    ops = {name for _, name, _, _, _ in FAMILY}
    assert ops == set(OPS) - {"relu"}, sorted(ops)
    for label, name, args, _, _ in FAMILY:
        assert len(args) == len(PY[name].params), label
