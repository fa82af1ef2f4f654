"""The temporal-grounding benchmark metric (docs/algorithms.md §7): what every grounding number is measured in.

    tiou(p, g)          |p ∩ g| / |p ∪ g|  (zero-length union: 1 if the intervals are equal, else 0)
    multi_window_iou    best tIoU over several ground-truth windows (QVHighlights)
    R1@m                share of queries whose top-1 tIoU >= m (mmrl uses >=; Time-R1's evaluator uses >)
    mIoU                mean tIoU, unparseable answers (p = None) counted as 0

Intervals are (start, end) in seconds. rewards/grounding.py pays a policy in these terms; the task's blind
baseline (tasks/grounding.py `constant_baseline`) is scored in them too.
"""

from __future__ import annotations

THRESHOLDS = (0.3, 0.5, 0.7)


def tiou(p: tuple[float, float] | None, g: tuple[float, float]) -> float:
    if p is None:
        return 0.0
    inter = max(0.0, min(p[1], g[1]) - max(p[0], g[0]))
    union = max(p[1], g[1]) - min(p[0], g[0])
    if union <= 0:
        return 1.0 if (p[0], p[1]) == (g[0], g[1]) else 0.0
    return inter / union


def multi_window_iou(p: tuple[float, float] | None, windows) -> float:
    return max((tiou(p, tuple(w)) for w in windows), default=0.0)


def grounding_metrics(ious: list[float], thresholds=THRESHOLDS) -> dict:
    """{"mIoU": mean tIoU, "R1@m": share with tIoU >= m, in percent}; unparseable answers enter as 0."""
    n = max(len(ious), 1)
    out = {"mIoU": sum(ious) / n}
    out.update({f"R1@{m}": 100.0 * sum(i >= m for i in ious) / n for m in thresholds})
    return out
