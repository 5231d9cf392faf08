"""The shape rules that tools alone do not check (STYLE habit 13).

ruff's banned-API rule keeps torch's private *modules* (``torch._C``,
``torch.utils._pytree``...) inside ``remat/_compat.py``, and import-linter keeps
the layers one-way. Neither sees private *attributes* of torch objects
(``tensor._version``, ``op._schema``): this test does.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "remat"

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
        if path.name != "_compat.py"
        for hit in private_torch_attributes(path.read_text(), str(path.relative_to(SRC.parent)))
    ]
    assert not offenders, "use (or add) a remat._compat function instead:\n" + "\n".join(offenders)


def test_the_check_sees_a_private_attribute() -> None:
    source = "def f(t, op):\n    return t._version, op._schema.is_mutable, t.version\n"
    assert private_torch_attributes(source, "probe.py") == [
        "probe.py:2: ._version",
        "probe.py:2: ._schema",
    ]
