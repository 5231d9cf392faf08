"""Integrations of remat with other libraries, each loaded only when imported.

* :mod:`remat.integrations.huggingface`: gradient checkpointing of
  ``transformers`` models through remat (``pip install remat[hf]``).

Importing this package imports no third-party library.

Example:
    >>> import remat.integrations
"""

__all__: list[str] = []
