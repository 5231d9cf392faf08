"""remat._source: the user's line is found by module, not by path: code installed outside a
virtual environment is still the user's, torch anywhere is library code."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

from remat._source import is_library_module, user_frame

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Where pip puts packages outside a virtual environment: under the stdlib's directory.
SYSTEM_SITE = STDLIB / "site-packages"


def _run_as(module_name: str, filename: Path, call: Any) -> Any:
    """Call ``call()`` from a frame that looks like module ``module_name`` in ``filename``."""
    code = compile("result = call()", str(filename), "exec")
    namespace: dict[str, Any] = {"__name__": module_name, "call": call}
    exec(code, namespace)
    return namespace["result"]


def test_user_package_installed_outside_a_venv_is_the_users_code() -> None:
    frame = _run_as("mymodels.block", SYSTEM_SITE / "mymodels" / "block.py", user_frame)
    assert frame is not None and frame.f_code.co_filename.endswith("block.py")


def test_torch_installed_anywhere_is_library_code() -> None:
    # torch under an unusual path (a user site, a system dist-packages) is still torch.
    frame = _run_as("torch.nn.modules.module", Path("/opt/elsewhere/torch/nn/modules/module.py"),
                    user_frame)
    assert frame is not None and frame.f_code.co_name == "_run_as"  # the caller, not "torch"


def test_stdlib_and_remat_are_library_but_the_demo_model_is_not() -> None:
    assert is_library_module("functools") and is_library_module("importlib._bootstrap")
    assert is_library_module("remat._engine.hooks") and is_library_module("torch")
    assert not is_library_module("remat.models.gpt")
    assert not is_library_module("remat.models.chains")
    assert not is_library_module("transformers.models.llama.modeling_llama")
    assert not is_library_module("__main__")
    assert is_library_module(None, "<frozen importlib._bootstrap>")
    assert not is_library_module(None, "<string>")


def test_debug_log_points_at_the_users_line() -> None:
    import torch

    import remat
    from remat.errors import CheckpointError

    calls = {"n": 0}

    def block(x: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return x.sin() if calls["n"] == 1 else x.cos().cos()  # differs when recomputed

    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint(block, x, debug=True, early_stop=False)
    try:
        out.sum().backward()
    except CheckpointError as error:
        assert "test_source.py" in str(error)
    else:
        raise AssertionError("the recomputation differs: expected a CheckpointError")
