"""The ``remat`` command-line application: one package on top of the library.

Layer: the top. The library below never imports it; it imports the library.
Modules, top to bottom (an import-linter contract in ``pyproject.toml``):

* :mod:`~remat.cli.main`: the parser and the dispatch (``remat``, ``python -m remat``);
* :mod:`~remat.cli.demo`, :mod:`~remat.cli.report`, :mod:`~remat.cli.estimate`,
  :mod:`~remat.cli.plan`: one module per subcommand;
* :mod:`~remat.cli.strategies`: the strategies a command puts on a model's blocks;
* :mod:`~remat.cli.arguments`: the arguments several commands share, defined once;
* :mod:`~remat.cli.models`: the model loader (``--model``, ``--hf-config``);
* :mod:`~remat.cli.gpt` (the embedded demo model), :mod:`~remat.cli.console`
  (exit codes, one-line errors, progress), :mod:`~remat.cli.launch` (N local
  ranks).

Example:
    >>> from remat.cli import DemoOptions, compare_strategies, render_table
    >>> options = DemoOptions(steps=1, layers=2, batch=2, seq=32)
    >>> results = compare_strategies(options, strategies=["none", "torch", "remat"])
    >>> [r.strategy for r in results]
    ['none', 'torch', 'remat']
"""

from remat.cli.demo import (
    DEFAULT_OUT,
    STRATEGIES,
    DemoOptions,
    StrategyResult,
    add_demo_arguments,
    compare_strategies,
    options_from_args,
    render_table,
    trade_off_note,
    write_plots,
)
from remat.cli.main import load_factory, main, tiny_gpt
from remat.cli.strategies import ALL_STRATEGIES, Strategy

__all__ = [
    "ALL_STRATEGIES",
    "DEFAULT_OUT",
    "STRATEGIES",
    "DemoOptions",
    "Strategy",
    "StrategyResult",
    "add_demo_arguments",
    "compare_strategies",
    "load_factory",
    "main",
    "options_from_args",
    "render_table",
    "tiny_gpt",
    "trade_off_note",
    "write_plots",
]
