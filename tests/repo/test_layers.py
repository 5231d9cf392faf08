"""The shape rules that tools alone do not check (docs/design/architecture.md,
"Checking it").

ruff's banned-API rule keeps torch's private *modules* (``torch._C``,
``torch.utils._pytree``...) inside the ``remat/_compat/`` package, and import-linter keeps
the layers one-way. Neither sees private *attributes* of torch objects
(``tensor._version``, ``op._schema``): this test does.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

from helpers import REPO

SRC = REPO / "src" / "remat"

# Private attributes of torch's tensors, storages, autograd nodes and operators.
TORCH_PRIVATE_ATTRIBUTES = frozenset(
    {
        "_version",
        "_base",
        "_is_view",
        "_schema",
        "_sequence_nr",
        "_cdata",
        "_typed_storage",
        "_grad_fn",
        "_backward_hooks",
        "_execution_engine",
        "_register_state_dict_hook",
        "_register_load_state_dict_pre_hook",
        "_raw_saved_self",
        "_saved_self",
    }
)


def private_torch_attributes(source: str, where: str) -> list[str]:
    return [
        f"{where}:{node.lineno}: .{node.attr}"
        for node in ast.walk(ast.parse(source, where))
        if isinstance(node, ast.Attribute) and node.attr in TORCH_PRIVATE_ATTRIBUTES
    ]


def test_private_torch_attributes_only_in_compat() -> None:
    offenders = [
        hit
        for path in sorted(SRC.rglob("*.py"))
        if path.relative_to(SRC).parts[0] != "_compat"
        for hit in private_torch_attributes(path.read_text(), str(path.relative_to(SRC.parent)))
    ]
    assert not offenders, (
        "use (or add) a function of the remat._compat module that gates it instead:\n" + "\n".join(offenders)
    )


def test_the_check_sees_a_private_attribute() -> None:
    source = "def f(t, op):\n    return t._version, op._schema.is_mutable, t.version\n"
    assert private_torch_attributes(source, "probe.py") == [
        "probe.py:2: ._version",
        "probe.py:2: ._schema",
    ]


def test_import_remat_loads_the_checkpoint_core_only() -> None:
    # In a fresh interpreter: the planner, its solvers, the memory tracker, the
    # demo model, the module front-ends and the compile path load on first use,
    # not with `import remat`, which loads at most 25 remat modules (the
    # remat._compat package counted as one): the engine, the storage package it
    # keeps tensors through, the function front-end, the bottom layer. Of
    # remat._compat's modules only those the checkpoint core uses load (pipelining
    # imports nothing of torch: it looks for a stage only once pipelining is loaded): the ones
    # for inductor, Dynamo, the partitioner, fake tensors, torch.distributed, the
    # profiler, nn.Module's private slots and the version gates load on first use.
    probe = (
        "import sys, remat\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('remat'))\n"
        "print(len(loaded), *loaded)\n"
        "assert 'plan' in dir(remat) and callable(remat.plan) and remat.Plan\n"
        "assert 'remat.planner' in sys.modules\n"
        "assert remat.checkpoint_wrapper is remat.nn.checkpoint_wrapper\n"
        "assert remat.checkpoint_module.__module__ == 'remat.composable'\n"
        "assert callable(remat.offload) and remat.GraphExecGroup\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(SRC.parent)},
    )
    count, *loaded = result.stdout.split()
    lazy = ("remat.planner", "remat.memory", "remat.models", "remat.nn", "remat.composable",
            "remat.compile")
    assert not any(m.startswith(lazy) for m in loaded), loaded
    compat = {m for m in loaded if m.startswith("remat._compat.")}
    core = {
        f"remat._compat.{name}" for name in ("autograd", "dispatch", "pytree", "devices", "tracers", "pipelining")
    }
    assert compat <= core, sorted(compat - core)
    assert int(count) - len(compat) <= 25, loaded


def test_version_is_single_sourced() -> None:
    import importlib.metadata

    import remat

    # pyproject.toml reads the version from remat/__init__.py (tool.hatch.version).
    assert remat.__version__ == importlib.metadata.version("remat")
    text = (SRC.parent.parent / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text and "\nversion =" not in text


def test_each_package_docstring_names_every_module() -> None:
    # A reading order that leaves modules out sends a newcomer to grep. The
    # top level's map is docs/design/architecture.md's layer table.
    architecture = (SRC.parents[1] / "docs" / "design" / "architecture.md").read_text()
    missing = []
    for init in sorted(SRC.rglob("__init__.py")):
        package = init.parent
        text = architecture if package == SRC else ast.get_docstring(ast.parse(init.read_text())) or ""
        names = [
            path.stem if path.suffix == ".py" else path.name
            for path in package.iterdir()
            if (path.suffix == ".py" and path.stem not in ("__init__", "__main__"))
            or (path / "__init__.py").is_file()
        ]
        missing += [
            f"{package.relative_to(SRC.parent)}: {name}"
            for name in names
            if not re.search(rf"[`.]{re.escape(name)}(?!\w)", text)  # as code: `name` or a.b.name
        ]
    assert not missing, "modules their package's reading order does not name:\n" + "\n".join(missing)


def test_no_benchmark_imports_the_command_line_package() -> None:
    # The application sits on top: what benchmarks share with it lives in the
    # library (remat.models, remat.launch); a benchmark of a command runs the
    # command as users do (benchmarks/command.py).
    found = []
    for path in sorted((SRC.parents[1] / "benchmarks").glob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            names = (
                [alias.name for alias in node.names] if isinstance(node, ast.Import)
                else [node.module or ""] if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{path.name}:{node.lineno}: {name}" for name in names if name.split(".")[:2] == ["remat", "cli"]]
        if "remat.cli" in source:
            found.append(f"{path.name}: names remat.cli (a rank target?)")
    assert not found, found
