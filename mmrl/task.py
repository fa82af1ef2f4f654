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
    """The embedded shapes world (tasks/shapes.py): trains on one split of texts, evaluates on another.

    kwargs: balanced (default True) draws each training prompt's category uniformly, then a text of it; the
    texts themselves are far from balanced (3/4 of them are color attribution), like the benchmark is."""

    def __init__(self, cfg, balanced: bool = True):
        from tasks import shapes

        self.train = shapes.prompts(cfg.split)
        self.by_category: dict[str, list] = {}
        for p in self.train:
            self.by_category.setdefault(p.spec.category, []).append(p)
        self.categories = sorted(self.by_category) if balanced else []
        self.eval = shapes.balanced_prompts(cfg.eval_split, cfg.eval_prompts, seed=1234)

    def _draw(self, rng):
        if self.categories:
            texts = self.by_category[self.categories[rng.randrange(len(self.categories))]]
            return texts[rng.randrange(len(texts))]
        return self.train[rng.randrange(len(self.train))]

    def sample(self, n, rng):
        return [{"prompt": p.text, "category": p.spec.category} for p in (self._draw(rng) for _ in range(n))]

    def eval_examples(self):
        return [{"prompt": p.text, "category": p.spec.category} for p in self.eval]


class MotionTask:
    """The embedded motion text-to-video world (tasks/motion.py): trains on one split of texts, evaluates on
    the other, the four directions equally represented (the example category is the direction)."""

    def __init__(self, cfg):
        from tasks import motion

        self.train = motion.prompts(cfg.split)
        self.eval = motion.balanced_prompts(cfg.eval_split, cfg.eval_prompts, seed=1234)

    def sample(self, n, rng):
        return [{"prompt": p.text, "category": p.spec.direction} for p in (rng.choice(self.train) for _ in range(n))]

    def eval_examples(self):
        return [{"prompt": p.text, "category": p.spec.direction} for p in self.eval]


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




GROUNDING_PROMPT = ('To accurately pinpoint the event "{query}" in the video, determine the precise time period of '
                    'the event. Output your thought process within the <think> </think> tags, then give the start '
                    'and end times (in seconds) within the <answer> </answer> tags, e.g. <answer>12.5 to 17.0</answer>.')


class GroundingTask:
    """Video temporal grounding on a dataset in its distributed format (tasks/grounding_data.py).

    task.kwargs: format (charades_sta | activitynet | qvhighlights), annotations, video_dir, durations
    (Charades csv), eval_annotations / eval_video_dir / eval_durations (default: the training ones),
    prompt (template with {query} and {duration}), answer (template with {start} and {end}: the reference
    answer TempSamp-R1 injects), on_error / missing_video (raise | skip), text_first (the query before the
    video in the user turn; default: the video first, as Qwen-VL's grounding recipes do).
    Examples: {"prompt", "video", "duration", "windows", "qid", "query", "text_first"}.
    """

    def __init__(self, cfg, format: str = "charades_sta", annotations: str = "", video_dir: str = "",
                 durations: str | None = None, eval_annotations: str | None = None, eval_video_dir: str | None = None,
                 eval_durations: str | None = None, prompt: str = GROUNDING_PROMPT,
                 answer: str = "<answer> {start:.2f} to {end:.2f} </answer>", on_error: str = "raise",
                 missing_video: str = "raise", text_first: bool = False):
        from tasks.grounding_data import load_dataset

        if not annotations:
            raise ValueError("task.kwargs.annotations is required for task.name=grounding (the annotation file)")
        self.prompt_template, self.answer_template, self.text_first = prompt, answer, text_first
        self.train = self._examples(load_dataset(format, annotations, video_dir, durations, on_error, missing_video))
        ev = load_dataset(format, eval_annotations or annotations, eval_video_dir or video_dir,
                          eval_durations or durations, on_error, missing_video)
        self.eval = self._examples([e for e in ev if e["windows"]])[:cfg.eval_prompts]
        if not self.train:
            raise ValueError(f"{annotations}: no usable training queries")

    def _examples(self, rows):
        return [{**r, "prompt": self.prompt_template.format(query=r["query"], duration=r["duration"]),
                 "text_first": self.text_first} for r in rows if r["windows"]]

    def sample(self, n, rng):
        return [self.train[rng.randrange(len(self.train))] for _ in range(n)]

    def eval_examples(self):
        return self.eval

    def reference_output(self, ex) -> str:
        """The ground-truth answer text (TempSamp-R1 off-policy injection; SFT targets)."""
        s, e = ex["windows"][0]
        return self.answer_template.format(start=s, end=e)


