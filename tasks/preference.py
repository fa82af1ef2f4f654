"""Offline preference pairs (Diffusion-DPO's data, Pick-a-Pic style) as a task, and the reward that reads their labels.

A pairs file is JSONL, one comparison per line, in either layout (image paths relative to the file):
    {"prompt": "a red circle", "chosen": "img/a.png", "rejected": "img/b.png"}
    {"caption": "a red circle", "jpg_0": "img/a.png", "jpg_1": "img/b.png", "label_0": 1}   # Pick-a-Pic's columns
Pick-a-Pic's ties (label_0 = 0.5) carry no preference and are skipped (counted in the log). Each example gives its
two images as `outputs` [chosen, rejected] with `labels` [1, 0]: the flow policy encodes them as final samples
instead of sampling (mmrl/policy/flow.py `_given`), `preference_label` pays each row its label, and
algo.objective.name=dpo trains each pair's winner against its loser (docs/algorithms.md §15). train.group_size = 2.
Evaluation generates from the held-out prompts and scores them with reward.eval_name.
"""

from __future__ import annotations

import logging
import os

import torch

from mmrl.errors import ConfigError, MissingFile
from mmrl.task import PromptFileTask, read_prompts, split_heldout

log = logging.getLogger(__name__)


def read_pairs(path: str) -> list[dict]:
    """Examples {"prompt", "outputs": [chosen, rejected], "labels": [1.0, 0.0]} of a pairs file; ties skipped."""
    folder, out, ties = os.path.dirname(os.path.abspath(path)), [], 0
    for i, row in enumerate(read_prompts(path, "caption" if _pick_a_pic(path) else "prompt", "task.prompt_file"), 1):
        if "chosen" in row and "rejected" in row:
            pair = [row["chosen"], row["rejected"]]
        elif {"jpg_0", "jpg_1", "label_0"} <= set(row):
            if float(row["label_0"]) == 0.5:
                ties += 1
                continue
            pair = [row["jpg_0"], row["jpg_1"]][::1 if float(row["label_0"]) > 0.5 else -1]
        else:
            raise ConfigError(f"{path}:{i}: a pair needs chosen / rejected (or Pick-a-Pic's jpg_0 / jpg_1 / label_0); "
                              f"the row has {sorted(row)}")
        pair = [p if os.path.isabs(p) else os.path.join(folder, p) for p in pair]
        for p in pair:
            if not os.path.isfile(p):
                raise MissingFile(f"{path}:{i}: image {p!r} does not exist")
        out.append({"prompt": row["prompt"], "outputs": pair, "labels": [1.0, 0.0],
                    **{k: v for k, v in row.items() if k not in ("prompt", "chosen", "rejected", "jpg_0", "jpg_1")}})
    if ties:
        log.info("%s: %d tied pairs skipped (label_0 = 0.5)", path, ties)
    if not out:
        raise ConfigError(f"{path}: no preference pairs")
    return out


def _pick_a_pic(path: str) -> bool:
    with open(path, encoding="utf-8") as f:
        first = f.readline()
    return '"caption"' in first and '"prompt"' not in first


class PreferencePairsTask(PromptFileTask):
    """task.name=preference_pairs, task.prompt_file=PAIRS.jsonl. kwargs: heldout_fraction (default 0.1) and
    split_seed hold out that fraction of the prompts for evaluation (generation), or eval_file gives held-out prompts."""

    def __init__(self, cfg, eval_file: str | None = None, heldout_fraction: float | None = 0.1, split_seed: int = 0):
        pairs = read_pairs(getattr(cfg, "prompt_file", None) or "")
        if eval_file is not None:
            self.train, self.heldout = pairs, read_prompts(eval_file, "prompt", "task.kwargs.eval_file")
        else:
            self.train, self.heldout = split_heldout(pairs, heldout_fraction, split_seed)


class PreferenceLabel:
    """reward.name=preference_label: each row's label from the data (1 chosen, 0 rejected)."""

    def __call__(self, outputs, examples) -> dict[str, torch.Tensor]:
        missing = [i for i, ex in enumerate(examples) if "label" not in ex]
        if missing:
            raise ConfigError("reward.name=preference_label reads the labels of given outputs (task.name="
                              "preference_pairs); these rows were sampled, not given")
        return {"overall": torch.tensor([float(ex["label"]) for ex in examples])}
