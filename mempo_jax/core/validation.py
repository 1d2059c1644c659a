"""One-line checks of config fields, for the ``__post_init__`` of the config dataclasses.

Every config dataclass (``ExperimentConfig`` and the ones nested in it) checks its own fields
when it is built, so a bad value (``RLConfig.steps = -1``, ``RLConfig.group_size = 0``) fails
while the config is parsed, with one line naming the field, before any work starts
(``python -m mempo_jax.commands.train`` exits 2).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Container, Optional

_KIND_NAMES = {int: "an int", float: "a number", bool: "a bool", str: "a string", tuple: "a tuple"}


def check(obj: Any, name: str, kind: type, lo: Optional[float] = None, hi: Optional[float] = None, *,
          gt: Optional[float] = None, lt: Optional[float] = None, choices: Optional[Container] = None) -> None:
    """Check that the field ``name`` of the dataclass ``obj`` has type ``kind`` and lies in range.

    Args:
      obj: the dataclass instance (its class name prefixes the message: ``RLConfig.steps``).
      name: the field name.
      kind: ``int`` (an integral number, not a bool), ``float`` (any finite real number, not a
        bool), ``bool``, ``str`` or ``tuple`` (a tuple or list).
      lo, hi: inclusive bounds (``None``: unbounded).
      gt, lt: exclusive bounds.
      choices: the allowed values.

    Raises:
      ValueError: one line, e.g. ``RLConfig.group_size must be >= 1, got 0``.
    """
    value = getattr(obj, name)
    where = f"{type(obj).__name__}.{name}"
    if kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    elif kind is tuple:
        ok = isinstance(value, (tuple, list))
    else:
        ok = isinstance(value, kind)
    if not ok:
        finite = " (finite)" if kind is float else ""
        raise ValueError(f"{where} must be {_KIND_NAMES.get(kind, kind.__name__)}{finite}, got {value!r}")
    if choices is not None and value not in choices:
        raise ValueError(f"{where} must be one of {tuple(choices)!r}, got {value!r}")
    for bound, bad, op in ((lo, lambda b: value < b, ">="), (hi, lambda b: value > b, "<="),
                           (gt, lambda b: value <= b, ">"), (lt, lambda b: value >= b, "<")):
        if bound is not None and bad(bound):
            raise ValueError(f"{where} must be {op} {bound}, got {value!r}")


def require(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` (a check across fields; the message
    names them)."""
    if not condition:
        raise ValueError(message)
