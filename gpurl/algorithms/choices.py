"""Pure functions keyed by the members of a choice enum (the pattern of verl's
`register_adv_est`): `TABLE = Choices("KL estimator", KLEstimator)`, then
`@TABLE.register(KLEstimator.K3)` on each function. A lookup of a name no function is
registered for fails with the valid names; tests check that every member has one."""

from __future__ import annotations

import enum
from typing import Callable, Generic, TypeVar

FnT = TypeVar("FnT", bound=Callable)


class Choices(Generic[FnT]):
    def __init__(self, what: str, keys: type[enum.Enum]):
        self.what, self.keys = what, keys
        self._table: dict[enum.Enum, FnT] = {}

    def register(self, key: enum.Enum) -> Callable[[FnT], FnT]:
        def add(fn: FnT) -> FnT:
            if key in self._table:
                raise ValueError(f"{self.what} {key.value!r} is registered twice")
            self._table[key] = fn
            return fn
        return add

    def __getitem__(self, key: str) -> FnT:
        try:
            return self._table[self.keys(key)]
        except (ValueError, KeyError):
            raise ValueError(f"unknown {self.what} {key!r}; use one of: "
                             f"{', '.join(k.value for k in self._table)}.") from None

    def names(self) -> tuple[str, ...]:
        return tuple(k.value for k in self._table)

    def missing(self) -> list[str]:
        """Members of the enum without a registered function (empty when complete)."""
        return [k.value for k in self.keys if k not in self._table]
