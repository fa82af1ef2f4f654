"""Dataset readers on small fixture files written in exactly the distributed formats; file:line errors."""

import json

import pytest

from tasks.grounding_data import (DatasetError, SKIPPED, find_video, load_dataset, read_activitynet_captions,
                                  read_charades_sta, read_qvhighlights)

CHARADES_CSV = ("id,subject,scene,quality,relevance,verified,script,objects,descriptions,actions,length\n"
                "AO8RW,HR43,Kitchen,6,7,Yes,\"A person puts a book.\",book,\"x\",c001 0.0 6.9,33.67\n"
                "Y6R7T,HR43,Bedroom,6,7,Yes,\"\",,\"\",,30.25\n")


def test_charades_sta(tmp_path):
    (tmp_path / "c.csv").write_text(CHARADES_CSV)
    (tmp_path / "sta.txt").write_text("AO8RW 0.0 6.9##a person is putting a book on a shelf.\n"
                                      "Y6R7T 11.2 35.0##person opens the door.\n")
    rows = read_charades_sta(str(tmp_path / "sta.txt"), str(tmp_path / "c.csv"))
    assert rows[0] == {"qid": "AO8RW#1", "vid": "AO8RW", "query": "a person is putting a book on a shelf.",
                       "duration": 33.67, "windows": [[0.0, 6.9]]}
    assert rows[1]["windows"] == [[11.2, 30.25]]  # end clamped to the duration


def test_charades_malformed_line_names_file_and_line(tmp_path):
    (tmp_path / "c.csv").write_text(CHARADES_CSV)
    bad = tmp_path / "sta.txt"
    bad.write_text("AO8RW 0.0 6.9##ok.\nAO8RW 0.0##missing end\nAO8RW 5 2##backwards\nNOPE 1 2##unknown video\n")
    with pytest.raises(DatasetError, match=r"sta.txt:2: expected 'VIDEOID START END##sentence'"):
        read_charades_sta(str(bad), str(tmp_path / "c.csv"))
    rows = read_charades_sta(str(bad), str(tmp_path / "c.csv"), on_error="skip")
    assert len(rows) == 1 and SKIPPED[str(bad)] == 3
    (tmp_path / "bad.csv").write_text("id,len\nAO8RW,3\n")
    with pytest.raises(DatasetError, match="missing column"):
        read_charades_sta(str(bad), str(tmp_path / "bad.csv"))


def test_activitynet_captions(tmp_path):
    p = tmp_path / "val_1.json"
    p.write_text(json.dumps({"v_QOlSCBRmfWY": {"duration": 82.73, "timestamps": [[0.83, 19.86], [17.37, 60.81]],
                                               "sentences": ["  A young woman is seen standing.", " She dances."]},
                             "v_bad": {"duration": 10, "timestamps": [[1, 2]], "sentences": []}}))
    with pytest.raises(DatasetError, match="v_bad"):
        read_activitynet_captions(str(p))
    rows = read_activitynet_captions(str(p), on_error="skip")
    assert [r["query"] for r in rows] == ["A young woman is seen standing.", "She dances."]
    assert rows[1]["windows"] == [[17.37, 60.81]] and rows[1]["duration"] == 82.73
    p.write_text('{"v_a": {"duration": 1,\n "timestamps": [}')
    with pytest.raises(DatasetError, match=r"val_1.json:2:\d+: not valid JSON"):
        read_activitynet_captions(str(p))


def test_qvhighlights(tmp_path):
    p = tmp_path / "highlight_val_release.jsonl"
    lines = [{"qid": 2579, "query": "A girl and her mother cooked while talking.", "duration": 150,
              "vid": "j7rJstUseKg_360.0_510.0", "relevant_clip_ids": [0, 1], "saliency_scores": [[4, 3, 3]] * 2,
              "relevant_windows": [[0, 4], [20, 24]]},
             {"qid": 7, "query": "test split, no labels", "duration": 150, "vid": "x_0_150"}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"jsonl:3: not valid JSON"):
        read_qvhighlights(str(p))
    rows = read_qvhighlights(str(p), on_error="skip")
    assert rows[0]["windows"] == [[0.0, 4.0], [20.0, 24.0]] and rows[1]["windows"] is None


def test_load_dataset_finds_videos_and_reports_missing(tmp_path):
    (tmp_path / "c.csv").write_text(CHARADES_CSV)
    (tmp_path / "sta.txt").write_text("AO8RW 0.0 6.9##a.\nY6R7T 1 2##b.\n")
    vids = tmp_path / "videos"
    vids.mkdir()
    (vids / "AO8RW.mp4").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="Y6R7T.*missing_video=skip"):
        load_dataset("charades_sta", str(tmp_path / "sta.txt"), str(vids), str(tmp_path / "c.csv"))
    rows = load_dataset("charades_sta", str(tmp_path / "sta.txt"), str(vids), str(tmp_path / "c.csv"),
                        missing_video="skip")
    assert [r["vid"] for r in rows] == ["AO8RW"] and rows[0]["video"].endswith("AO8RW.mp4")
    (vids / "QOlSCBRmfWY.mkv").write_bytes(b"x")
    assert find_video(str(vids), "v_QOlSCBRmfWY").endswith("QOlSCBRmfWY.mkv")  # ActivityNet's v_ prefix
    with pytest.raises(ValueError, match="valid:"):
        load_dataset("kinetics", "a", "b")


