"""One small registry per axis of variation. A config names a key; an unknown key errors with the valid ones."""

from __future__ import annotations

import difflib
from typing import Callable


class Registry(dict):
    def __init__(self, axis: str):
        super().__init__()
        self.axis = axis

    def register(self, name: str) -> Callable:
        def deco(fn):
            if name in self:
                raise ValueError(f"{self.axis} {name!r} is registered twice")
            self[name] = fn
            return fn

        return deco

    def __missing__(self, name):
        close = difflib.get_close_matches(str(name), list(self), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown {self.axis} {name!r}; valid: {sorted(self)}.{hint}")

    def check(self, name: str, where: str) -> None:
        """Raise ValueError naming the config key `where` and the valid choices if `name` is unknown."""
        if name not in self:
            close = difflib.get_close_matches(str(name), list(self), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where}: unknown {self.axis} {name!r}; valid: {sorted(self)}.{hint}")
