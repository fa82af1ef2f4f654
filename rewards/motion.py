"""A centroid tracker for the motion world: the GRPO reward and the benchmark metric in one function.

Per frame, the object is the set of pixels nearest (RGB distance) to the prompt's color among the palette and
the background, and within `max_dist` of it; with at least `min_area` pixels its centroid is tracked.
Over the frames where it is found:
- found     fraction of frames with the object;
- progress  min(1, d_par / target): d_par = the net displacement projected on the asked direction (pixels),
            target = `target_frac` of the frame size;
- smooth    fraction of consecutive found frames whose step projects positively on the direction;
- along     d_par / frame size, signed (a diagnostic, not paid: its mean over prompts is ~0 for a model whose
            motion ignores the asked direction, and TRAVEL = 0.5 on rendered clips);
- correct   (the benchmark's motion accuracy, 0/1): found >= 0.75, d_par >= `min_frac` of the frame size and
            the sideways displacement <= d_par / 2.
overall = correct_weight * correct + (1 - correct_weight) * found * (progress + smooth) / 2.
On rendered ground truth it is exact: correct = 1 for the asked direction, 0 for any other (tests).
"""

from __future__ import annotations

import numpy as np
import torch

from mmrl.errors import ConfigError
from mmrl.evaluation import evaluate_generator
from tasks.motion import COLORS, DIRECTIONS, Prompt, parse
from tasks.shapes import BACKGROUND

_NAMES = list(COLORS)
_PALETTE = np.array([COLORS[c] for c in _NAMES] + [BACKGROUND], dtype=np.float32)  # [C + 1, 3]


def track(video: np.ndarray, color: str, min_area: int = 3, max_dist: float = 90.0) -> np.ndarray:
    """Centroids [F, 2] (x, y; NaN where the object is not found) of `color` in a video [F, H, W, 3] uint8."""
    x = video.astype(np.float32)
    dist = np.linalg.norm(x[..., None, :] - _PALETTE, axis=-1)                     # [F, H, W, C + 1]
    k = _NAMES.index(color)
    mask = (dist.argmin(-1) == k) & (dist[..., k] < max_dist)                       # [F, H, W]
    out = np.full((len(video), 2), np.nan, dtype=np.float32)
    for f, m in enumerate(mask):
        ys, xs = np.nonzero(m)
        if len(xs) >= min_area:
            out[f] = xs.mean(), ys.mean()
    return out


def score(centroids: np.ndarray, direction: str, size: int, target_frac: float = 0.4,
          min_frac: float = 0.25) -> dict[str, float]:
    ok = ~np.isnan(centroids[:, 0])
    found = float(ok.mean())
    c = centroids[ok]
    if len(c) < 2:
        return {"correct": 0.0, "found": found, "progress": 0.0, "smooth": 0.0, "along": 0.0}
    u = np.array(DIRECTIONS[direction], dtype=np.float32)
    side = np.array([-u[1], u[0]], dtype=np.float32)
    disp = c[-1] - c[0]
    d_par, d_side = float(disp @ u), abs(float(disp @ side))
    steps = np.diff(c, axis=0) @ u
    smooth = float((steps > 0).mean())
    correct = float(found >= 0.75 and d_par >= min_frac * size and d_side <= d_par / 2)
    return {"correct": correct, "found": found, "progress": float(np.clip(d_par / (target_frac * size), 0, 1)),
            "smooth": smooth, "along": d_par / size}


class MotionReward:
    """Reward callable `(videos [N, 3, F, H, W] in [-1, 1], examples) -> {"overall", "correct", "found",
    "progress", "smooth", "along": [N]}`; examples are prompt texts or dicts with a "prompt" key."""

    def __init__(self, correct_weight: float = 0.5, min_area: int = 3):
        if not 0.0 <= correct_weight <= 1.0:
            raise ConfigError(f"correct_weight must be in [0, 1], got {correct_weight}")
        self.correct_weight, self.min_area = correct_weight, min_area

    def __call__(self, outputs: torch.Tensor, examples) -> dict[str, torch.Tensor]:
        if outputs.dim() != 5:
            raise ValueError(f"motion reward needs videos [N, 3, F, H, W], got shape {tuple(outputs.shape)}")
        vids = ((outputs.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().byte()
        vids = vids.permute(0, 2, 3, 4, 1).numpy()                                    # [N, F, H, W, 3]
        rows = []
        for vid, ex in zip(vids, examples):
            spec = parse(ex if isinstance(ex, str) else ex["prompt"])
            rows.append(score(track(vid, spec.color, self.min_area), spec.direction, vid.shape[2]))
        out = {k: torch.tensor([r[k] for r in rows]) for k in rows[0]}
        w = self.correct_weight
        out["overall"] = w * out["correct"] + (1 - w) * out["found"] * (out["progress"] + out["smooth"]) / 2
        return out


def evaluate(model, prompts: list[Prompt], seed: int = 0, num_steps: int = 16, cfg_scale: float = 1.0,
             batch_size: int = 32, progress: bool = True) -> dict:
    """The motion-world benchmark: motion accuracy (and the reward's components) of `model` (a FlowModel) on
    `prompts`, overall and per direction, ODE clips scored by MotionReward; sample i uses noise seed seed + i."""
    examples = [{"prompt": p.text, "category": p.spec.direction} for p in prompts]
    return evaluate_generator(model, examples, MotionReward(), seed, num_steps, cfg_scale, batch_size, progress)
