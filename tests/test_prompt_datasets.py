"""Prompt datasets as users have them (task.name=prompt_file): .txt / .jsonl / .csv / .tsv with metadata, a
held-out file or a seeded held-out fraction, a `datasets` name, and errors that name the file, the line and the fix."""

import json
import logging
import random
import sys
import types
from types import SimpleNamespace

import pytest

from mmrl.compose import build_task
from mmrl.config import TaskConfig
from mmrl.task import PromptFileTask

ROWS = [{"prompt": "a red car", "category": "color", "negative_prompt": "blurry"},
        {"prompt": "two dogs", "category": "counting", "negative_prompt": ""}]


def task(path, **kwargs):
    return PromptFileTask(SimpleNamespace(prompt_file=str(path)), **kwargs)


def write(tmp_path, name, text, encoding="utf-8"):
    path = tmp_path / name
    path.write_bytes(text.encode(encoding))
    return path


def jsonl(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.mark.parametrize("name, text", [
    ("p.jsonl", jsonl(ROWS) + "\n"),
    ("p.csv", 'prompt,category,negative_prompt\na red car,color,blurry\n"two dogs",counting,\n'),
    ("p.tsv", "category\tprompt\tnegative_prompt\ncolor\ta red car\tblurry\ncounting\ttwo dogs\t\n"),
])
def test_formats_keep_metadata(tmp_path, name, text):
    t = task(write(tmp_path, name, text), eval_file=write(tmp_path, "held" + name[1:], text))
    assert t.eval_examples() == ROWS
    drawn = t.sample(20, random.Random(0))
    assert len(drawn) == 20 and all(ex in ROWS for ex in drawn)
    drawn[0]["prompt"] = "mutated"  # examples are copies
    assert t.eval_examples() == ROWS


def test_txt_utf8_bom_and_prompt_column(tmp_path):
    assert task(write(tmp_path, "p.txt", "\ufeffa red car\n# comment\n\nzwei Hunde\n")).eval_examples() == [
        {"prompt": "a red car"}, {"prompt": "zwei Hunde"}]
    t = task(write(tmp_path, "p.csv", "caption,id\na cat,1\n"), prompt_column="caption")
    assert t.eval_examples() == [{"prompt": "a cat", "id": "1"}]


def test_heldout_file_trains_only_on_the_prompt_file(tmp_path, caplog):
    t = task(write(tmp_path, "train.txt", "a\nb\n"), eval_file=write(tmp_path, "eval.jsonl", jsonl(ROWS)))
    assert {ex["prompt"] for ex in t.sample(50, random.Random(0))} == {"a", "b"}
    assert t.eval_examples() == ROWS
    assert "no held-out split" not in caplog.text


def test_seeded_fraction_split(tmp_path):
    rows = [{"prompt": f"p{i}", "category": f"c{i % 3}"} for i in range(100)] + [{"prompt": "p7", "category": "dup"}]
    path = write(tmp_path, "p.jsonl", jsonl(rows))
    shuffled = write(tmp_path, "q.jsonl", jsonl(random.Random(1).sample(rows, len(rows))))
    a, b = task(path, heldout_fraction=0.2, split_seed=3), task(shuffled, heldout_fraction=0.2, split_seed=3)
    held = {e["prompt"] for e in a.eval_examples()}
    assert held == {e["prompt"] for e in b.eval_examples()}  # deterministic, whatever the row order
    assert len(held) == 20 and len(a.train) + len(a.heldout) == 101
    assert not held & {e["prompt"] for e in a.train}  # disjoint: duplicates of a held-out text are held out too
    assert not held & {e["prompt"] for e in a.sample(500, random.Random(0))}
    assert held != {e["prompt"] for e in task(path, heldout_fraction=0.2, split_seed=4).eval_examples()}


def test_no_split_warns_once_naming_both_options(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="mmrl.task"):
        t = task(write(tmp_path, "p.txt", "a\nb\n"))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "evaluation scores the training prompts" in warnings[0]
    assert "task.kwargs.eval_file" in warnings[0] and "task.kwargs.heldout_fraction" in warnings[0]
    assert t.eval_examples() == [{"prompt": "a"}, {"prompt": "b"}]


@pytest.mark.parametrize("name, text, encoding, match", [
    ("p.txt", "ok\ncaf\u00e9\n", "latin-1", r"p\.txt:2: byte 0xe9 is not UTF-8; save it as UTF-8"),
    ("p.jsonl", '{"prompt": "a"}\n{"prompt": "b",}\n', "utf-8",
     r"p\.jsonl:2: not valid JSON .*expected one JSON object per line with a \"prompt\" field"),
    ("p.jsonl", '{"prompt": "a"}\n\n{"text": "b"}\n', "utf-8",
     r"p\.jsonl:3: expected a row with a non-empty 'prompt' string, got \{'text': 'b'\}"),
    ("p.jsonl", '["a"]\n', "utf-8", r"p\.jsonl:1: expected a row with a non-empty 'prompt'"),
    ("p.csv", "text,category\na,b\n", "utf-8",
     r"p\.csv:1: no 'prompt' column; the header has \['text', 'category'\].*task\.kwargs\.prompt_column"),
    ("p.csv", "prompt,category\na,b\n,c\n", "utf-8", r"p\.csv:3: expected a row with a non-empty 'prompt'"),
    ("p.jsonl", "\n\n", "utf-8", r"has no prompts; expected one JSON object per line"),
    ("p.csv", "", "utf-8", r"has no prompts; expected a header row with a \"prompt\" column"),
    ("p.txt", "# only a comment\n", "utf-8", r"has no prompts; expected one prompt per line"),
    ("p.json", "[]", "utf-8", r"write one object per line as \.jsonl"),
])
def test_errors_name_file_line_and_fix(tmp_path, name, text, encoding, match):
    with pytest.raises(ValueError, match=match):
        task(write(tmp_path, name, text, encoding))


def test_bad_options(tmp_path):
    path = write(tmp_path, "p.txt", "a\nb\n")
    with pytest.raises(FileNotFoundError, match=r"task\.kwargs\.eval_file='nope\.txt' does not exist"):
        task(path, eval_file="nope.txt")
    with pytest.raises(ValueError, match="not both"):
        task(path, eval_file=str(path), heldout_fraction=0.1)
    with pytest.raises(ValueError, match=r"heldout_fraction must be in \(0, 1\)"):
        task(path, heldout_fraction=1.0)
    with pytest.raises(ValueError, match="at least 2 distinct prompts"):
        task(write(tmp_path, "one.txt", "a\na\n"), heldout_fraction=0.5)
    cfg = TaskConfig(name="prompt_file", prompt_file=str(path), kwargs={"heldout_fration": 0.1})
    valid = r"\['heldout_fration'\] not understood.*valid: \[.*'eval_file'.*'heldout_fraction'"
    with pytest.raises(ValueError, match=valid):
        build_task(cfg)
    cfg.kwargs = {"heldout_fraction": 0.5}
    assert len(build_task(cfg).eval_examples()) == 1


def test_datasets_library(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ImportError, match="pip install datasets"):
        PromptFileTask(SimpleNamespace(prompt_file=None), dataset="org/prompts")

    class Dataset(list):
        column_names = ["caption", "category"]

    calls = []
    fake = types.SimpleNamespace(
        load_dataset=lambda name, split: calls.append((name, split)) or Dataset([{"caption": "a cat",
                                                                                   "category": "x"}]),
        load_from_disk=lambda path: {"test": Dataset([{"caption": "a dog", "category": "y"}])})
    monkeypatch.setitem(sys.modules, "datasets", fake)
    t = PromptFileTask(SimpleNamespace(prompt_file=None), dataset="org/prompts", prompt_column="caption")
    assert calls == [("org/prompts", "train")] and t.eval_examples() == [{"prompt": "a cat", "category": "x"}]
    (tmp_path / "dataset_dict.json").write_text("{}")  # a save_to_disk folder
    t = PromptFileTask(SimpleNamespace(prompt_file=None), dataset=str(tmp_path), split="test", prompt_column="caption")
    assert t.eval_examples() == [{"prompt": "a dog", "category": "y"}]
    with pytest.raises(ValueError, match=r"has no split 'train'; it has \['test'\]"):
        PromptFileTask(SimpleNamespace(prompt_file=None), dataset=str(tmp_path), prompt_column="caption")
    with pytest.raises(ValueError, match=r"has no 'prompt' column; it has \['caption', 'category'\]"):
        PromptFileTask(SimpleNamespace(prompt_file=None), dataset="org/prompts")
    with pytest.raises(ValueError, match="not both"):
        PromptFileTask(SimpleNamespace(prompt_file="p.txt"), dataset="org/prompts")
