"""Every python snippet of the README runs as written, top to bottom, in one fresh process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def snippets() -> list[str]:
    """The README's ```python blocks, in order."""
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_snippets():
    assert len(snippets()) >= 2


def test_readme_snippets_run():
    blocks = snippets()
    if any(re.search(r"\.cuda\(|device=\"cuda\"", b) for b in blocks) and not torch.cuda.is_available():
        pytest.skip("a README snippet needs a GPU and none is visible")
    if any("torchvision" in b for b in blocks):
        pytest.importorskip("torchvision")
    # One process, the blocks in order (a later one may use an earlier one's names),
    # each line as written; a failure names the block.
    program = "\n".join(
        f"print('--- README block {i}', flush=True)\n{block}" for i, block in enumerate(blocks)
    )
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "error::UserWarning:relu_ext"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("--- README block") == len(blocks)


ROOT = README.parent
# `bench/results/PATH` or a link to it; optionally "at commit SHA" (a run deleted since, kept in git history).
CITATION = re.compile(r"(?:`|\]\((?:\.\./)*)(bench/results/[^`)\s]*)[`)](\s+at\s+commit\s+([0-9a-f]{7,40}))?")


def citations() -> list[tuple[str, str, str | None]]:
    """(document, cited path's fixed prefix, commit or None) of every results file the docs cite;
    a glob or template (`.*`, `{json,png}`, `*.json`, `<date>`) cut at its first wildcard."""
    docs = [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "bench").glob("*.md"))]
    found = []
    for doc in (d for d in docs if d.exists()):
        for m in CITATION.finditer(doc.read_text()):
            prefix = re.split(r"[*{<]", m.group(1))[0]
            found.append((doc.name, prefix, m.group(3)))
    return found


def test_cited_results_exist():
    """A results file a doc cites is in bench/results, or is cited "at commit X" where git has it."""
    if not (ROOT / "bench" / "results").is_dir():
        pytest.skip("no bench/results here (an unpacked sdist leaves the figures out)")
    found = citations()
    assert any(commit for _, _, commit in found), "expected citations of deleted runs at their commit"
    top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    own_history = top.returncode == 0 and Path(top.stdout.strip()).resolve() == ROOT.resolve()
    tracked = {}
    for doc, prefix, commit in found:
        if commit is None:
            assert list(ROOT.glob(prefix + "*")) or (ROOT / prefix).exists(), f"{doc} cites missing {prefix}"
            continue
        if not own_history:
            continue  # a copy of the tree (CI's scratch builds), not a checkout: no history of its own to check
        if commit not in tracked:
            ls = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", commit, "bench/results/"],
                                capture_output=True, text=True)
            tracked[commit] = ls.stdout.splitlines() if ls.returncode == 0 else None
        if tracked[commit] is None:
            continue  # no git history here (a copy of the tree): the path cannot be checked
        assert any(p.startswith(prefix) for p in tracked[commit]), f"{doc} cites {prefix} at {commit}: not there"
        assert not list(ROOT.glob(prefix + "*")), f"{doc} cites {prefix} at {commit}, but it is still here"
