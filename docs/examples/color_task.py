"""Your task, in one file: prompts "a <color> <shape>" for the colors you choose, the color as category.

    task:
      name: color_task:ColorTask
      kwargs: {colors: [red, blue], shapes: [circle, square]}

A task is a class built as `Task(cfg.task, **cfg.task.kwargs)` with two methods: `sample(n, rng)` (n training
examples, drawn with the trainer's `random.Random`, so a resumed run draws the same) and `eval_examples()`
(the fixed held-out list that the trainer's evaluation and `mmrl eval` score). An example is a dict with
"prompt" and anything your reward reads; "category" groups the logged rewards and the benchmark table.
Optional: `reference_output(example) -> str` (ground truth for off-policy injection) and `baselines()`.
"""

import itertools


class ColorTask:
    def __init__(self, cfg, colors=("red", "blue"), shapes=("circle", "square")):
        texts = [f"a {c} {s}" for c, s in itertools.product(colors, shapes)]
        if not texts:
            raise ValueError("task.kwargs: give at least one color and one shape")
        # hold out every other text: the benchmark never scores a text trained on
        self.train, self.heldout = texts[::2], texts[1::2] or texts[:1]
        self.eval_prompts = cfg.eval_prompts

    def sample(self, n, rng):
        return [self._example(rng.choice(self.train)) for _ in range(n)]

    def eval_examples(self):
        return [self._example(t) for t in self.heldout][:self.eval_prompts]

    @staticmethod
    def _example(text):
        return {"prompt": text, "category": text.split()[1]}
