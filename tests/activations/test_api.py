"""The public API's manners (issue 29): cuda_available(), save_compact()'s report,
convert()/revert() telling what they did, inplace as PyTorch takes it, the
package metadata, docstrings and their examples, TorchScript archives."""

from __future__ import annotations

import doctest
import inspect
import logging
import pydoc
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import relu_ext
from relu_ext import _C
from cases import REPRESENTATIVES

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, timeout: int = 300) -> str:
    """stdout of `code` run in a fresh interpreter, which must exit 0."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


# --- cuda_available ------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("gpu", [False, True])
def test_cuda_available_needs_the_kernels_and_a_gpu(compiled, gpu, monkeypatch):
    asked = []
    monkeypatch.setattr(_C, "with_cuda", compiled)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or gpu)
    assert relu_ext.cuda_available() is (compiled and gpu)
    assert asked == ([1] if compiled else [])  # a build without CUDA kernels does not ask torch


def test_cuda_available_picks_a_device_that_works():
    assert relu_ext.cuda_available() == (relu_ext.build_info()["cuda"] and torch.cuda.is_available())
    device = "cuda" if relu_ext.cuda_available() else "cpu"
    x = torch.randn(8, device=device)
    assert torch.equal(relu_ext.relu(x), torch.relu(x))


def test_compiled_in_is_build_info_and_both_docstrings_say_so():
    assert relu_ext.build_info()["cuda"] is bool(_C.with_cuda)
    assert 'build_info()["cuda"]' in relu_ext.cuda_available.__doc__
    assert "cuda_available" in relu_ext.build_info.__doc__ and "compiled in" in relu_ext.build_info.__doc__


@pytest.mark.parametrize("compiled", [False, True])
def test_import_asks_torch_about_gpus_only_in_a_build_without_cuda_kernels(compiled):
    """In a CUDA build, torch.cuda.is_available() at import would initialize the CUDA
    driver (and break CUDA in processes forked later). The build is simulated: the
    native module's with_cuda is set as it loads, before the package's import-time check."""
    code = f"""
import importlib.machinery, sys, torch

class Simulate:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "relu_ext._C":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            module.with_cuda = {compiled}
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Simulate)
asked = []
torch.cuda.is_available = lambda: asked.append(1) or False
import relu_ext
assert relu_ext._C.with_cuda is {compiled}
print("asked", len(asked))
"""
    assert _python(code).split()[-1] == ("0" if compiled else "1")


# --- save_compact's report -----------------------------------------------------------------


class _Save(torch.autograd.Function):
    """Saves the tensors it is given for backward (each save goes through the pack hook)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *saved: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*saved)
        return out.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        _ = ctx.saved_tensors  # unpacked: restored
        return (g,) + (None,) * len(ctx.needs_input_grad[1:])


def test_save_compact_gives_itself_and_counts_each_tensor_once():
    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)
    dense = (torch.rand(64, 128) + 0.5).requires_grad_()
    tiny = torch.randn(4, 4, requires_grad=True)
    meta = torch.randn(64, 128, device="meta", requires_grad=True)
    ctx = relu_ext.save_compact()
    with ctx as sc:
        y = torch.relu(x)  # its node saves y: compacted
        d = torch.relu(dense)  # no zeros: too few to gain
        s = torch.relu(tiny)  # 16 elements: too small
        m = torch.relu(meta)  # not on the CPU or CUDA: unsupported
        view = y[:, :64]  # a view: no activation output
        out = _Save.apply(y, y, view, x, s, d, y)  # y, s, d again: not counted again
    assert sc is ctx
    assert sc.compacted == 1
    assert sc.kept_by_reason == {"not_activation": 2, "not_replayed": 0, "unsupported": 1, "too_small": 1,
                                 "too_few_zeros": 1}
    assert (sc.replayed, sc.replay_misses) == (0, 0)  # no BatchNorm here
    assert sc.kept == 5
    nbytes = [t.nbytes for t in (y, d, s, m, view, x)]
    assert sc.bytes_saved_for_backward == sum(nbytes)
    values, bitmap = 4 * int((y != 0).sum()), y.numel() // 8  # PyTorch's ReLU: a bitmap of its own
    assert sc.bytes_held == sum(nbytes) - y.nbytes + values + bitmap
    out.sum().backward()
    assert torch.equal(x.grad, (x > 0).to(x.dtype))  # through the ReLU, whose output came back
    text = sc.report()
    # x, a leaf that requires grad, is held outside the graph: the report lists it apart (the counters count it).
    assert text.splitlines()[0].startswith("relu_ext.save_compact: 5 tensors saved for backward")
    for words in ("compacted: 1 tensor,", "kept as they are: 4 tensors", "1 not an activation output", "1 too small",
                  "1 too few zeros", "1 unsupported type", f"held outside the graph: 1 tensor, {x.nbytes / 1024:.2f} KiB"):
        assert words in text, (words, text)
    assert "replayed" not in text  # said only where a BatchNorm output was seen
    assert repr(sc) == (f"<relu_ext.save_compact min_saving=0.1 recompute=True replayed=0 compacted=1 concatenated=0 pooled=0 remade=0 narrowed=0 two_valued=0 kept=5 "
                        f"bytes_saved_for_backward={sc.bytes_saved_for_backward} bytes_held={sc.bytes_held}>")


