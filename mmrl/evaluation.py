"""Benchmark evaluation shared by the trainer and the scripts: generate deterministically, score with the
task's reward, average every reward key overall and per example category."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from tqdm import tqdm


@torch.no_grad()
def evaluate_outputs(generate: Callable[[list[dict], int], object], examples: list[dict], reward: Callable,
                     seed: int = 0, batch_size: int = 64, progress: bool = True) -> dict:
    """generate(examples_chunk, first_seed) -> outputs; example i uses seed `seed + i` (batch-size invariant).

    Returns {key: mean, ..., "n": int, "per_category": {cat: {key: mean, ..., "n": int}}} for every key the
    reward returns ("overall", "strict", ...); categories come from example["category"] when present.
    """
    sums: dict = defaultdict(lambda: defaultdict(float))
    for i in tqdm(range(0, len(examples), batch_size), desc="eval", disable=not progress):
        chunk = examples[i:i + batch_size]
        r = reward(generate(chunk, seed + i), chunk)
        for j, ex in enumerate(chunk):
            for cat in ("all", ex.get("category")):
                if cat is None:
                    continue
                sums[cat]["n"] += 1
                for k, v in r.items():
                    sums[cat][k] += float(v[j])

    def means(d):
        return {k: (round(v / d["n"], 4) if k != "n" else int(v)) for k, v in d.items()}

    out = means(sums.pop("all")) if "all" in sums else {"n": 0}
    out["per_category"] = {c: means(d) for c, d in sums.items()}
    return out
