"""Temporal-grounding rewards and the benchmark's scoring of a policy (docs/algorithms.md §7; Time-R1 lineage,
TempSamp-R1). The metric itself (tIoU, R1@m, mIoU) is the task's: tasks/grounding_metrics.py.

The model answers `<think>...</think><answer>S to E</answer>` in seconds. `parse_answer` never raises: any
string maps to an interval or to None (unparseable), and None scores 0 everywhere.

    iou_v2(p, g, T)     tIoU · (1 − |s − s'| / T) · (1 − |e − e'| / T)    (Time-R1's distance penalty)
    format_ok(text)     1 if the whole text is `<think>…</think> <answer>…</answer>`, else 0
    evaluate(policy)    greedy answers -> R1@{0.3, 0.5, 0.7} (percent) and mIoU, unparseable answers counted as 0
"""

from __future__ import annotations

import math
import re

import torch

from mmrl.errors import ConfigError
from mmrl.evaluation import evaluate_outputs
from tasks.grounding_metrics import THRESHOLDS, multi_window_iou, tiou

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_SPAN = re.compile(r"(-?\d+\.?\d*)\s*(?:to|and|-)\s*(-?\d+\.?\d*)")  # signed: "-3 to 4" starts at -3
_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.S)


def parse_answer(text, duration: float | None = None) -> tuple[float, float] | None:
    """(start, end) in seconds from a model output, or None. Never raises, whatever `text` is.

    The LAST <answer> block is read (the whole text when there is none), then the LAST "S to E" / "S and E" /
    "S - E" in it. A minus sign belongs to the number ("-3 to 4" starts at -3, "3-4" is 3 to 4). NaN/inf,
    start > end -> None. With a duration, the interval is clamped to [0, duration] (so "-3 to 4" in an 8 s video
    is 0 to 4, and an interval wholly before 0 collapses to 0 to 0); without one, negative times are returned.
    """
    if not isinstance(text, str):
        return None
    blocks = _ANSWER.findall(text)
    spans = _SPAN.findall(blocks[-1] if blocks else text)
    if not spans:
        return None
    try:
        s, e = float(spans[-1][0]), float(spans[-1][1])
    except ValueError:
        return None
    if not (math.isfinite(s) and math.isfinite(e)) or s > e:
        return None
    if duration is not None and math.isfinite(duration) and duration > 0:
        s, e = min(max(s, 0.0), duration), min(max(e, 0.0), duration)
    return s, e


def iou_v2(p: tuple[float, float] | None, g: tuple[float, float], duration: float) -> float:
    if p is None or duration <= 0:
        return 0.0
    return tiou(p, g) * (1 - abs(p[0] - g[0]) / duration) * (1 - abs(p[1] - g[1]) / duration)


def format_ok(text) -> float:
    return float(isinstance(text, str) and _FORMAT.fullmatch(text) is not None)


_TOL = 1e-9  # 3 / 4 computed as 0.74999... is still 0.75


def coarse_bit(iou: float) -> float:
    """1 if iou >= 0.5 (R1@0.5's success), else 0."""
    return float(iou >= 0.5 - _TOL)


def coarse_bucket(iou: float) -> float:
    """iou floored to the nearest of 0, 0.25, 0.5, 0.75, 1."""
    return min(1.0, math.floor(4 * iou + 4 * _TOL) / 4)


COARSE = {None: None, "bit": coarse_bit, "bucket": coarse_bucket}


class GroundingReward:
    """Reward callable `(completions: list[str], examples) -> dict[str, Tensor[N]]`.

    examples carry "duration" (s) and "windows" ([[s, e], ...]: one for Charades-STA / ActivityNet, several for
    QVHighlights). overall = iou_weight · accuracy + format_weight · format, where accuracy is "iou" (best
    tIoU over windows) or "iou_v2" (distance-penalized, best over windows), plus hit_weight when the tIoU
reaches hit_threshold (an R1@m-shaped bonus that pays for tight windows, not hedged wide ones). Components are returned raw
    ("iou", "iou_v2", "format", "parsed") so each is logged separately, and the R1 indicators
    ("r1@0.3", ...) so an evaluation averages straight into R1@m.

    coarse (the reward-only regime, docs/results.md): the learner's accuracy term is a coarsened IoU, "bit"
    (1 if the accuracy >= 0.5, else 0) or "bucket" (floored to 0, 0.25, 0.5, 0.75, 1); the coarse value is also
    returned as "coarse", and the raw "iou" / "iou_v2" / R1 components stay logged for analysis only.
    """

    def __init__(self, accuracy: str = "iou", iou_weight: float = 1.0, format_weight: float = 0.1,
                 hit_weight: float = 0.0, hit_threshold: float = 0.7, coarse: str | None = None):
        if accuracy not in ("iou", "iou_v2"):
            raise ConfigError(f"accuracy must be 'iou' or 'iou_v2', got {accuracy!r}")
        if coarse not in COARSE:
            raise ConfigError(f"coarse must be one of {[k for k in COARSE if k]} or None (the raw IoU), got {coarse!r}")
        if not 0.0 < hit_threshold <= 1.0:
            raise ConfigError(f"hit_threshold must be in (0, 1], got {hit_threshold}")
        self.accuracy, self.iou_weight, self.format_weight = accuracy, iou_weight, format_weight
        self.hit_weight, self.hit_threshold, self.coarse = hit_weight, hit_threshold, coarse

    def __call__(self, completions, examples) -> dict[str, torch.Tensor]:
        rows = {k: [] for k in ("iou", "iou_v2", "format", "parsed", *(f"r1@{m}" for m in THRESHOLDS))}
        for text, ex in zip(completions, examples):
            dur = float(ex["duration"])
            p = parse_answer(text, dur)
            windows = [tuple(map(float, w)) for w in ex["windows"]]
            iou = multi_window_iou(p, windows)
            rows["iou"].append(iou)
            rows["iou_v2"].append(max(iou_v2(p, w, dur) for w in windows))
            rows["format"].append(format_ok(text))
            rows["parsed"].append(float(p is not None))
            for m in THRESHOLDS:
                rows[f"r1@{m}"].append(float(iou >= m))
        out = {k: torch.tensor(v, dtype=torch.float32) for k, v in rows.items()}
        accuracy = out[self.accuracy]
        if self.coarse:
            out["coarse"] = accuracy = torch.tensor([COARSE[self.coarse](float(a)) for a in rows[self.accuracy]])
        out["overall"] = self.iou_weight * accuracy + self.format_weight * out["format"]
        if self.hit_weight:
            out["overall"] += self.hit_weight * (out["iou"] >= self.hit_threshold).float()
        return out


def evaluate(policy, examples: list[dict], batch_size: int = 32, progress: bool = True) -> dict:
    """The grounding benchmark: {"mIoU", "R1@0.3", "R1@0.5", "R1@0.7" (percent), "parsed", "format", "n"} of the
    policy's greedy answers (`policy.evaluate`) to `examples`, scored by GroundingReward."""
    res = evaluate_outputs(policy.evaluate, examples, GroundingReward(), seed=0, batch_size=batch_size,
                           progress=progress)
    return {"mIoU": res["iou"], **{f"R1@{m}": round(100 * res[f"r1@{m}"], 2) for m in THRESHOLDS},
            "parsed": res["parsed"], "format": res["format"], "n": res["n"]}
