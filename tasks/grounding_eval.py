"""The grounding benchmark metric: greedy answers scored by tIoU -> R1@{0.3, 0.5, 0.7} (>=) and mIoU, with
unparseable answers counted as 0; and the blind constant-answer baseline printed beside every model."""

from __future__ import annotations

from mmrl.evaluation import evaluate_outputs
from rewards.grounding import GroundingReward, grounding_metrics, multi_window_iou


def evaluate(policy, examples: list[dict], batch_size: int = 32, progress: bool = True) -> dict:
    """{"mIoU", "R1@0.3", "R1@0.5", "R1@0.7" (percent), "parsed", "format", "n"} of greedy answers."""
    res = evaluate_outputs(policy.evaluate, examples, GroundingReward(), seed=0, batch_size=batch_size,
                           progress=progress)
    out = {"mIoU": res["iou"], **{f"R1@{m}": round(100 * res[f"r1@{m}"], 2) for m in (0.3, 0.5, 0.7)},
           "parsed": res["parsed"], "format": res["format"], "n": res["n"]}
    return out


def constant_baseline(fit: list[dict], examples: list[dict], step: float = 0.05) -> dict:
    """The best blind answer: one window [a, b] x duration (a, b on a `step` grid) chosen for mIoU on `fit`
    (the training queries), scored on `examples`. A model that does not beat it has not looked at the video."""
    grid = [round(i * step, 6) for i in range(int(round(1 / step)) + 1)]

    def miou(a, b, rows):
        return sum(multi_window_iou((a * r["duration"], b * r["duration"]), r["windows"]) for r in rows) / len(rows)

    a, b = max(((a, b) for a in grid for b in grid if b > a), key=lambda ab: miou(*ab, fit))
    ious = [multi_window_iou((a * r["duration"], b * r["duration"]), r["windows"]) for r in examples]
    return {"window_fraction": [a, b], **{k: round(v, 4) for k, v in grounding_metrics(ious).items()}}