class GroundingWorldTask(GroundingTask):
    """The embedded synthetic-video world (tasks/grounding_world.py), built under task.kwargs.root on first use
    and read back through the Charades-STA reader. kwargs: root, train_videos, test_videos (none: an existing
    world's counts, else 600 / 220; other counts than an existing world's are an error), and GroundingTask's
    prompt / answer / text_first. The query comes before the video by default: then the distance in M-RoPE
    positions from the answer to each video token does not depend on the query's length, which a 1 M-parameter
    model reading time off those distances cannot otherwise compensate for."""

    def __init__(self, cfg, root: str = "runs/grounding_world", train_videos: int | None = None,
                 test_videos: int | None = None, **kwargs):
        from tasks.grounding_world import ANSWER, DEFAULT_VIDEOS, PROMPT, build_world

        sizes = None if train_videos is None and test_videos is None else \
            {"train": train_videos or DEFAULT_VIDEOS["train"], "test": test_videos or DEFAULT_VIDEOS["test"]}
        w = build_world(root, sizes)
        kwargs.setdefault("prompt", PROMPT)
        kwargs.setdefault("answer", ANSWER)
        kwargs.setdefault("text_first", True)
        super().__init__(cfg, "charades_sta", w["train"]["annotations"], w["train"]["video_dir"],
                         w["train"]["durations"], w["test"]["annotations"], w["test"]["video_dir"],
                         w["test"]["durations"], **kwargs)


class ArithmeticTask:
    """Integer arithmetic questions with exact answers (tasks/arithmetic.py): train and held-out problems are
    disjoint. kwargs: lo, hi (operand range), ops (e.g. "+-"), prompt (template with {a} {op} {b})."""

    def __init__(self, cfg, lo: int = 10, hi: int = 99, ops: str = "+-", prompt: str | None = None):
        from tasks import arithmetic

        kw = dict(lo=lo, hi=hi, ops=ops, prompt=prompt or arithmetic.PROMPT)
        self.train = arithmetic.problems("train", **kw)
        heldout = arithmetic.problems("heldout", **kw)
        random.Random(1234).shuffle(heldout)
        self.eval = heldout[:cfg.eval_prompts]

    def sample(self, n, rng):
        return [self.train[rng.randrange(len(self.train))] for _ in range(n)]

    def eval_examples(self):
        return self.eval


TASKS.register("shapes")(ShapesTask)
TASKS.register("motion")(MotionTask)
TASKS.register("prompt_file")(PromptFileTask)
TASKS.register("grounding")(GroundingTask)
TASKS.register("grounding_world")(GroundingWorldTask)
TASKS.register("arithmetic")(ArithmeticTask)


def build_task(cfg):
    """TASKS[cfg.name](cfg, **cfg.kwargs); an unknown kwarg fails naming the valid ones."""
    import inspect

    factory = TASKS[cfg.name]
    params = inspect.signature(factory).parameters
    valid = sorted(k for k in params if k != "cfg")
    unknown = sorted(set(cfg.kwargs) - set(valid))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise ValueError(f"task.kwargs {unknown} not understood by task {cfg.name!r}; valid: {valid}")
    try:
        return factory(cfg, **cfg.kwargs)
    except TypeError as e:
        raise ValueError(f"task {cfg.name!r}: {e}; valid task.kwargs: {valid}") from e
