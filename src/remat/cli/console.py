"""What every ``remat`` command shares on the terminal: parsing, exit codes, progress.

Layer: the bottom of ``remat.cli`` (the application); imports only
``remat.errors``.

Exit codes a script can rely on, for ``remat demo|report|estimate|plan``:

* ``0``: done;
* ``2``: usage error (a bad flag or value, a ``--model`` that is not
  ``builtin`` or ``package.module:factory``);
* ``1``: the model could not be built (the factory's module does not import,
  the factory raises or returns the wrong shape, the HF config is unreadable)
  or the command failed on it.

Each failure prints one line on stderr, ``remat <command>: error: ...``, and
no traceback. Progress bars go to stderr too, only when stderr is a terminal
and ``--quiet`` was not given; tqdm draws them when installed
(``pip install remat[progress]``), a plain bar otherwise.

Example:
    >>> parser = CommandParser(prog="remat demo")
    >>> _ = parser.add_argument("--steps", type=int)
    >>> run_command("remat demo", lambda: parser.parse_args(["--steps", "x"]) and 0)
    2
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn, TextIO

from remat.errors import CheckpointTypeError, CheckpointUsageError, RematError

__all__ = [
    "EXIT_BAD_MODEL",
    "EXIT_USAGE",
    "CommandParser",
    "add_quiet_argument",
    "check_writable",
    "progress",
    "progress_wanted",
    "run_command",
]

EXIT_USAGE = 2
"""Bad flags or values, as argparse reports them."""

EXIT_BAD_MODEL = 1
"""The model could not be built, or the command failed on it."""


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: ``<prog>: error: <what>``.

    argparse prints the whole usage before the error; a script reading stderr
    wants the one line, and ``--help`` has the usage.

    Example:
        >>> CommandParser(prog="remat x").format_usage().startswith("usage: remat x")
        True
    """

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``-q/--quiet``: no progress bar on stderr.

    Example:
        >>> parser = CommandParser()
        >>> add_quiet_argument(parser)
        >>> parser.parse_args(["-q"]).quiet
        True
    """
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar (there is none either when stderr is not a terminal)")


def run_command(prog: str, body: Callable[[], int]) -> int:
    """Run a command's body and turn its failures into an exit code and one stderr line.

    ``SystemExit`` from argparse keeps its code (0 for ``--help``, 2 for a bad
    flag, message already printed). Errors in remat's hierarchy print
    ``<prog>: error: <message>``: usage and type errors exit 2,
    :class:`~remat.errors.ModelLoadError` (not a usage error) and the other
    remat errors exit 1.
    Anything else is a bug and keeps its traceback.

    Example:
        >>> def fails() -> int:
        ...     raise CheckpointUsageError("remat estimate: --batch must be >= 1, got 0.")
        >>> run_command("remat estimate", fails)  # doctest: +SKIP
        remat estimate: error: --batch must be >= 1, got 0.
        2
    """
    try:
        return body()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else EXIT_BAD_MODEL
    except RematError as error:
        usage = isinstance(error, (CheckpointUsageError, CheckpointTypeError))
        code = EXIT_USAGE if usage else EXIT_BAD_MODEL
        print(f"{prog}: error: {_one_line(str(error), prog)}", file=sys.stderr)
        return code


def _one_line(message: str, prog: str) -> str:
    """The message on one line, without a repeated ``<prog>: `` prefix."""
    text = " ".join(message.split())
    return text[len(prog) + 2 :] if text.startswith(f"{prog}: ") else text


def check_writable(path: str | Path, flag: str, prog: str) -> None:
    """Refuse an output path that cannot be written, before the work that fills it.

    Creates the file (and missing folders, as the writers do), then removes
    what it created, so a command that plans for minutes does not lose its
    result at the end. A path that cannot be written is a
    :class:`~remat.errors.CheckpointUsageError` (exit 2).

    Example:
        >>> import pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> check_writable(folder / "plans" / "plan.toml", "--save", "remat plan")
        >>> list(folder.iterdir())  # nothing left behind
        []
    """
    target = Path(path)
    made = [folder for folder in target.parents if not folder.exists()]
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a"):
            pass
    except OSError as error:
        raise CheckpointUsageError(
            f"{prog}: {flag} {path}: cannot write there ({error.strerror or error}); pass a "
            "path in a folder you can write."
        ) from error
    finally:
        if not existed and target.is_file():
            target.unlink()
        for folder in made:  # innermost first
            with contextlib.suppress(OSError):
                folder.rmdir()


def progress_wanted(quiet: bool, stream: TextIO | None = None) -> bool:
    """Whether to draw progress: not ``quiet`` and ``stream`` (stderr) is a terminal.

    Example:
        >>> import io
        >>> progress_wanted(False, io.StringIO())
        False
    """
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not quiet and bool(isatty and isatty())


@contextlib.contextmanager
def progress(total: int, label: str, *, enabled: bool) -> Iterator[Callable[..., None]]:
    """A progress bar on stderr; yields ``tick(stage="")``, one call per unit done.

    ``stage`` names what runs next (shown after the bar). tqdm draws the bar
    when installed, a plain ``label [###...] done/total`` line otherwise; a
    disabled bar prints nothing.

    Example:
        >>> with progress(2, "remat estimate", enabled=False) as tick:
        ...     tick("first step")
        ...     tick()
    """
    if not enabled:
        yield _nothing
        return
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, desc=label, leave=False, file=sys.stderr)

        def tick_tqdm(stage: str = "") -> None:
            bar.update(1)
            if stage:
                bar.set_postfix_str(stage)

        try:
            yield tick_tqdm
        finally:
            bar.close()
        return
    done = [0]
    width = [0]

    def tick(stage: str = "") -> None:
        done[0] += 1
        filled = 30 * done[0] // max(total, 1)
        line = f"{label} [{'#' * filled}{'.' * (30 - filled)}] {done[0]}/{total} {stage}".rstrip()
        sys.stderr.write("\r" + line.ljust(width[0]))
        width[0] = max(width[0], len(line))
        sys.stderr.flush()

    try:
        yield tick
    finally:
        sys.stderr.write("\r" + " " * width[0] + "\r")
        sys.stderr.flush()


def _nothing(stage: str = "") -> None:
    """The tick of a disabled progress bar."""
