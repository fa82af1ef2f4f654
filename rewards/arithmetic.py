"""Exact-answer reward for the arithmetic task: the last integer in the completion must equal the answer.

    "12 + 30 = 42"  -> 42     "The answer is -7."  -> -7     "forty-two"  -> unparsed (0)

Components: correct, parsed (an integer was found), bare (the reply is only an integer, as the prompt asks:
"42", " -7." ) and overall = correct + format_weight * bare.
"""

from __future__ import annotations

import re

import torch

INT = r"-?\d+(?:,\d{3})*"              # an integer, thousands commas allowed
BARE = re.compile(rf"\s*{INT}\.?\s*")   # a reply that is only an integer


def parse_last_int(text: str) -> int | None:
    """The last integer written in `text` (thousands commas allowed); None when there is none. Never raises."""
    if not isinstance(text, str):
        return None
    found = re.findall(INT, text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


class ArithmeticReward:
    def __init__(self, format_weight: float = 0.0):
        self.format_weight = format_weight

    def __call__(self, outputs: list[str], examples: list[dict]) -> dict[str, torch.Tensor]:
        got = [parse_last_int(o) for o in outputs]
        parsed = torch.tensor([g is not None for g in got], dtype=torch.float32)
        correct = torch.tensor([g is not None and g == int(ex["answer"]) for g, ex in zip(got, examples)],
                               dtype=torch.float32)
        bare = torch.tensor([isinstance(o, str) and BARE.fullmatch(o) is not None for o in outputs],
                            dtype=torch.float32)
        return {"overall": correct + self.format_weight * bare, "correct": correct, "parsed": parsed, "bare": bare}
