"""GenEval's prompts as a task (task.name=geneval): the 553 rows of its evaluation_metadata.jsonl (shipped in
tasks/assets/geneval/, MIT, see the README there), judged by rewards/geneval.py (reward.name=geneval).

Each example is the metadata row itself plus "category" = its tag: {"prompt", "tag", "include", "exclude"?,
"category"}, so the reward reads the clauses from the example and mmrl's per-category means are the per-tag
accuracies (GenEval's score is their mean over tags: rewards.geneval.geneval_score).
"""

from __future__ import annotations

import json
import logging
import os

from mmrl.errors import ConfigError, MissingFile
from mmrl.task import jsonl_rows, split_heldout
from rewards.geneval import check_metadata

log = logging.getLogger(__name__)

METADATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "geneval", "evaluation_metadata.jsonl")


def read_metadata(path: str) -> list[dict]:
    """GenEval metadata rows from a .jsonl file; a malformed line fails naming file:line and the field."""
    if not os.path.isfile(path):
        raise MissingFile(f"task.kwargs.metadata={path!r} does not exist; give a GenEval "
                          f"evaluation_metadata.jsonl (default: {METADATA})")
    with open(path, encoding="utf-8") as f:
        rows = [check_metadata(row, where) for where, row in jsonl_rows(path, f.read(), "one GenEval metadata "
                                                                         "object per line")]
    if not rows:
        raise ConfigError(f"{path} has no metadata rows")
    return rows


class GenEvalTask:
    """kwargs:
      metadata: a GenEval metadata .jsonl (default: the shipped 553 prompts).
      tags: keep only these tags (default: all in the file); an unknown tag fails naming the file's tags.
      heldout_fraction, split_seed: hold out this fraction of each tag's distinct prompts (mmrl.task.split_heldout
        per tag, so every tag keeps its share), the same split on every machine. Without it the benchmark is the
        whole file, as published GenEval numbers are, and training samples the same prompts (a warning says so).
    sample(n, rng) draws training rows uniformly; eval_examples() returns the held-out rows in file order.
    """

    def __init__(self, cfg=None, metadata: str | None = None, heldout_fraction: float | None = None,
                 split_seed: int = 0, tags: list[str] | None = None):
        if getattr(cfg, "prompt_file", None):
            raise ConfigError("task.name=geneval reads GenEval metadata from task.kwargs.metadata, not "
                              "task.prompt_file; move the path there (or unset task.prompt_file for the shipped 553 "
                              "prompts)")
        rows = read_metadata(metadata or METADATA)
        present = list(dict.fromkeys(r["tag"] for r in rows))
        if tags is not None:
            unknown = sorted(set(tags) - set(present))
            if unknown:
                raise ConfigError(f"task.kwargs.tags has {unknown}, not in {metadata or METADATA}; its tags are "
                                  f"{present}")
            rows = [r for r in rows if r["tag"] in tags]
        examples = [{**r, "category": r["tag"]} for r in rows]
        if heldout_fraction is None:
            log.warning("task.name=geneval without task.kwargs.heldout_fraction: training samples the benchmark's own "
                        "prompts, so evaluation is not held out (set heldout_fraction=0.5 for a per-tag split)")
            self.train = self.heldout = examples
            return
        held = set()
        for tag in dict.fromkeys(e["category"] for e in examples):
            _, h = split_heldout([e for e in examples if e["category"] == tag], heldout_fraction, split_seed)
            held |= {e["prompt"] for e in h}
        self.train = [e for e in examples if e["prompt"] not in held]
        self.heldout = [e for e in examples if e["prompt"] in held]

    def sample(self, n, rng):
        return [_copy(self.train[rng.randrange(len(self.train))]) for _ in range(n)]

    def eval_examples(self):
        return [_copy(e) for e in self.heldout]


def _copy(example: dict) -> dict:
    """A copy deep enough that a caller editing an example's clauses cannot change the task's rows."""
    return json.loads(json.dumps(example))
