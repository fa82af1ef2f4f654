"""Atomic checkpoint folders."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temporary folder beside `path`; on success it replaces `path` (old version removed only after
    the new one is complete), on error it is deleted and `path` is left untouched."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".tmp-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".old-", dir=parent)
        os.replace(path, os.path.join(old, "x"))
    os.replace(tmp, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def latest(folder: str) -> str | None:
    """The checkpoint folder with the highest iteration number under `folder` (names `iter-NNNNNN`)."""
    if not os.path.isdir(folder):
        return None
    names = [d for d in os.listdir(folder) if d.startswith("iter-") and d[5:].isdigit()]
    return os.path.join(folder, max(names, key=lambda d: int(d[5:]))) if names else None


def prune(folder: str, keep: int) -> None:
    """Delete all but the `keep` newest `iter-N` checkpoints in `folder` (keep <= 0 keeps all)."""
    if keep <= 0 or not os.path.isdir(folder):
        return
    names = sorted((d for d in os.listdir(folder) if d.startswith("iter-") and d[5:].isdigit()), key=lambda d: int(d[5:]))
    for d in names[:-keep]:
        shutil.rmtree(os.path.join(folder, d), ignore_errors=True)