def test_world_is_read_as_built_and_never_overwritten_with_other_counts(tmp_path):
    from mmrl.config import TaskConfig
    from tasks.grounding import GroundingWorldTask
    from tasks.grounding_world import build_world

    root = str(tmp_path / "world")
    built = build_world(root, {"train": 2, "test": 1})
    task = GroundingWorldTask(TaskConfig(eval_prompts=10), root=root)  # no counts: the world as it is
    with open(built["train"]["annotations"]) as f:
        assert len(task.train) == sum(1 for line in f if line.strip())
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "world" / "videos").iterdir()}
    with pytest.raises(ValueError, match="train_videos"):  # another run may be reading it: refuse, name the fix
        GroundingWorldTask(TaskConfig(eval_prompts=10), root=root, train_videos=600)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "world" / "videos").iterdir()} == mtimes
    assert not [p for p in (tmp_path / "world").rglob("*.tmp*")]


def test_bounded_cache_evicts_by_bytes_and_count():
    import torch

    from mmrl.cache import BoundedCache

    c = BoundedCache(capacity=10, max_bytes=3 * 400)
    for i in range(5):
        c.get(i, lambda: torch.zeros(100))  # 400 bytes each
    assert len(c) == 3 and c.bytes == 1200 and c.misses == 5
    c.get(4, lambda: 1 / 0)  # cached: not rebuilt
    assert c.hits == 1
    c.get("big", lambda: torch.zeros(1000))  # larger than the budget alone: kept, everything older evicted
    assert len(c) == 1 and c.bytes == 4000
    small = BoundedCache(capacity=2, max_bytes=1e9)
    for i in range(3):
        small.get(i, lambda: (torch.zeros(1), {"fps": 2}))
    assert len(small) == 2


# ------------------------------------------------------------------ the out-of-distribution world (issue: OOD)
def test_ood_video_specs_by_split():
    import random

    from tasks.grounding_world import DURATION, NOVEL, OOD_SPLITS, make_video_spec

    rng = random.Random(0)
    for _ in range(300):
        base = make_video_spec(rng, exclude=NOVEL)
        assert not any((o["shape"], o["color"]) in NOVEL for o in base)
        assert all(o["end"] <= DURATION for o in base) and 2 <= sum(o["target"] for o in base) <= 3
        assert 1 <= sum(not o["target"] for o in base) <= 2
        long = make_video_spec(rng, exclude=NOVEL, **OOD_SPLITS["long"])
        assert all(o["end"] <= 2 * DURATION for o in long)
        novel = make_video_spec(rng, **OOD_SPLITS["novel"])
        assert all(((o["shape"], o["color"]) in NOVEL) == o["target"] for o in novel)
        crowded = make_video_spec(rng, exclude=NOVEL, **OOD_SPLITS["crowded"])
        assert [o["target"] for o in crowded] == [True, False, False, False]
        t = next(o for o in crowded if o["target"])
        assert all(o["shape"] == t["shape"] or o["color"] == t["color"] for o in crowded)
    # some long-split windows lie beyond any training video's end
    assert any(o["end"] > DURATION for _ in range(50) for o in make_video_spec(rng, exclude=NOVEL, **OOD_SPLITS["long"]))


def test_ood_world_splits_never_meet_training(tmp_path):
    from mmrl.config import TaskConfig
    from tasks.grounding import GroundingWorldTask
    from tasks.grounding_world import NOVEL

    task = GroundingWorldTask(TaskConfig(eval_prompts=10_000), root=str(tmp_path / "gw"), train_videos=40,
                              test_videos=10, ood=True)
    named = lambda ex: next((c for c in NOVEL if f"{c[1]} {c[0]}" in ex["query"]), None)  # noqa: E731
    by = {c: [e for e in task.eval if e["category"] == c] for c in ("id", "long", "novel", "crowded")}
    assert all(len(by[c]) >= 500 for c in ("long", "novel", "crowded"))  # the default OOD counts
    assert not any(named(e) for e in task.train + by["id"] + by["long"] + by["crowded"])
    assert all(named(e) for e in by["novel"])
    assert {e["duration"] for e in task.train + by["id"] + by["novel"] + by["crowded"]} == {8.0}
    assert {e["duration"] for e in by["long"]} == {16.0} and max(w[1] for e in by["long"] for w in e["windows"]) > 8
    train_videos = {e["video"] for e in task.train}
    assert all(not train_videos & {e["video"] for e in rows} for rows in by.values())
    base = task.baselines()["constant answer"]
    assert set(base["per_category"]) == set(by) and base["n"] == len(task.eval)
