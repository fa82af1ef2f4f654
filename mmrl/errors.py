"""mmrl's own user errors: raised where mmrl checks the user's input (a config key or value, a file or folder the
config names, a run folder, a registry name, an optional library), with a message that names the fix.

The `mmrl` command prints a `UserError` as one line and exits with status 2; every other exception is a bug (in
mmrl, a library or a user's plugin) and keeps its traceback (mmrl/cli.py). Each subclass also derives from the
builtin that mmrl raised before, so `except ValueError` / `pytest.raises(FileNotFoundError)` keep working.
Internal invariants are not user errors: they stay `assert`, `RuntimeError` or a plain `ValueError`.
"""

from __future__ import annotations


class UserError(Exception):
    """An input mmrl rejects; str(e) is the whole message a user reads, naming the fix."""


class ConfigError(UserError, ValueError):
    """A config key, value or combination, a command-line argument, or the content of a file the config names
    (a prompt file, a model folder's JSON) is wrong."""


class MissingFile(UserError, FileNotFoundError):
    """A file or folder the user named (config, model.path, checkpoint, prompt file, video) does not exist."""


class DamagedCheckpoint(UserError, RuntimeError):
    """A checkpoint whose files do not match its manifest (truncated, missing, altered), with no intact one to use."""


class TargetExists(UserError, FileExistsError):
    """An output folder the user named already holds something mmrl will not overwrite silently."""


class UnknownName(UserError, KeyError):
    """A registry name (reward, task, policy loss, model family, ...) that is neither registered nor importable
    as the user's own `package.module:Name`."""

    def __str__(self) -> str:  # KeyError quotes its message: print it as written
        return str(self.args[0]) if self.args else ""


class MissingDependency(UserError, ImportError):
    """An optional library the config asks for is not installed (`pip install ...` in the message)."""