def test_save_compact_does_not_count_a_relu_ext_mask_twice():
    """A relu_ext output's bitmap is its node's mask: held anyway, kept (counted) once as the node saved it."""
    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)
    with relu_ext.save_compact() as sc:
        y = relu_ext.relu(x)  # its node saves the mask
        _Save.apply(y, y)
    mask = y.grad_fn._saved_mask
    assert (sc.compacted, sc.kept, sc.kept_by_reason["not_activation"]) == (1, 1, 1)
    assert sc.bytes_saved_for_backward == y.nbytes + mask.nbytes
    assert sc.bytes_held == mask.nbytes + 4 * int((y != 0).sum())


def test_save_compact_counts_add_up_over_blocks_and_start_at_zero():
    sc = relu_ext.save_compact()
    assert (sc.compacted, sc.kept, sc.bytes_saved_for_backward, sc.bytes_held) == (0, 0, 0, 0)
    assert "0 tensors saved for backward" in sc.report()
    x = torch.randn(64, 128, requires_grad=True)
    for _ in range(2):
        with sc:
            torch.relu(x * 2)  # a new output each time; x * 2 saves nothing (a Python scalar)
    assert sc.compacted == 2 and sc.kept == 0


# --- convert / revert ----------------------------------------------------------------------


def test_convert_warns_when_nothing_was_swapped():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.GELU())
    with pytest.warns(UserWarning, match=r"relu_ext.convert: nothing to swap in this Sequential") as rec:
        assert relu_ext.convert(model) is model
    message = str(rec[0].message)
    for name in (f"torch.nn.{c.module.__name__}" for c in REPRESENTATIVES):  # every module of the table
        assert name in message, message
    assert rec[0].filename == __file__  # it points at the caller, as PyTorch's warnings do


def test_revert_warns_when_nothing_was_swapped_and_convert_twice_says_why():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    with pytest.warns(UserWarning, match=r"relu_ext.revert: nothing to swap.*relu_ext.ReLU\b"):
        assert relu_ext.revert(model) is model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        relu_ext.convert(model)
    with pytest.warns(UserWarning, match=r"holds 1 relu_ext module\(s\) already"):
        relu_ext.convert(model)


def test_convert_and_revert_log_what_they_swapped(caplog):
    shared = torch.nn.ReLU()
    model = torch.nn.Sequential(shared, torch.nn.Linear(2, 2), shared, torch.nn.ReLU(), torch.nn.ReLU6())
    with caplog.at_level(logging.INFO, logger="relu_ext"), warnings.catch_warnings():
        warnings.simplefilter("error")
        relu_ext.convert(model)
        relu_ext.revert(model)
    messages = [r.getMessage() for r in caplog.records if r.name == "relu_ext" and r.levelno == logging.INFO]
    assert messages == [
        "relu_ext.convert: swapped 3 module(s) in Sequential: 2 torch.nn.ReLU -> relu_ext.ReLU, "
        "1 torch.nn.ReLU6 -> relu_ext.ReLU6",
        "relu_ext.revert: swapped 3 module(s) in Sequential: 2 relu_ext.ReLU -> torch.nn.ReLU, "
        "1 relu_ext.ReLU6 -> torch.nn.ReLU6",
    ]


