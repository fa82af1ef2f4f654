"""Tasks: where prompts come from and which examples the held-out benchmark scores.

A task provides `sample(n, rng) -> list[example]` (an example is a dict with at least "prompt"; "category"
groups the logged rewards and the benchmark) and `eval_examples() -> list[example]`. Optional:
`reference_output(example) -> str` (the ground-truth completion that off-policy injection trains on) and
`baselines() -> {name: metrics}` (printed beside the models by `mmrl eval`); `samples_ahead = True` when `sample` reads
nothing but its rng (the trainer then draws the next iteration's examples early, to load their videos meanwhile). `mmrl validate` (and `train`, before the
weights load) builds the task once to run its input checks; a class that writes files when built (a dataset it
renders) sets `writes_files = True` and is built by the trainer only.

Registry: TASKS maps task.name to a factory `(cfg.task, **cfg.task.kwargs) -> Task`. Built-in tasks live in
tasks/ and are imported on first use; `task.name: my_tasks:MyTask` uses a class from the user's own file.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import logging
import os
import random
from typing import Protocol, runtime_checkable

from mmrl.errors import ConfigError, MissingDependency, MissingFile
from mmrl.registry import Registry

log = logging.getLogger(__name__)

TASKS = Registry("task", {
    "shapes": "tasks.shapes:ShapesTask",
    "motion": "tasks.motion:MotionTask",
    "grounding": "tasks.grounding:GroundingTask",
    "grounding_world": "tasks.grounding:GroundingWorldTask",
    "arithmetic": "tasks.arithmetic:ArithmeticTask",
    "prompt_file": "mmrl.task:PromptFileTask",
    "geneval": "tasks.geneval:GenEvalTask",
    "preference_pairs": "tasks.preference:PreferencePairsTask",
})


@runtime_checkable
class Task(Protocol):
    def sample(self, n: int, rng: random.Random) -> list[dict]: ...
    def eval_examples(self) -> list[dict]: ...


class PromptFileTask:
    """Prompts as users have them: a file (`task.prompt_file`) or a Hugging Face dataset (`task.kwargs.dataset`).

    Formats by extension (see `read_prompts`): .txt one prompt per line; .jsonl one object per line with a
    "prompt" field; .csv / .tsv a header row with a "prompt" column. Every other field of a row stays in its
    example: "category" groups the logged rewards and the benchmark, and anything else (negative_prompt, a
    reference answer ...) is there for the reward to read.

    kwargs:
      eval_file: a held-out prompt file (any of the formats above) that eval_examples() returns.
      heldout_fraction, split_seed: hold out this fraction (0 < f < 1) of the distinct prompts, chosen with
        random.Random(split_seed): the same split on every machine and rank; training samples only the rest.
      dataset, split: a `datasets` hub name or local folder and the split to read (needs `pip install datasets`).
      prompt_column: the field / column that holds the prompt (default "prompt").
    Without eval_file or heldout_fraction, evaluation scores the training prompts (one warning says so).
    """

    reads_prompt_file = True  # task.prompt_file: the prompts (a task that does not declare it is refused it at load)

    def __init__(self, cfg, eval_file: str | None = None, heldout_fraction: float | None = None, split_seed: int = 0,
                 dataset: str | None = None, split: str = "train", prompt_column: str = "prompt"):
        prompt_file = getattr(cfg, "prompt_file", None)
        if dataset and prompt_file:
            raise ConfigError("give task.prompt_file or task.kwargs.dataset, not both")
        if eval_file is not None and heldout_fraction is not None:
            raise ConfigError("give task.kwargs.eval_file (a held-out file) or task.kwargs.heldout_fraction "
                              "(a seeded split of the prompts), not both")
        examples = (read_dataset(dataset, split, prompt_column) if dataset
                    else read_prompts(prompt_file, prompt_column, "task.prompt_file"))
        if eval_file is not None:
            self.train, self.heldout = examples, read_prompts(eval_file, prompt_column, "task.kwargs.eval_file")
        elif heldout_fraction is not None:
            self.train, self.heldout = split_heldout(examples, heldout_fraction, split_seed)
        else:
            log.warning("task.name=prompt_file has no held-out split: evaluation scores the training prompts. Set "
                        "task.kwargs.eval_file=PATH (held-out prompts) or task.kwargs.heldout_fraction=0.1 (a seeded "
                        "split, task.kwargs.split_seed)")
            self.train = self.heldout = examples

    samples_ahead = True  # sample() reads its rng alone (Task)

    def sample(self, n, rng):
        return [dict(self.train[rng.randrange(len(self.train))]) for _ in range(n)]

    def eval_examples(self):
        return [dict(e) for e in self.heldout]


FORMATS = {
    ".txt": "one prompt per line (blank lines and lines starting with '#' are skipped)",
    ".jsonl": 'one JSON object per line with a "prompt" field, e.g. {"prompt": "a red car", "category": "color"}',
    ".csv": 'a header row with a "prompt" column (other columns are kept), then one row per prompt',
    ".tsv": 'a tab-separated header row with a "prompt" column (other columns are kept), then one row per prompt',
}


def read_prompts(path: str | None, prompt_column: str = "prompt", where: str = "task.prompt_file") -> list[dict]:
    """Examples ({"prompt": ..., **other fields}) from a prompt file, read by its extension (FORMATS; any other
    extension is read as .txt). Errors name the file, the line and what was expected."""
    if not path or not os.path.isfile(path):
        raise MissingFile(f"{where}={path!r} does not exist; give a prompt file: .txt ({FORMATS['.txt']}), "
                          f".jsonl, .csv or .tsv")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        raise ConfigError(f"{path}: .json is not read; write one object per line as .jsonl ({FORMATS['.jsonl']})")
    text = _decode(path)
    if ext == ".jsonl":
        examples = _read_jsonl(path, text, prompt_column)
    elif ext in (".csv", ".tsv"):
        examples = _read_csv(path, text, prompt_column, "\t" if ext == ".tsv" else ",")
    else:
        examples = [{"prompt": s} for s in (ln.strip() for ln in text.splitlines()) if s and not s.startswith("#")]
    if not examples:
        raise ConfigError(f"{where}={path!r} has no prompts; expected {FORMATS.get(ext, FORMATS['.txt'])}")
    return [_with_image_paths(ex, os.path.dirname(os.path.abspath(path))) for ex in examples]


def _with_image_paths(example: dict, folder: str) -> dict:
    """Relative `image` / `images` paths (an edit's or an image-to-video's conditioning) resolved against the
    prompt file's folder."""
    def resolve(p):
        return os.path.join(folder, p) if isinstance(p, str) and not os.path.isabs(p) else p

    for key in ("image", "images"):
        if key in example:
            v = example[key]
            example[key] = [resolve(p) for p in v] if isinstance(v, list) else resolve(v)
    return example


