"""Functions registered by name and chosen by a config field (tunix style, one implementation).

``rewards`` registers the outcome metrics (``RLConfig.outcome_metric``) and ``losses`` the KL
estimators (``LossConfig.kl_type``) and the loss aggregation modes (``LossConfig.loss_agg_mode``)
in a ``Registry`` each; the config's validation lists ``names()``.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """A name → function table of one kind of function.

    Args:
      kind: what the functions are, in words (``"metric"``, ``"KL estimator"``): the errors name it.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator: register the function under every one of ``names``.

        Raises:
          ValueError: a name that is already registered.
        """

        def deco(fn: F) -> F:
            for name in names:
                if name in self._table:
                    raise ValueError(f"{self.kind} {name!r} is already registered")
                self._table[name] = fn
            return fn

        return deco

    def get(self, name: str) -> F:
        """The function registered under ``name``.

        Raises:
          ValueError: naming the unknown name and listing the known ones.
        """
        try:
            return self._table[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {self.names()}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._table)
