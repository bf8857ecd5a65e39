"""The two test tiers, chosen from markers and the tests' own parameter tables.

- The **full tier** (`pytest --full`, `make test-full`) runs every test with
  every parameter combination.
- The **quick tier** (plain `pytest`, `make test`) runs every test function,
  each with a covering subset of its combinations: every value of every
  parameter (dtype, layout, size, op, kernel set, ...) at least once, chosen
  greedily from the combinations the test declares. Nothing is listed by name,
  so a new row of a table or a new parameter value is in both tiers at once.

Markers steer it:
- `full`: the test (or one `pytest.param`) runs in the full tier only;
- `quick(cover=(...))`: the parameters the quick tier covers for this test
  (default: all of them); `cover=()` runs one combination, the first;
  `quick(..., rest=(...))`: the parameters `--rest` covers for it, where
  every combination is too long for CI (a real-model matrix: each model
  once); only `--full` then runs every combination;
- `native`, `torch_version`: the risk a test checks, for the CI legs that
  run the full matrices of just those (see docs/testing.md).

Some parameters are covered in pairs (PAIRS): a CPU kernel set has a code
path per element width, so each kernel set meets each dtype.

`--rest` runs the full tier less the quick tier: what `pytest --full` adds to
plain `pytest` (CI runs it after `make test`, on the same build).
`--full-marked MARK` gives the tests marked MARK their full matrices and the
rest the quick tier (the oldest-torch leg runs `--full-marked torch_version`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Iterable

import pytest

MARKERS = {
    "full": "in the full tier only (pytest --full)",
    "quick(cover, rest)": "the parameters the quick tier (cover) and --rest (rest) cover: each value at least once "
                          "(default: all; --rest: every combination)",
    "xdist_group(name)": "pytest-xdist --dist loadgroup runs the tests of one group in one worker",
    "native": "reaches relu_ext's native code: kernels, ops, compaction, replay (the sanitizer leg)",
    "torch_version": "depends on torch's version: registration, fake kernels, compilers, exporters, "
                     "torch.func, private autograd attributes, BatchNorm's formula, distributed",
}


def add_option(parser: pytest.Parser) -> None:
    """`--full` (everything; also RELU_EXT_FULL=1), `--rest` and `--full-marked MARK`."""
    parser.addoption("--full", action="store_true", default=os.environ.get("RELU_EXT_FULL") == "1",
                     help="run the full tier: every test with every parameter combination (default: the quick tier)")
    parser.addoption("--rest", action="store_true", default=False,
                     help="run the full tier less the quick tier (what --full adds to a plain run)")
    parser.addoption("--full-marked", metavar="MARK", default=None,
                     help="the full matrices of the tests marked MARK, the quick tier of the rest")
    parser.addoption("--tiers-to", metavar="FILE", default=None,
                     help="write each collected test's tiers to FILE (tests/tooling/test_tiers.py reads it)")


# Parameters whose values are covered together, every pair of values, where a test has both.
PAIRS = [("cpu_isa", "dtype")]


def configure(config: pytest.Config) -> None:
    """Registers the markers."""
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def _full_for(config: pytest.Config, item: pytest.Item) -> bool:
    """Whether `item` runs with its whole matrix in the quick tier of this session (`--full-marked`)."""
    mark = config.getoption("full_marked")
    return mark is not None and item.get_closest_marker(mark) is not None


def _by_function(items: "Iterable[pytest.Item]") -> list[list[pytest.Item]]:
    """`items` grouped by test function (node id less its parameters), in collection order."""
    groups: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        groups[item.nodeid.split("[")[0]].append(item)
    return list(groups.values())


def _key(value: object) -> object:
    """A value as a set member: itself where hashable, else its identity (the test table's object)."""
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _values(item: pytest.Item, cover: "Iterable[str] | None") -> set[tuple[object, object]]:
    """What of `item` the quick tier must cover: (parameter, value) for each parameter, and
    ((parameter, parameter), (value, value)) for each of PAIRS that it has."""
    spec = getattr(item, "callspec", None)
    if spec is None:
        return set()
    names = [n for n in spec.params if cover is None or n in cover]
    pairs = [p for p in PAIRS if set(p) <= set(names)]
    return ({(n, _key(spec.params[n])) for n in names}
            | {(p, tuple(_key(spec.params[n]) for n in p)) for p in pairs})


def _skipped_here(item: pytest.Item) -> bool:
    """Whether a `skipif` with a plain True condition skips `item` on this machine (the CUDA
    variants where no GPU is visible): such an item covers nothing."""
    return any(bool(m.args) and m.args[0] is True for m in item.iter_markers("skipif"))


def _covering(items: list[pytest.Item], key: str = "cover") -> list[pytest.Item]:
    """A small subset of one test function's items that covers every parameter value (and every
    pair of PAIRS) of the items that run here, of the parameters its `quick` marker names under
    `key` (default: all): greedy, each pick the item with the most not yet
    covered (first in collection order on a tie), so the pick is the same in every process
    (pytest-xdist collects once per worker)."""
    mark = items[0].get_closest_marker("quick")
    cover = mark.kwargs.get(key) if mark is not None else None
    runs = [k for k, i in enumerate(items) if not _skipped_here(i)]
    want = {k: _values(items[k], cover) for k in runs}
    left = set().union(*want.values())
    # The first combination that runs here (else the first): a test with nothing to cover runs once.
    chosen = [runs[0] if runs else 0]
    left -= want.get(chosen[0], set())
    while left:
        best = max(runs, key=lambda k: (len(want[k] & left), -k))
        chosen.append(best)
        left -= want[best]
    return [items[k] for k in sorted(chosen)]


def _quick(config: pytest.Config, items: list[pytest.Item]) -> set[int]:
    """The ids of the items the quick tier (with `--full-marked`, if given) runs."""
    keep: list[pytest.Item] = []
    rest: list[pytest.Item] = []
    for i in items:
        if _full_for(config, i):
            keep.append(i)
        elif i.get_closest_marker("full") is None:
            rest.append(i)
    for group in _by_function(rest):
        keep.extend(_covering(group))
    return set(map(id, keep))


def _rest(items: list[pytest.Item], quick: set[int]) -> set[int]:
    """The ids of the items `--rest` runs: those the quick tier does not, except where a `quick`
    marker names `rest=(...)`: there a covering of those parameters."""
    kept: set[int] = set()
    for group in _by_function(items):
        mark = group[0].get_closest_marker("quick")
        chosen = _covering(group, "rest") if mark is not None and "rest" in mark.kwargs else group
        kept |= {id(i) for i in chosen if id(i) not in quick}
    return kept


def write_tiers(path: str, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Writes a line `QRF NODEID` for each of `items`: Q, R and F are 1 where the quick tier runs
    it, where `--rest` runs it and where it is marked `full` (else 0). One collection then gives
    every tier, as the other options would select them."""
    quick = _quick(config, items)
    rest = _rest(items, quick)
    with open(path, "w") as f:
        for i in items:
            full = i.get_closest_marker("full") is not None
            f.write(f"{int(id(i) in quick)}{int(id(i) in rest)}{int(full)} {i.nodeid}\n")


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drops, in place, what this tier does not run, and reports it as deselected."""
    if config.getoption("tiers_to"):
        write_tiers(config.getoption("tiers_to"), config, items)
    if config.getoption("full"):
        return
    quick = _quick(config, items)
    kept = _rest(items, quick) if config.getoption("rest") else quick
    dropped = [i for i in items if id(i) not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = [i for i in items if id(i) in kept]
