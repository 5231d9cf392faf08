"""``remat plan --save PATH`` refuses a path it cannot write before planning (``src/remat/cli/plan.py``).

Planning profiles the model for seconds to minutes; a path that fails only
when the plan is written loses the plan. The command checks the path first
(``remat.cli.console.check_writable``) and ends with the one-line error of
every command, exit 2.
"""

from __future__ import annotations

import pathlib

import pytest

import remat.cli.plan as plan_command
from remat.cli import main


def _never(*args: object, **kwargs: object) -> None:
    raise AssertionError("the output path is checked before any model is built or rank started")


@pytest.mark.parametrize("flags", [[], ["--world-size", "2", "--fsdp"]], ids=["one process", "ranks"])
def test_an_unwritable_save_path_ends_before_planning(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
) -> None:
    monkeypatch.setattr(plan_command, "load_model", _never)
    monkeypatch.setattr(plan_command, "run_on_ranks", _never)
    not_a_folder = tmp_path / "notes.txt"
    not_a_folder.write_text("a file, not a folder\n")
    for target in (not_a_folder / "plan.toml", tmp_path):  # under a file; a folder itself
        assert main(["plan", "--save", str(target), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err  # one line, no traceback
        assert err.startswith(f"remat plan: error: --save {target}: cannot write there (")
    assert sorted(tmp_path.iterdir()) == [not_a_folder]


def test_an_unwritable_plot_path_ends_before_planning(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(plan_command, "load_model", _never)
    assert main(["plan", "--plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"remat plan: error: --plot {tmp_path}: cannot write there (")


def test_the_check_leaves_nothing_behind(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "plans" / "plan.toml"
    seen: list[bool] = []

    def check_then_fail(*args: object, **kwargs: object) -> None:
        seen.append(target.parent.exists())
        raise AssertionError("stop after the check")

    monkeypatch.setattr(plan_command, "load_model", check_then_fail)
    with pytest.raises(AssertionError, match="stop after the check"):
        main(["plan", "--save", str(target)])
    assert seen == [False]  # the check made the folder and the file, then removed both
    assert list(tmp_path.iterdir()) == []
