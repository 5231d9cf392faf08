"""The `remat` command as a whole: one parser and its help, ``python -m remat``, exit codes
and one-line errors, progress on a terminal (remat/cli/main.py, remat/cli/console.py)."""

from __future__ import annotations

import io
import os
import sys

import pytest

from helpers import one_error_line
from remat.cli import main


def test_the_package_exports_main_only() -> None:
    import remat.cli

    assert sorted(remat.cli.__all__) == ["main"]
    for name in remat.cli.__all__:
        assert hasattr(remat.cli, name), name


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["report", "--help"], ["estimate", "--help"]])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: remat")
    assert argv[0] == "--help" or argv[0] in out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0"]) == 2
    assert "steps must be an int >= 1" in capsys.readouterr().err
    assert main(["nope"]) == 2
    assert main(["demo", "--strategies", "torch"]) == 2
    assert "including 'none'" in capsys.readouterr().err
    assert main(["report", "--model", "not a path"]) == 2
    assert "package.module:factory" in capsys.readouterr().err


def test_python_dash_m_remat_is_the_remat_command() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "remat", "--help"], capture_output=True, text=True, check=True
    )
    assert "demo" in result.stdout and "plan" in result.stdout


def test_the_command_asks_nvml_whether_cuda_is_there_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As the command (argv from sys.argv) it sets torch's switch, so that forked simulations
    # can run a backward on a machine with a GPU; a caller's own setting stays; a caller that
    # passes argv (the library used from Python) keeps its environment as it was.
    from remat.cli.main import NVML_CHECK

    monkeypatch.setenv(NVML_CHECK, "placeholder")  # restored after the test
    monkeypatch.delenv(NVML_CHECK)
    assert main(["--help"]) == 0 and NVML_CHECK not in os.environ
    monkeypatch.setattr(sys, "argv", ["remat", "--help"])
    assert main() == 0 and os.environ[NVML_CHECK] == "1"
    monkeypatch.setenv(NVML_CHECK, "0")
    assert main() == 0 and os.environ[NVML_CHECK] == "0"
    capsys.readouterr()


# -- exit codes and one-line errors --------------------------------------------


@pytest.mark.parametrize(
    ("argv", "prog", "text"),
    [
        (["demo", "--steps", "x"], "remat demo", "invalid int value"),
        (["demo", "--nope"], "remat", "unrecognized arguments: --nope"),
        (["nope"], "remat", "invalid choice: 'nope'"),
        (["report", "--strategy", "fast"], "remat report", "invalid choice: 'fast'"),
        (["estimate", "--dtype", "int8"], "remat estimate", "invalid choice: 'int8'"),
        (["plan", "--steps", "x"], "remat plan", "invalid int value"),
        (["plan", "--steps", "0"], "remat plan", "--steps and --repeats must be >= 1"),
        (["report", "--model", "not a path"], "remat report", "package.module:factory, got 'not a path'"),
        (["estimate", "--model", "pkg/mod.py"], "remat estimate", "package.module:factory"),
        (["plan", "--model", "remat.models"], "remat plan", "package.module:factory"),
        (["estimate", "--model", "mlp", "--layers", "4"], "remat estimate", "--layers shape the built-in GPT"),
        (["estimate", "--model", "mlp", "--hf-config", "x.json"], "remat estimate", "not allowed with argument"),
        (["estimate", "--batch", "0"], "remat estimate", "--batch must be an int >= 1, got 0"),
    ],
)
def test_usage_errors_exit_2_with_one_line(
    argv: list[str], prog: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert text in one_error_line(capsys.readouterr().err, prog)


def test_exit_codes_of_the_installed_command() -> None:
    import subprocess

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "remat", *argv], capture_output=True, text=True)

    usage = run("estimate", "--model", "a b")
    assert usage.returncode == 2 and usage.stdout == ""
    assert usage.stderr.splitlines() == [
        "remat estimate: error: --model must be one of gpt, mlp, convnet or look like "
        "package.module:factory, got 'a b'."
    ]
    bad = run("plan", "--model", "no_such_module_xyz:f")
    assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1


# -- progress ------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("command", [["estimate", "--layers", "1", "--seq", "16"],
                                     ["demo", "--steps", "1", "--warmup", "0", "--layers", "2", "--seq", "32",
                                      "--batch", "2", "--strategies", "none", "--no-plots"],
                                     pytest.param(["plan", "--layers", "2", "--d-model", "16", "--seq", "16",
                                                   "--batch", "1", "--budget", "100%", "--repeats", "1",
                                                   "--steps", "1"], marks=pytest.mark.slow)])
def test_progress_on_a_terminal_only_and_not_with_quiet(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the built-in bar, deterministic text
    label = f"remat {command[0]} ["
    assert main(command) == 0
    assert capsys.readouterr().err == ""  # stderr is not a terminal here
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(command) == 0
    assert label in terminal.getvalue()
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main([*command, "--quiet"]) == 0
    assert quiet.getvalue() == ""


def test_progress_draws_with_tqdm_when_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["estimate", "--layers", "1", "--seq", "16", "--optimizer", "none"]) == 0
    assert "remat estimate" in terminal.getvalue() and "2/2" in terminal.getvalue()
