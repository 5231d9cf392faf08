"""The arguments several ``remat`` commands share, each defined once.

Layer: ``remat.cli`` (the application), above the model loader.

* :func:`add_model_arguments`: the model (``--model`` or ``--hf-config``) and
  what is done to it (``--freeze``, ``--lora``); :func:`model_request` turns
  them into the loader's :class:`~remat.cli.loader.ModelRequest`.
* :func:`add_sharding_arguments`: sharded training (``--world-size``,
  ``--fsdp``, ``--tp``, ``--mixed-precision``, ``--no-reshard``);
  :func:`sharding_from` turns them into a :class:`remat.memory.Sharding`.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_model_arguments(parser)
    >>> model_request(parser.parse_args(["--model", "mlp"]), "remat report").model
    'mlp'
"""

from __future__ import annotations

import argparse
from typing import Any

from remat.cli.loader import BUILTIN_MODELS, FACTORY_CONTRACT, ModelRequest
from remat.errors import CheckpointUsageError
from remat.memory import Sharding

__all__ = ["add_model_arguments", "add_sharding_arguments", "model_request", "sharding_from"]

_MODEL_HELP = (
    f"{' | '.join(BUILTIN_MODELS)} (built-in; default gpt) or package.module:FACTORY, where "
    f"{FACTORY_CONTRACT}"
)
_HF_CONFIG_HELP = (
    "a HuggingFace config.json (or a directory holding one): the causal LM it describes, with "
    "random weights and use_cache=False; nothing is downloaded (pip install remat[hf])"
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model NAME|package.module:FACTORY`` or ``--hf-config PATH``; ``--freeze``, ``--lora``."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="NAME|MODULE:FACTORY", default=None, help=_MODEL_HELP)
    source.add_argument("--hf-config", metavar="PATH", default=None, help=_HF_CONFIG_HELP)
    parser.add_argument("--freeze", action="append", default=[], metavar="GLOB",
                        help="freeze the parameters whose names match (repeatable): no gradient, "
                        "no optimizer state")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="add LoRA adapters of this rank to every linear layer but the output "
                        "and freeze the rest (pip install remat[lora])")


def model_request(args: argparse.Namespace, command: str, **fields: Any) -> ModelRequest:
    """The loader's request from :func:`add_model_arguments`' values, ``--batch`` and ``--seq``.

    ``fields`` sets the rest (``gpt=``, ``device=``, ``dtype=``, ...).
    """
    values: dict[str, Any] = {
        "command": command,
        "model": args.model,
        "hf_config": args.hf_config,
        "freeze": tuple(args.freeze),
        "lora_rank": args.lora,
    }
    for name in ("batch", "seq"):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    return ModelRequest(**(values | fields))


def add_sharding_arguments(parser: argparse.ArgumentParser, description: str) -> argparse._ArgumentGroup:
    """The sharded-training options, in their own group; returns it (a command may add more)."""
    group = parser.add_argument_group("sharded training", description)
    group.add_argument("--world-size", type=int, default=1, metavar="N",
                       help="number of ranks (default: %(default)s)")
    group.add_argument("--fsdp", action="store_true",
                       help="FSDP2: fully_shard every block, then the model, over N/K ranks")
    group.add_argument("--tp", type=int, default=1, metavar="K",
                       help="tensor-parallel degree: the model's plan (a transformers config's "
                       "base_model_tp_plan; the embedded GPT's MLP) over K ranks (default: 1)")
    group.add_argument("--mixed-precision", choices=("bf16", "fp16"), default=None,
                       help="FSDP2 MixedPrecisionPolicy: compute in this dtype, reduce in float32")
    group.add_argument("--no-reshard", action="store_true",
                       help="FSDP2 reshard_after_forward=False: keep gathered parameters until "
                       "backward")
    return group


def sharding_from(args: argparse.Namespace, command: str) -> Sharding | None:
    """The sharding the flags ask for; None for a single process."""
    if args.world_size == 1 and not args.fsdp and args.tp == 1:
        if args.mixed_precision is not None or args.no_reshard:
            raise CheckpointUsageError(
                f"{command}: --mixed-precision and --no-reshard set FSDP2's options; add --fsdp "
                "(and --world-size N)."
            )
        return None
    return Sharding(
        world_size=args.world_size,
        fsdp=args.fsdp,
        tp=args.tp,
        mixed_precision=args.mixed_precision,
        reshard_after_forward=not args.no_reshard,
    )
