import os

import pytest

from mmrl.checkpoint import atomic_dir, latest, prune


def test_atomic_dir_replaces_only_on_success(tmp_path):
    target = tmp_path / "ck"
    with atomic_dir(str(target)) as tmp:
        open(os.path.join(tmp, "a.txt"), "w").write("v1")
    assert (target / "a.txt").read_text() == "v1"
    with pytest.raises(RuntimeError):
        with atomic_dir(str(target)) as tmp:
            open(os.path.join(tmp, "a.txt"), "w").write("half-written")
            raise RuntimeError("killed mid-save")
    assert (target / "a.txt").read_text() == "v1"
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp folders left behind


def test_latest_and_prune(tmp_path):
    for i in (2, 10, 7):
        (tmp_path / f"iter-{i:06d}").mkdir()
    (tmp_path / "notes").mkdir()
    assert latest(str(tmp_path)).endswith("iter-000010")
    prune(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == ["iter-000007", "iter-000010", "notes"]
    assert latest(str(tmp_path / "missing")) is None
