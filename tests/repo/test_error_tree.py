"""One error tree, kept: every error remat raises on purpose is a ``RematError``.

``src/remat/errors.py`` promises it (and draws the tree); this test reads
every module under ``src/remat`` and fails on a ``raise`` of a bare built-in
exception class, naming the file and line. The fix is a class of that tree
which also subclasses the built-in, so a caller's ``except ValueError`` keeps
working.

Allowed, each for its reason:

* ``AttributeError`` in a ``__getattr__``: Python's attribute protocol
  (``hasattr``, ``getattr(obj, name, default)``, ``dir``) understands only it.
* ``NotImplementedError`` as the whole body of a method: an abstract method
  a subclass overrides; reaching it is a bug in the subclass, not an error
  about the user's arguments.
* A message that starts with ``"remat bug"``: an internal invariant that
  broke (``docs/design/architecture.md``'s principles; ``assert`` does the
  same where ``python -O`` may skip the check). No user can cause it.
* Re-raising a caught exception (``raise`` or ``raise error``): not a
  built-in class named at the raise, so not seen here.
"""

from __future__ import annotations

import ast
import builtins
import pathlib

import remat.errors

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "remat"

BUILTIN_EXCEPTIONS = frozenset(
    name
    for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)
)


def bare_raises(source: str, filename: str) -> list[str]:
    """``file:line: Name`` of each raise of a bare built-in exception that no rule allows."""
    tree = ast.parse(source, filename)
    found = []
    for function in [tree, *ast.walk(tree)]:
        if not isinstance(function, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in _own_nodes(function):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            called = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if not isinstance(called, ast.Name) or called.id not in BUILTIN_EXCEPTIONS:
                continue  # a remat class, or a caught exception raised again
            if not _allowed(called.id, node, function):
                found.append((node.lineno, f"{filename}:{node.lineno}: {called.id}"))
    return [finding for _, finding in sorted(found)]


def _own_nodes(scope: ast.AST) -> list[ast.AST]:
    """The nodes of a module or function, not those of functions defined inside it."""
    nodes, stack = [], list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        nodes.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))
    return nodes


def _allowed(name: str, node: ast.Raise, function: ast.AST) -> bool:
    if name == "AttributeError" and getattr(function, "name", None) == "__getattr__":
        return True
    if name == "NotImplementedError" and isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        body = function.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if body == [node]:
            return True
    message = node.exc.args[0] if isinstance(node.exc, ast.Call) and node.exc.args else None
    if isinstance(message, ast.JoinedStr) and message.values:
        message = message.values[0]
    return isinstance(message, ast.Constant) and str(message.value).startswith("remat bug")


def test_every_purposeful_raise_in_src_is_a_remat_error() -> None:
    found = [
        finding
        for path in sorted(SRC.rglob("*.py"))
        for finding in bare_raises(path.read_text(), str(path.relative_to(SRC.parents[1])))
    ]
    assert not found, (
        "bare built-in exceptions raised on purpose (use a class from src/remat/errors.py "
        "that also subclasses the built-in, or add one to its tree):\n" + "\n".join(found)
    )


def test_each_class_is_drawn_in_the_tree_and_is_also_a_builtin() -> None:
    tree = remat.errors.__doc__ or ""
    for name in remat.errors.__all__:
        error = getattr(remat.errors, name)
        assert f"{name} " in tree, f"{name} is missing from the tree in errors.py's docstring"
        assert issubclass(error, remat.errors.RematError)
        assert name == "RematError" or any(
            base.__name__ in BUILTIN_EXCEPTIONS and base is not Exception for base in error.__mro__
        ), f"{name} subclasses no built-in a caller would catch"


def test_the_scan_sees_what_it_must_and_allows_only_the_listed_cases() -> None:
    source = '''
def check(value):
    if value is None:
        raise ValueError("value is required")
    raise TypeError

def helper():
    def inner():
        raise KeyError("nested functions are scanned too")
    return inner

class Base:
    def method(self):
        """Overridden."""
        raise NotImplementedError

    def half_abstract(self, value):
        if value:
            return 1
        raise NotImplementedError("only the whole body counts as abstract")

    def __getattr__(self, name):
        raise AttributeError(name)

def invariant(kind):
    raise RuntimeError(f"remat bug: unknown kind {kind}")

def again():
    try:
        pass
    except ValueError as error:
        raise error
'''
    assert bare_raises(source, "example.py") == [
        "example.py:4: ValueError",
        "example.py:5: TypeError",
        "example.py:9: KeyError",
        "example.py:20: NotImplementedError",
    ]
