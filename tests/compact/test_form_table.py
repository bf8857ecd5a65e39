"""save_compact()'s table of forms (relu_ext.compact.recipes.FORMS) agrees with the forms, the counts
and the documentation: every form but Narrowed (narrowed at the exit) has a row, each form's kind
and miss reason are ones the counts know, and docs/save_compact.md's table lists the rows in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relu_ext.compact import forms, recipes, stats

pytestmark = pytest.mark.native  # the risk it checks: see tests/tiers.py

DOC = Path(__file__).resolve().parents[2] / "docs" / "save_compact.md"


def _forms() -> set[type]:
    """Every form class save_compact() keeps a tensor in."""
    found, todo = set(), [forms._Shared]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return found


def test_every_form_has_a_row():
    assert {row.form for row in recipes.FORMS} == _forms() - {forms.Narrowed}


def test_kinds_and_reasons_are_counted():
    for form in _forms():
        assert form.kind in stats._KINDS, form
        assert form.missed_as in stats._REASONS, form


def test_rows_are_whole():
    """Each row's parts are functions of this module, with docstrings: a row reads on its own."""
    for row in recipes.FORMS:
        for part in (row.applies, row.make):
            assert part.__module__ == recipes.__name__ and part.__doc__, (row, part)


def test_the_documented_table_lists_the_rows_in_order():
    text = DOC.read_text()
    table = text[text.index("## The table of forms"):text.index("## Checks that come back later")]
    documented = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert documented == [row.form.__name__ for row in recipes.FORMS]
