"""The two test tiers (tests/tiers.py): the quick tier stays small, covers every parameter value
of every test, and drops no test function the full tier has, except those marked `full`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import tiers

ROOT = Path(__file__).resolve().parents[2]
# What `make test` may collect. Raise it only with a reason: the quick tier is the README's test
# command, at most 3 minutes of tests on a 2-core machine. (1,000 -> 1,010: save_compact's table of
# remade ops grew by eight rows, and chains through outputs no node keeps: 14 tests of milliseconds.
# 1,010 -> 1,018: two rows more, a mul by a number and embedding, an embedding table changed in
# place after its lookup, a chain through a LayerNorm in steps (three eps), the remade tensors'
# fingerprint: milliseconds each; and remade ops on CUDA (skipped without a GPU). 1,018 -> 1,019:
# the hooks' entries to compact and expand without torch.ops, four dtypes in one test. 1,019 ->
# 1,022: remade casts of one tensor as twins, a twin of a form that missed, a LayerNorm's eps noted
# on its node; a recipe verified with its identity as the forward holds it; a LayerNorm output
# remade with its weight's last eps: milliseconds each. 1,024 -> 1,025: the benchmark's timed hooks
# make the forms untimed ones do, a two-layer CNN's step each way. 1,025 -> 1,026: a sample of one
# long call is its best after an untimed one, four sleeps. 1,026 -> 1,028: random nets against
# PyTorch, one group of eight small nets of each kind, about a second each. 1,028 -> 1,032:
# hardtanh with a NaN bound, each dtype once, milliseconds each. 1,032 -> 1,034: 16-bit hardtanh
# bounds that round to zero. 1,034 -> 1,036: vmap layouts and forward-over-reverse signed zeros,
# relu's case of each. 1,036 -> 1,038: views of a parameter counted once, the pack hook's density
# test against the Python one, milliseconds each. 1,038 -> 1,039: more architectures' training
# steps, one model in the quick tier, a few seconds.) Counted without the tests of the AVX-512 kernel
# set, which only some machines have: with a third kernel set the tier covers it in tests of its
# own (each with each dtype), and the same tier measured 1,038 on an AVX2 machine and 1,041 on an
# AVX-512 one (before the 1,039). The bound is an AVX2 machine's count; an AVX-512 one runs those tests beside it.
QUICK_TIER_BOUND = 1039


def _collected(*args: str) -> list[str]:
    """The node ids `pytest --collect-only` lists with `args`, from the repository's root (the
    quick tier unless `args` say otherwise, whatever RELU_EXT_FULL says here)."""
    env = {k: v for k, v in os.environ.items() if k != "RELU_EXT_FULL"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args,
                          "tests"], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode in (0, 5), out.stdout[-3000:] + out.stderr[-3000:]
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def _functions(ids: list[str]) -> set[str]:
    return {i.split("[")[0] for i in ids}


@pytest.mark.full  # two collections of the whole suite
def test_the_quick_tier_is_bounded_and_keeps_every_test_function(tmp_path):
    """The quick tier stays within its bound and keeps every test function the full tier has (but
    those marked `full`), and `--rest` runs exactly what the full tier adds to it."""
    tiers_file = tmp_path / "tiers.txt"
    full = _collected("--full", f"--tiers-to={tiers_file}")
    tags = {nodeid: flags for flags, nodeid in (line.split(" ", 1) for line in tiers_file.read_text().splitlines())}
    assert list(tags) == full
    quick, rest, full_only = ([i for i in full if tags[i][k] == "1"] for k in range(3))
    assert quick == _collected()  # what a plain run collects
    counted = [i for i in quick if not re.search(r"[\[-]avx512[-\]]", i)]
    assert 300 <= len(counted) <= QUICK_TIER_BOUND, f"the quick tier collects {len(counted)} tests (AVX-512's aside)"
    assert set(quick) < set(full)
    assert set(rest) <= set(full) and not set(quick) & set(rest)
    # --rest runs what --full adds to the quick tier, but for tests with quick(rest=...).
    narrowed = {f for f in _functions(full)
                if f.endswith(("test_a_training_step_is_pytorchs", "test_more_architectures_train_bit_for_bit"))}
    assert narrowed and {i for i in set(full) - set(quick) - set(rest) if _functions([i]) - narrowed} == set()
    missing = _functions(full) - _functions(full_only) - _functions(quick)
    assert not missing, f"in the full tier only, without a `full` marker: {sorted(missing)}"


class _Item(SimpleNamespace):
    """A stand-in for a pytest item: its parameters, its `quick` marker, its skipifs."""

    def get_closest_marker(self, name: str) -> object:
        return self.marks.get(name)

    def iter_markers(self, name: str) -> list:
        return self.skips if name == "skipif" else []


def _items(grid: dict[str, list], quick: "dict | None" = None) -> list[_Item]:
    """Every combination of `grid`, in pytest's order (the last parameter varies fastest)."""
    combos = [{}]
    for name, values in grid.items():
        combos = [{**c, name: v} for c in combos for v in values]
    mark = SimpleNamespace(kwargs=quick) if quick is not None else None
    return [_Item(callspec=SimpleNamespace(params=c), marks={"quick": mark} if mark else {},
                  skips=[SimpleNamespace(args=(True,))] if c.get("device") == "cuda" else []) for c in combos]