def _decode(path: str) -> str:
    """The file as text; a byte that is not UTF-8 fails naming file:line and the fix. A UTF-8 BOM is dropped."""
    with open(path, "rb") as f:
        data = f.read().removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: byte {data[e.start]:#04x} is not UTF-8; save it as UTF-8 (e.g. "
                          f"`iconv -f latin1 -t utf-8 {path} > utf8_{os.path.basename(path)}`)") from None


def jsonl_rows(path: str, text: str, expected: str = FORMATS[".jsonl"]):
    """(where "path:line", object) for each non-empty line of a JSONL text; a line that is not JSON raises naming
    it and what was `expected`."""
    for i, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{i}", json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{i}: not valid JSON ({e.msg}); expected {expected}") from None


def _read_jsonl(path: str, text: str, prompt_column: str) -> list[dict]:
    return [_example(row, prompt_column, where) for where, row in jsonl_rows(path, text)]


def _read_csv(path: str, text: str, prompt_column: str, delimiter: str) -> list[dict]:
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        if reader.fieldnames and prompt_column not in reader.fieldnames:
            raise ConfigError(f"{path}:1: no {prompt_column!r} column; the header has {reader.fieldnames}. Name the "
                              f"prompt column {prompt_column!r} or set task.kwargs.prompt_column")
        return [_example({k: v for k, v in row.items() if k is not None}, prompt_column, f"{path}:{reader.line_num}")
                for row in reader]
    except csv.Error as e:
        raise ConfigError(f"{path}:{reader.line_num}: {e}") from None


def _example(row, prompt_column: str, where: str) -> dict:
    """{"prompt": row[prompt_column], **the other fields}; a row without a non-empty prompt string fails at `where`."""
    prompt = row.get(prompt_column) if isinstance(row, dict) else None
    if not isinstance(prompt, str) or not prompt.strip():
        raise ConfigError(f"{where}: expected a row with a non-empty {prompt_column!r} string, got {repr(row)[:200]}")
    return {"prompt": prompt.strip(), **{k: v for k, v in row.items() if k not in (prompt_column, "prompt")}}


def read_dataset(name: str, split: str = "train", prompt_column: str = "prompt") -> list[dict]:
    """Examples from a Hugging Face `datasets` hub name, a folder of data files, or a `save_to_disk` folder."""
    try:
        import datasets
    except ImportError:
        raise MissingDependency("task.kwargs.dataset needs the Hugging Face datasets library: pip install datasets "
                                "(or export the prompts to a .jsonl / .csv file and set task.prompt_file)") from None
    saved = any(os.path.isfile(os.path.join(name, f)) for f in ("dataset_dict.json", "state.json"))
    ds = datasets.load_from_disk(name) if saved else datasets.load_dataset(name, split=split)
    if isinstance(ds, dict):  # a saved DatasetDict
        if split not in ds:
            raise ConfigError(f"task.kwargs.dataset={name!r} has no split {split!r}; it has {sorted(ds)}")
        ds = ds[split]
    if prompt_column not in ds.column_names:
        raise ConfigError(f"task.kwargs.dataset={name!r} [{split}] has no {prompt_column!r} column; it has "
                          f"{ds.column_names}: set task.kwargs.prompt_column")
    return [_example(row, prompt_column, f"{name}[{split}] row {i}") for i, row in enumerate(ds)]


def split_heldout(examples: list[dict], fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out): `fraction` of the distinct prompt texts, drawn by random.Random(seed) from the sorted
    texts, so the split is the same on every machine and rank whatever the row order. Every row of a held-out text
    is held out: the benchmark never scores a text trained on."""
    if not 0 < fraction < 1:
        raise ConfigError(f"task.kwargs.heldout_fraction must be in (0, 1), got {fraction}")
    texts = sorted({e["prompt"] for e in examples})
    if len(texts) < 2:
        raise ConfigError(f"task.kwargs.heldout_fraction needs at least 2 distinct prompts, got {len(texts)}")
    held = set(random.Random(seed).sample(texts, min(len(texts) - 1, max(1, round(fraction * len(texts))))))
    return [e for e in examples if e["prompt"] not in held], [e for e in examples if e["prompt"] in held]
