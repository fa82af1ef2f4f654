"""A small verifiable text task: integer arithmetic questions with exact answers.

    problems("train" | "heldout")  -> [{"prompt", "answer", "a", "op", "b"}]

Problems are every `a op b` with operands in [lo, hi] for each op; a hash of the problem text puts it in
the train or the held-out split, so a held-out question is never seen in training. Used to show a real
pretrained model (SmolLM2-135M-Instruct) learning through the token policy.
"""

from __future__ import annotations

import hashlib
import operator
import random

from mmrl.errors import ConfigError

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
PROMPT = "What is {a} {op} {b}? Reply with only the number."


def split_of(text: str, heldout_fraction: float = 0.5) -> str:
    h = int(hashlib.sha1(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "heldout" if h < heldout_fraction else "train"


def problems(split: str, lo: int = 10, hi: int = 99, ops: str = "+-", prompt: str = PROMPT) -> list[dict]:
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    bad = sorted(set(ops) - set(OPS))
    if bad or not ops:
        raise ConfigError(f"ops={ops!r}: unknown operators {bad}; valid: {sorted(OPS)}")
    if not lo <= hi:
        raise ConfigError(f"operand range [{lo}, {hi}] is empty")
    out = []
    for op in ops:
        for a in range(lo, hi + 1):
            for b in range(lo, hi + 1):
                text = prompt.format(a=a, op=op, b=b)
                if split_of(f"{a}{op}{b}") == split:
                    out.append({"prompt": text, "answer": OPS[op](a, b), "a": a, "op": op, "b": b})
    return out


class ArithmeticTask:
    """Integer arithmetic questions with exact answers (task.name=arithmetic): train and held-out problems are
    disjoint. kwargs: lo, hi (operand range), ops (e.g. "+-"), prompt (template with {a} {op} {b})."""

    def __init__(self, cfg, lo: int = 10, hi: int = 99, ops: str = "+-", prompt: str | None = None):
        kw = dict(lo=lo, hi=hi, ops=ops, prompt=prompt or PROMPT)
        self.train = problems("train", **kw)
        heldout = problems("heldout", **kw)
        random.Random(1234).shuffle(heldout)
        self.eval = heldout[:cfg.eval_prompts]

    def sample(self, n, rng):
        return [self.train[rng.randrange(len(self.train))] for _ in range(n)]

    def eval_examples(self):
        return self.eval
