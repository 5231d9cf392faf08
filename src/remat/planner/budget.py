"""Memory budgets: bytes, or a fraction of the unchecked step's peak, validated once.

Layer: the bottom of the planner, beside :mod:`~remat.planner.data` (plain
values, no torch). A fraction is asked for explicitly (``"50%"``,
``fraction=0.5``); a bare float is refused, since ``1`` is one byte and
``1.0`` would have meant the whole unchecked peak (``docs/design/planner.md``,
"What is planned").

Example:
    >>> Budget.parse("300MiB").resolve(None), Budget.parse("50%").resolve(1000)
    (314572800, 500)
    >>> Budget.fraction(0.25).resolve(1000), Budget.of_bytes(4096).resolve(1000)
    (250, 4096)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from remat._units import format_bytes
from remat.errors import CheckpointTypeError, CheckpointUsageError, InfeasibleBudgetError

__all__ = ["Budget", "unreachable_budget"]

_API = "remat.planner: budget"

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass(frozen=True)
class Budget:
    """A memory budget for one training step: ``nbytes``, or ``ratio`` of a reference peak.

    Exactly one of the two is set. Build it with :meth:`of_bytes`,
    :meth:`fraction` or :meth:`parse`; :meth:`resolve` gives bytes, a
    fraction of the reference peak (the unchecked step's, for the planner).

    Attributes:
        nbytes: the budget in bytes (positive).
        ratio: the budget as a fraction in ``(0, 1]`` of the reference peak.
    """

    nbytes: int | None = None
    ratio: float | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is None) == (self.ratio is None):
            raise CheckpointUsageError(
                f"{_API}: a Budget is bytes or a fraction of the unchecked peak; give exactly one "
                f"of nbytes= and ratio=, got nbytes={self.nbytes!r}, ratio={self.ratio!r}."
            )
        if self.nbytes is not None:
            if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int):
                raise CheckpointTypeError(
                    f"{_API}: nbytes must be an int, got {type(self.nbytes).__name__}."
                )
            if self.nbytes <= 0:
                raise CheckpointUsageError(f"{_API} must be positive, got {self.nbytes} bytes.")
        elif self.ratio is not None:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
                raise CheckpointTypeError(
                    "remat.planner: fraction must be a number in (0, 1], got "
                    f"{type(self.ratio).__name__}."
                )
            _check_ratio(float(self.ratio), f"fraction={self.ratio}")
            object.__setattr__(self, "ratio", float(self.ratio))

    @classmethod
    def of_bytes(cls, nbytes: int) -> Budget:
        """A budget of ``nbytes`` bytes."""
        return cls(nbytes=nbytes)

    @classmethod
    def fraction(cls, value: float) -> Budget:
        """A budget of ``value`` (in ``(0, 1]``) times the reference peak."""
        return cls(ratio=value)

    @classmethod
    def parse(cls, budget: object, *, fraction: float | None = None) -> Budget:
        """What ``plan(budget=..., fraction=...)`` accepts, as a Budget.

        ``budget`` is a Budget, an int (bytes), a string with a unit
        (``"300MiB"``, ``"6GiB"``, ``"1.5GB"``; no unit means bytes) or a
        percentage (``"50%"``); ``fraction`` asks for a fraction instead. A
        float is refused: ``1`` is one byte, and ``1.0`` would have meant the
        whole unchecked peak. Anything else raises ``CheckpointUsageError`` or
        ``CheckpointTypeError``.

        Example:
            >>> Budget.parse("1.5 GB"), Budget.parse(None, fraction=0.5)
            (Budget(nbytes=1500000000, ratio=None), Budget(nbytes=None, ratio=0.5))
        """
        if fraction is not None:
            if budget is not None:
                raise CheckpointUsageError(f"{_API}: pass budget= or fraction=, not both.")
            return cls.fraction(fraction)
        if isinstance(budget, Budget):
            return budget
        if budget is None:
            raise CheckpointUsageError(
                f"{_API} is missing: give bytes (an int or '300MiB'), a percentage ('50%') or "
                "fraction=0.5."
            )
        if isinstance(budget, bool):
            raise CheckpointTypeError(f"{_API} must be bytes (int or '300MiB') or '50%', got a bool.")
        if isinstance(budget, int):
            return cls.of_bytes(budget)
        if isinstance(budget, float):
            hint = f"'{budget * 100:g}%' or fraction={budget}" if 0 < budget <= 1 else "'50%'"
            raise CheckpointTypeError(
                f"{_API}: a float is ambiguous ({budget!r}: bytes or a fraction?). Give bytes as an "
                f"int or a string with a unit ('300MiB'), or a fraction of the unchecked peak as "
                f"{hint}."
            )
        if isinstance(budget, str):
            return cls._parse_text(budget)
        raise CheckpointTypeError(
            f"{_API} must be an int (bytes), a string such as '300MiB' or '50%', got "
            f"{type(budget).__name__}."
        )

    @classmethod
    def _parse_text(cls, budget: str) -> Budget:
        text = budget.strip().lower().replace(" ", "")
        if text.endswith("%"):
            try:
                percent = float(text[:-1])
            except ValueError:
                percent = math.nan
            _check_ratio(percent / 100, repr(budget))
            return cls(ratio=percent / 100)
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):] or "b"
        try:
            value = float(digits)
        except ValueError:
            value = math.nan
        if not text[len(digits):] and math.isfinite(value) and value != int(value):
            raise CheckpointUsageError(
                f"{_API}: {budget!r} has no unit and is not a whole number of bytes. Write a "
                f"fraction of the unchecked peak as a percentage ('{value * 100:g}%'), or bytes "
                "with a unit ('300MiB')."
            )
        if unit not in _UNITS or not math.isfinite(value) or value <= 0:
            raise CheckpointUsageError(
                f"{_API}: cannot read {budget!r}; write a positive number with a unit among "
                f"{sorted(_UNITS, key=_UNITS.__getitem__)} (e.g. '300MiB', '6GiB'), or a "
                "percentage of the unchecked peak ('50%')."
            )
        return cls(nbytes=max(1, int(value * _UNITS[unit])))

    def resolve(self, reference_bytes: int | None) -> int:
        """The budget in bytes; a fraction is taken of ``reference_bytes`` (at least one byte)."""
        if self.nbytes is not None:
            return self.nbytes
        assert self.ratio is not None  # __post_init__: exactly one is set
        if reference_bytes is None:
            raise CheckpointUsageError(f"{_API}: a fraction needs the unchecked peak to refer to.")
        return max(1, int(self.ratio * reference_bytes))


def _check_ratio(value: float, given: str) -> None:
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise CheckpointUsageError(
            f"{_API}: {given} must be a fraction in (0, 1] (a percentage in (0%, 100%]) of the "
            "unchecked peak."
        )


def unreachable_budget(
    budget_bytes: int, min_peak_bytes: int, max_gradient_error: float | None = None
) -> InfeasibleBudgetError:
    """The error for ``budget_bytes`` when no plan goes below ``min_peak_bytes``
    (within ``max_gradient_error``, when compression is allowed).

    Example:
        >>> unreachable_budget(100, 130).min_peak_bytes
        130
    """
    within = (
        ""
        if max_gradient_error is None
        else f" with a gradient error of at most {max_gradient_error:.2e}"
    )
    reachable = (
        "the smallest reachable peak is"
        if max_gradient_error is None
        else "the smallest peak of options each within that error is at least"
    )
    more = "" if max_gradient_error is None else ", allow a larger max_gradient_error or another format"
    return InfeasibleBudgetError(
        f"remat.planner: no plan keeps the peak within the budget of "
        f"{format_bytes(budget_bytes)} ({budget_bytes} bytes){within}; {reachable} "
        f"{format_bytes(min_peak_bytes)} ({min_peak_bytes} bytes). Raise the budget "
        "to at least that, shrink the batch or sequence, or offer more options (offload on "
        f"an accelerator{more}).",
        budget_bytes=budget_bytes,
        min_peak_bytes=min_peak_bytes,
    )