def test_convert_logs_the_activations_it_left_alone(caplog):
    class MyReLU(torch.nn.ReLU):
        pass

    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.GELU(), torch.nn.SiLU(), torch.nn.GELU(), MyReLU(),
                                torch.nn.Hardswish())
    with caplog.at_level(logging.INFO, logger="relu_ext"):
        relu_ext.convert(model)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "relu_ext"]
    assert message == ("relu_ext.convert: swapped 1 module(s) in Sequential: 1 torch.nn.ReLU -> relu_ext.ReLU; "
                       "left alone: 2 torch.nn.GELU, 1 torch.nn.SiLU, 1 MyReLU, 1 torch.nn.Hardswish")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="relu_ext"), pytest.warns(UserWarning, match="nothing to swap"):
        relu_ext.convert(torch.nn.Sequential(torch.nn.GELU()))
    assert [r.getMessage() for r in caplog.records if r.name == "relu_ext"] == [
        "relu_ext.convert: Sequential; left alone: 1 torch.nn.GELU"]


@pytest.mark.parametrize("fn", ["convert", "revert"])
@pytest.mark.parametrize("arg", [torch.randn(3), None, [torch.nn.ReLU()]], ids=["Tensor", "NoneType", "list"])
def test_convert_and_revert_take_only_modules(fn, arg):
    with pytest.raises(TypeError, match=rf"^relu_ext.{fn}: expected an nn.Module, got {type(arg).__name__}$"):
        getattr(relu_ext, fn)(arg)


# --- inplace as PyTorch takes it -----------------------------------------------------------

# (relu_ext function, torch function, relu_ext module, torch module, positional arguments)
# One per public function, from the table (tests/cases.py).
FAMILY = [(getattr(relu_ext, c.name), getattr(F, c.name), c.ours_module, c.module, c.module_args) for c in REPRESENTATIVES]
INPLACE = ["yes", 1, 0, None, "", True]


@pytest.mark.parametrize("inplace", INPLACE, ids=repr)
@pytest.mark.parametrize("case", FAMILY, ids=lambda c: c[3].__name__)
def test_modules_take_inplace_as_torch_does(case, inplace):
    _, _, ours, theirs, args = case
    a, b = ours(*args, inplace=inplace), theirs(*args, inplace=inplace)
    assert repr(a) == repr(b) and a.inplace == b.inplace
    x = torch.randn(64) * 4
    xa, xb = x.clone(), x.clone()
    ya, yb = a(xa), b(xb)
    assert torch.equal(ya, yb)
    assert (ya is xa) == (yb is xb) and torch.equal(xa, xb)  # in place, or not, alike


@pytest.mark.parametrize("inplace", INPLACE, ids=repr)
@pytest.mark.parametrize("case", FAMILY, ids=lambda c: c[1].__name__)
def test_functions_take_inplace_as_torch_does(case, inplace):
    ours, theirs, _, _, args = case
    x = torch.randn(64) * 4
    for requires_grad in (False, True):
        leaf_a, leaf_b = x.clone().requires_grad_(requires_grad), x.clone().requires_grad_(requires_grad)
        xa, xb = leaf_a * 1, leaf_b * 1
        ya, yb = ours(xa, *args, inplace=inplace), theirs(xb, *args, inplace=inplace)
        assert torch.equal(ya, yb)
        assert (ya is xa) == (yb is xb) and torch.equal(xa, xb)
        if requires_grad:
            ya.sum().backward()
            yb.sum().backward()
            assert torch.equal(leaf_a.grad, leaf_b.grad)


def test_relu_inplace_of_any_type_still_rejects_what_is_no_tensor():
    with pytest.raises(TypeError, match="expected a Tensor"):
        relu_ext.relu([1.0], inplace="yes")
    with pytest.raises(RuntimeError, match="ambiguous"):  # bool() of a tensor, as F.relu raises
        relu_ext.relu(torch.randn(3), inplace=torch.ones(2))


# --- package metadata ----------------------------------------------------------------------


def test_classifiers_agree_with_requires_python():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    low = re.fullmatch(r">=\s*3\.(\d+)", project["requires-python"])
    assert low, project["requires-python"]
    listed = sorted(int(m) for c in project["classifiers"]
                    for m in re.findall(r"^Programming Language :: Python :: 3\.(\d+)$", c))
    assert listed and listed[0] == int(low.group(1)) and listed == list(range(listed[0], listed[-1] + 1)), listed
    assert listed[-1] >= 13, listed
    assert "python_requires" not in (ROOT / "setup.py").read_text()  # one place says which Pythons


# --- docstrings ----------------------------------------------------------------------------


def _takes_arguments(obj: Any) -> bool:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return True
    return any(p.name != "self" for p in params)


DOCUMENTED = list(relu_ext.__all__)


