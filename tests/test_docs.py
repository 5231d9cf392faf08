"""Every ```python block of the user guide and the recipes runs (docs must not lie).

Blocks of one page run in order in one namespace, as a reader would paste
them; a block preceded by a ``<!-- skip: why -->`` line is not run (it needs
something a test machine lacks; the reason says where it is tested instead).
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted([*DOCS.glob("guide/*.md"), *DOCS.glob("recipes/*.md")])
_BLOCK = re.compile(r"(<!-- skip:[^\n]*-->\n)?```python\n(.*?)```", re.DOTALL)


def test_there_are_pages() -> None:
    assert len(PAGES) >= 12, PAGES


@pytest.mark.parametrize("page", PAGES, ids=[f"{p.parent.name}/{p.name}" for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [(skip, code) for skip, code in _BLOCK.findall(page.read_text())]
    if not any(not skip for skip, _ in blocks):
        pytest.skip(f"{page.name}: no runnable python block")
    if "transformers" in page.read_text():
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # pages may write files
    torch.manual_seed(0)
    # A real module: torch.compile looks the code's module up in sys.modules.
    module = types.ModuleType(f"docs_{page.parent.name}_{page.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for index, (skip, code) in enumerate(blocks):
        if skip:
            continue
        exec(compile(code, f"{page}:block{index}", "exec"), module.__dict__)
