"""Every ```python block of the user guide and the recipes runs (docs must not lie).

Blocks of one page run in order in one namespace, as a reader would paste
them; a block preceded by a ``<!-- skip: why -->`` line is not run (it needs
something a test machine lacks; the reason says where it is tested instead).
A ```python title="train.py"``` block is a file the reader saves (written to
the page's working directory, not run); a ```bash``` block preceded by
``<!-- run -->`` runs there line by line, with this interpreter's
``remat`` and ``torchrun`` first on the PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from helpers import REPO

DOCS = REPO / "docs"
PAGES = sorted([*DOCS.glob("guide/*.md"), *DOCS.glob("recipes/*.md")])
_BLOCK = re.compile(
    r'(<!-- (?:skip:[^\n]*|run) -->\n)?```(python|bash)(?: title="([^"]+)")?\n(.*?)```', re.DOTALL
)


def test_there_are_pages() -> None:
    assert len(PAGES) >= 12, PAGES


@pytest.mark.parametrize("page", PAGES, ids=[f"{p.parent.name}/{p.name}" for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = [
        (marker, language, title, code)
        for marker, language, title, code in _BLOCK.findall(page.read_text())
        if language == "python" or marker.startswith("<!-- run")
    ]
    if not any(not marker.startswith("<!-- skip") for marker, _, _, _ in blocks):
        pytest.skip(f"{page.name}: no runnable block")
    if "transformers" in page.read_text():
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # pages may write files
    torch.manual_seed(0)
    # A real module: torch.compile looks the code's module up in sys.modules.
    module = types.ModuleType(f"docs_{page.parent.name}_{page.stem.replace('-', '_')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    for index, (marker, language, title, code) in enumerate(blocks):
        if marker.startswith("<!-- skip"):
            continue
        if title:
            (tmp_path / title).write_text(code)
        elif language == "bash":
            _run_shell(code, tmp_path)
        else:
            exec(compile(code, f"{page}:block{index}", "exec"), module.__dict__)


def _run_shell(code: str, where: Path) -> None:
    """Each line of a shell block, as the reader would type it; a failure shows its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    for line in filter(None, (line.strip() for line in code.splitlines())):
        done = subprocess.run(
            line, shell=True, cwd=where, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{line!r} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
