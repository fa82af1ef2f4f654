"""One small registry per axis of variation. A config names a key; an unknown key errors with the valid ones.

An entry is an object, or a lazy `"package.module:Name"` string imported on first use (built-in plugins are
registered this way, so the core never imports them). Any name containing ":" that is not registered is
resolved the same way: `reward.name: my_rewards:BrightnessReward` in YAML uses a class from the user's own
file without editing mmrl: the `mmrl` command finds it in the working directory, next to the config file, or on
PYTHONPATH (from Python: anywhere on sys.path).
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any, Callable

from mmrl.errors import ConfigError, MissingDependency, UnknownName


def import_path(path: str) -> Any:
    """`"package.module:Name"` (or `"package.module:Outer.Inner"`) -> the object."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ConfigError(f"{path!r} is not an import path; write package.module:Name")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(dict):
    def __init__(self, axis: str, entries: dict[str, Any] | None = None):
        super().__init__(entries or {})
        self.axis = axis

    def register(self, name: str) -> Callable:
        def deco(fn):
            if name in self:
                raise ValueError(f"{self.axis} {name!r} is registered twice")
            self[name] = fn
            return fn

        return deco

    def __getitem__(self, name):
        if name in self:
            entry = super().__getitem__(name)
            if isinstance(entry, str):  # lazy built-in: import once, then keep the object
                try:
                    entry = import_path(entry)
                except ModuleNotFoundError as e:  # an optional library of this entry, not mmrl's own code: a user error
                    if (e.name or "").split(".")[0] in ("mmrl", "tasks", "rewards"):
                        raise
                    raise MissingDependency(f"{self.axis} {name!r} needs the {e.name!r} package, which is not "
                                            f"installed: pip install {e.name.split('.')[0]}") from e
                self[name] = entry
            return entry
        if isinstance(name, str) and ":" in name:  # a user's own plugin
            try:
                return import_path(name)
            except (ImportError, AttributeError) as e:
                raise UnknownName(f"{self.axis} {name!r} could not be imported ({type(e).__name__}: {e}); put its "
                                  f"module's file in the working directory or next to the config file (the mmrl command "
                                  f"looks there), or on PYTHONPATH") from e
        close = difflib.get_close_matches(str(name), list(self), n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""  # first: the list of names is long
        valid = f"valid: {sorted(self)} or a package.module:Name path"
        raise UnknownName(f"unknown {self.axis} {name!r}{hint} ({valid})" if hint else
                          f"unknown {self.axis} {name!r}; {valid}")

    def get(self, name, default=None):
        try:
            return self[name]
        except KeyError:
            return default

    def check(self, name: str, where: str) -> None:
        """Raise ConfigError (a ValueError) naming the config key `where` and the valid choices if `name` cannot be
        resolved (a registered name is accepted without importing it; an import path is imported)."""
        if name in self:
            return
        try:
            self[name]
        except KeyError as e:
            raise ConfigError(f"{where}: {e.args[0]}") from None
