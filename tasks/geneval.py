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

log = logging.getLogger(__name__)

METADATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "geneval", "evaluation_metadata.jsonl")
# GenEval's vocabulary: the tags of its prompts, the colours and relations its clauses may ask
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")

EXAMPLE_ROW = json.dumps({"tag": "counting", "include": [{"class": "dog", "count": 2}],
                          "exclude": [{"class": "dog", "count": 3}], "prompt": "a photo of two dogs"})


def check_metadata(row, where: str) -> dict:
    """The row if it is GenEval metadata, else ConfigError naming `where` (file:line, example i) and the field."""
    def fail(msg):
        raise ConfigError(f"{where}: {msg}; expected GenEval metadata like {EXAMPLE_ROW}")

    def count_ok(c):
        return isinstance(c, int) and not isinstance(c, bool) and c >= 1

    if not isinstance(row, dict):
        fail(f"not a JSON object ({type(row).__name__})")
    for key in ("tag", "prompt"):
        if not isinstance(row.get(key), str) or not row[key].strip():
            fail(f"missing field {key!r} (a non-empty string)")
    include = row.get("include")
    if not isinstance(include, list) or not include:
        fail("missing field 'include' (a non-empty list of clauses)")
    for i, c in enumerate(include):
        if not isinstance(c, dict) or not isinstance(c.get("class"), str) or not c["class"]:
            fail(f"include[{i}] has no 'class' string")
        if not count_ok(c.get("count")):
            fail(f"include[{i}] needs 'count', an integer >= 1, got {c.get('count')!r}")
        unknown = set(c) - {"class", "count", "color", "position"}
        if unknown:
            fail(f"include[{i}] has unknown keys {sorted(unknown)} (allowed: class, count, color, position)")
        if "color" in c and c["color"] not in COLORS:
            fail(f"include[{i}] color {c['color']!r} is not one of GenEval's colours {list(COLORS)}")
        if "position" in c:
            p = c["position"]
            if not (isinstance(p, (list, tuple)) and len(p) == 2 and p[0] in RELATIONS and isinstance(p[1], int)
                    and 0 <= p[1] < i):
                fail(f"include[{i}] position must be [relation, index of an earlier clause] with a relation in "
                     f"{list(RELATIONS)}, got {p!r}")
    exclude = row.get("exclude", [])
    if not isinstance(exclude, list):
        fail("'exclude' must be a list of clauses")
    for i, c in enumerate(exclude):
        if not isinstance(c, dict) or not isinstance(c.get("class"), str) or not count_ok(c.get("count")):
            fail(f"exclude[{i}] needs 'class' (a string) and 'count' (an integer >= 1)")
    return row


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

    reads_prompt_file = True  # only to say where a GenEval path belongs (task.kwargs.metadata)

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
