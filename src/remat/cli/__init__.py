"""The ``remat`` command-line application: one package on top of the library.

Layer: the top. The library below never imports it; it imports the library.
Its surface is :func:`main`, what ``remat`` and ``python -m remat`` run; the
models it shares with the tests and benchmarks live below it
(:mod:`remat.models`, :mod:`remat.launch`).

Modules, top to bottom (an import-linter contract in ``pyproject.toml``):

* :mod:`~remat.cli.main`: the parser and the dispatch;
* :mod:`~remat.cli.demo`, :mod:`~remat.cli.report`, :mod:`~remat.cli.estimate`,
  :mod:`~remat.cli.plan`: one module per subcommand;
* :mod:`~remat.cli.pipelined`: a model cut into pipeline stages, for ``--pipeline``;
* :mod:`~remat.cli.strategies`: the strategies a command puts on a model's blocks;
* :mod:`~remat.cli.arguments`: the arguments several commands share, defined once;
* :mod:`~remat.cli.loader`: the model loader (``--model``, ``--hf-config``);
* :mod:`~remat.cli.console`: exit codes, one-line errors, progress.

Example:
    >>> from remat.cli import main
    >>> main(["report", "--model", "mlp", "--limit", "1"])  # doctest: +SKIP
    0
"""

from remat.cli.main import main

__all__ = ["main"]
