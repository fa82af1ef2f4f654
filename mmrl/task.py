"""Tasks: where prompts come from and which examples the held-out benchmark scores.

A task provides `sample(n, rng) -> list[example]` (an example is a dict with at least "prompt"; "category"
groups the logged rewards and the benchmark) and `eval_examples() -> list[example]`. Optional:
`reference_output(example) -> str` (the ground-truth completion that off-policy injection trains on) and
`baselines() -> {name: metrics}` (printed beside the models by `mmrl eval`).

Registry: TASKS maps task.name to a factory `(cfg.task, **cfg.task.kwargs) -> Task`. Built-in tasks live in
tasks/ and are imported on first use; `task.name: my_tasks:MyTask` uses a class from the user's own file.
"""

from __future__ import annotations

import os
import random
from typing import Protocol, runtime_checkable

from mmrl.registry import Registry

TASKS = Registry("task", {
    "shapes": "tasks.shapes:ShapesTask",
    "motion": "tasks.motion:MotionTask",
    "grounding": "tasks.grounding:GroundingTask",
    "grounding_world": "tasks.grounding:GroundingWorldTask",
    "arithmetic": "tasks.arithmetic:ArithmeticTask",
    "prompt_file": "mmrl.task:PromptFileTask",
})


@runtime_checkable
class Task(Protocol):
    def sample(self, n: int, rng: random.Random) -> list[dict]: ...
    def eval_examples(self) -> list[dict]: ...


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
