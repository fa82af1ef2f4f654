"""Tasks: where prompts come from, and how a benchmark scores outputs. Registry: TASKS (name -> factory(cfg)).

A task provides `sample(n, rng) -> list[example]` (an example is a dict with at least "prompt"),
`eval_examples() -> list[example]`, and `evaluate(model) -> dict` (the benchmark metric).
"""

from __future__ import annotations

import os
import random
from typing import Protocol

from mmrl.registry import Registry

TASKS = Registry("task")


class Task(Protocol):
    def sample(self, n: int, rng: random.Random) -> list[dict]: ...
    def eval_examples(self) -> list[dict]: ...


class ShapesTask:
    """The embedded shapes world (tasks/shapes.py): trains on one split of texts, evaluates on another."""

    def __init__(self, cfg):
        from tasks import shapes

        self.train = shapes.prompts(cfg.split)
        self.eval = shapes.balanced_prompts(cfg.eval_split, cfg.eval_prompts, seed=1234)

    def sample(self, n, rng):
        return [{"prompt": p.text, "category": p.spec.category}
                for p in (self.train[rng.randrange(len(self.train))] for _ in range(n))]

    def eval_examples(self):
        return [{"prompt": p.text, "category": p.spec.category} for p in self.eval]


class PromptFileTask:
    """Prompts from a UTF-8 text file, one per line (blank lines and lines starting with '#' ignored)."""

    def __init__(self, cfg):
        path = cfg.prompt_file
        if not path or not os.path.isfile(path):
            raise FileNotFoundError(f"task.prompt_file={path!r} does not exist; give a text file with one prompt "
                                    f"per line")
        with open(path, encoding="utf-8") as f:
            lines = [ln.strip() for ln in f]
        self.prompts = [ln for ln in lines if ln and not ln.startswith("#")]
        if not self.prompts:
            raise ValueError(f"task.prompt_file={path!r} has no prompts (one prompt per line; '#' lines are comments)")

    def sample(self, n, rng):
        return [{"prompt": self.prompts[rng.randrange(len(self.prompts))]} for _ in range(n)]

    def eval_examples(self):
        return [{"prompt": p} for p in self.prompts]


TASKS.register("shapes")(ShapesTask)
TASKS.register("prompt_file")(PromptFileTask)
