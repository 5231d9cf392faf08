"""Run the ``remat`` command as users do, for the benchmarks that measure the command.

``python -m remat <command> ... --json PATH --quiet`` in a child process that
imports the same ``remat`` as the benchmark (its folder goes first on
``PYTHONPATH``); the benchmark gets what the command printed and the JSON it
wrote. A failing command ends the benchmark with the command line and its
stderr.

Example:
    from command import run_remat
    printed, result = run_remat("estimate", "--layers", "2", "--seq", "64")
    result["peak_bytes"]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import remat

SOURCE = str(Path(remat.__file__).resolve().parents[1])
"""The folder the benchmark's ``remat`` was imported from."""


def run_remat(*args: str, timeout_s: float = 3600.0) -> tuple[str, dict[str, Any]]:
    """Run ``python -m remat *args --json PATH --quiet``; return its stdout and its JSON."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "result.json"
        line = [sys.executable, "-m", "remat", *args, "--json", str(path), "--quiet"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE, os.environ.get("PYTHONPATH")]))}
        done = subprocess.run(line, capture_output=True, text=True, env=env, timeout=timeout_s)
        if done.returncode != 0:
            raise SystemExit(
                f"benchmark: `{' '.join(line[1:])}` exited {done.returncode}:\n{done.stderr.strip()}"
            )
        return done.stdout, json.loads(path.read_text())