def test_covering_takes_every_value_of_every_parameter_in_few_items():
    grid = {"dtype": ["f32", "f64", "f16", "bf16"], "n": [0, 1, 31, 33, 1023, 4097, 1_000_003],
            "isa": ["scalar", "avx2", "avx512"]}
    chosen = tiers._covering(_items(grid))
    assert len(chosen) == 7  # the longest list: each pick covers a new size
    for name, values in grid.items():
        assert {i.callspec.params[name] for i in chosen} == set(values), name


def test_covering_pairs_kernel_sets_with_dtypes_on_items_that_run_here():
    """Each kernel set meets each dtype (a path per element width), never through an item that a
    skipif skips here (the CUDA variants without a GPU)."""
    grid = {"cpu_isa": ["scalar", "avx2", "avx512"], "dtype": ["f32", "f64", "f16", "bf16"],
            "n": [0, 1, 31], "device": ["cpu", "cuda"]}
    chosen = tiers._covering(_items(grid))
    assert all(i.callspec.params["device"] == "cpu" for i in chosen)
    assert {(i.callspec.params["cpu_isa"], i.callspec.params["dtype"]) for i in chosen} == \
        {(a, d) for a in grid["cpu_isa"] for d in grid["dtype"]}
    assert {i.callspec.params["n"] for i in chosen} == set(grid["n"])
    (first,) = tiers._covering(_items({"device": ["cuda"]}))  # nothing runs here: one item, to show the skip
    assert first.callspec.params == {"device": "cuda"}


def test_covering_follows_the_quick_marker():
    grid = {"arch": ["resnet18", "densenet121", "googlenet"], "dtype": ["f32", "bf16"]}
    chosen = tiers._covering(_items(grid, {"cover": ("dtype",)}))
    assert [i.callspec.params for i in chosen] == [{"arch": "resnet18", "dtype": "f32"},
                                                   {"arch": "resnet18", "dtype": "bf16"}]
    (one,) = tiers._covering(_items(grid, {"cover": ()}))
    assert one.callspec.params == {"arch": "resnet18", "dtype": "f32"}
    # Unhashable values (a list in a table) count by identity.
    rows = [[1], [2]]
    assert len(tiers._covering(_items({"row": rows}))) == 2


GROUPED = """
import os, pytest

@pytest.fixture(scope="session")
def pid():
    return os.getpid()

@pytest.mark.xdist_group("g")
@pytest.mark.parametrize("k", range(4))
def test_grouped(pid, k, tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent.parent / f"pid-{pid}").touch()

@pytest.mark.parametrize("k", range(8))
def test_other(k):
    pass
"""


@pytest.mark.full  # a pytest-xdist run in a process of its own (~8 s)
def test_pytest_xdist_keeps_a_group_on_one_worker(tmp_path):
    """`--dist loadgroup` sends the tests of one `xdist_group` to one worker, so a session fixture
    behind them (the benchmark run in tests/tooling/test_bench.py) is made once. pytest-xdist 3.8
    names the group in `item._nodeid`, which pytest 9.2 no longer reads: the Makefile pins a pair
    that works."""
    pytest.importorskip("xdist")
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "base").mkdir()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                          "loadgroup", "--basetemp", str(tmp_path / "base" / "t"), "test_grouped.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert len(list((tmp_path / "base").glob("pid-*"))) == 1, "the group's tests ran on more than one worker"
