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
- `native`, `torch_version`: the risk a test checks, for the CI legs that
  run the full matrices of just those (see docs/testing.md).

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
    "quick(cover)": "the parameters the quick tier covers: each value at least once (default: all)",
    "xdist_group(name)": "pytest-xdist --dist loadgroup runs the tests of one group in one worker",
    "native": "reaches relu_ext's native code: kernels, ops, compaction, replay (the sanitizer leg)",
    "torch_version": "depends on torch's version: registration, fake kernels, compilers, exporters, "
                     "torch.func, private autograd attributes, BatchNorm's formula, distributed",
}


def add_option(parser: pytest.Parser) -> None:
    """`--full` (everything; also RELU_EXT_FULL=1) and `--full-marked MARK`."""
    parser.addoption("--full", action="store_true", default=os.environ.get("RELU_EXT_FULL") == "1",
                     help="run the full tier: every test with every parameter combination (default: the quick tier)")
    parser.addoption("--full-marked", metavar="MARK", default=None,
                     help="the full matrices of the tests marked MARK, the quick tier of the rest")


class Tier:
    """This session's tier, for the tests whose size is a number rather than parameters (the fuzz
    run's examples): set once when pytest is configured."""

    full = False


def configure(config: pytest.Config) -> None:
    """Registers the markers and records the tier."""
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    Tier.full = config.getoption("full")


def _full_for(config: pytest.Config, item: pytest.Item) -> bool:
    """Whether `item` runs with its whole matrix in this session."""
    mark = config.getoption("full_marked")
    return config.getoption("full") or (mark is not None and item.get_closest_marker(mark) is not None)


def _key(value: object) -> object:
    """A value as a set member: itself where hashable, else its identity (the test table's object)."""
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _values(item: pytest.Item, cover: "Iterable[str] | None") -> set[tuple[str, object]]:
    """The (parameter, value) pairs of `item` that the quick tier must cover."""
    spec = getattr(item, "callspec", None)
    if spec is None:
        return set()
    names = spec.params if cover is None else [n for n in cover if n in spec.params]
    return {(n, _key(spec.params[n])) for n in names}


def _covering(items: list[pytest.Item]) -> list[pytest.Item]:
    """A small subset of one test function's items that covers every parameter value they have:
    greedy, each pick the item with the most values not yet covered (first in collection order on
    a tie), so the pick is the same in every process (pytest-xdist collects once per worker)."""
    mark = items[0].get_closest_marker("quick")
    cover = mark.kwargs.get("cover") if mark is not None else None
    want = [_values(i, cover) for i in items]
    left = set().union(*want)
    chosen = [0]  # the first combination always: a test with nothing to cover still runs once
    left -= want[0]
    while left:
        best = max(range(len(items)), key=lambda k: (len(want[k] & left), -k))
        chosen.append(best)
        left -= want[best]
    return [items[k] for k in sorted(chosen)]


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drops, in place, what this tier does not run, and reports it as deselected."""
    keep: list[pytest.Item] = []
    groups: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        if _full_for(config, item):
            keep.append(item)
        elif item.get_closest_marker("full") is None:
            groups[item.nodeid.split("[")[0]].append(item)
    for group in groups.values():
        keep.extend(_covering(group))
    kept = set(map(id, keep))
    dropped = [i for i in items if id(i) not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = [i for i in items if id(i) in kept]
