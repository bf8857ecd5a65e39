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