@pytest.mark.parametrize("name", DOCUMENTED)
def test_public_names_have_pytorch_style_sections(name):
    obj = getattr(relu_ext, name)
    doc = inspect.getdoc(obj)
    assert doc and "Example::" in doc, name
    if _takes_arguments(obj):
        assert "\nArgs:\n" in doc, name
    if not inspect.isclass(obj):
        assert "\nReturns:\n" in doc, name


def test_docstring_examples_run():
    """Every ``>>>`` example of the public names gives the output it shows."""
    globs = {"torch": torch, "nn": torch.nn, "F": F, "relu_ext": relu_ext}
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    ran = 0
    try:
        for name in relu_ext.__all__:
            for test in finder.find(getattr(relu_ext, name), f"relu_ext.{name}", globs=dict(globs)):
                ran += len(test.examples)
                runner.run(test)
    finally:
        relu_ext.uninstall()
    result = runner.summarize(verbose=False)
    assert result.failed == 0, result
    assert ran >= 40, ran


def test_package_docstring_is_an_overview():
    doc = relu_ext.__doc__
    assert len(doc.splitlines()) <= 25, len(doc.splitlines())
    for name in ("relu", "ReLU", "convert", "install", "save_compact", "cuda_available", "build_info"):
        assert name in doc, name


def test_module_classes_have_short_docstrings_pointing_to_torch():
    for name in (c.ours_module.__name__ for c in REPRESENTATIVES):  # every module of the table
        doc = getattr(relu_ext, name).__doc__
        assert f"torch.nn.{name}" in doc and "import relu_ext" in doc and len(doc.splitlines()) <= 30, name


@pytest.mark.parametrize("name", relu_ext.__all__)
def test_help_of_each_name_is_short(name):
    """help(relu_ext) renders each name of __all__ as help(relu_ext.<name>) does. Ours
    stays short; pydoc adds, to each nn.Module subclass, nn.Module's ~1050 lines of
    inherited methods (help(torch.nn.ReLU) alone is ~1100), which no docstring changes."""
    obj = getattr(relu_ext, name)
    text = pydoc.plain(pydoc.render_doc(obj))
    if inspect.isclass(obj):
        text = text.split("Method resolution order:", 1)[0]
    assert len(text.splitlines()) <= 60, (name, len(text.splitlines()))


# --- TorchScript archives of converted models ----------------------------------------------


@pytest.mark.parametrize("module", [c.ours_module(*c.module_args) for c in REPRESENTATIVES],
                         ids=lambda m: type(m).__name__)
def test_torchscript_of_a_relu_ext_module_warns(module):
    """Scripting or tracing a model with relu_ext's modules warns that its archive needs relu_ext."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), module)
    name = type(module).__name__
    with pytest.warns(UserWarning, match=rf"relu_ext.{name} under torch.jit.script: .*needs `import relu_ext`"):
        torch.jit.script(model)
    with pytest.warns(UserWarning, match=rf"relu_ext.{name} under torch.jit.trace: .*needs `import relu_ext`"):
        torch.jit.trace(model, (torch.randn(2, 4),))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="relu_ext")
        model(torch.randn(2, 4))  # eager: no warning


def test_torchscript_archive_of_converted_model_needs_relu_ext(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2)).eval()
    x = torch.randn(3, 4)
    want = model(x)
    relu_ext.convert(model)
    with pytest.warns(UserWarning, match=r"relu_ext.ReLU under torch.jit.script: .*relu_ext.revert\(model\)"):
        scripted = torch.jit.script(model)
    torch.jit.save(scripted, tmp_path / "converted.pt")
    relu_ext.revert(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="relu_ext")  # nothing of relu_ext's left: no warning of ours
        torch.jit.save(torch.jit.script(model), tmp_path / "reverted.pt")
    torch.save(x, tmp_path / "x.pt")
    code = f"""
import sys, torch
x = torch.load({str(tmp_path / 'x.pt')!r})
try:
    torch.jit.load({str(tmp_path / 'converted.pt')!r})
except RuntimeError as e:
    print("REFUSED", "relu_ext::relu" in str(e))
else:
    print("LOADED")
reverted = torch.jit.load({str(tmp_path / 'reverted.pt')!r})
print("REVERTED", reverted(x).tolist(), "relu_ext" in sys.modules)
import relu_ext
print("CONVERTED", torch.jit.load({str(tmp_path / 'converted.pt')!r})(x).tolist())
"""
    lines = dict(line.split(" ", 1) for line in _python(code).splitlines())
    assert lines["REFUSED"] == "True", lines
    assert lines["REVERTED"] == f"{want.tolist()} False"
    assert lines["CONVERTED"] == str(want.tolist())
