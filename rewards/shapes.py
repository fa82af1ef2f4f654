"""A deterministic detector for the shapes world: the GRPO reward and the benchmark metric in one function.

Detection: each pixel is assigned to the nearest of the palette colors or the background (RGB distance);
connected components (4-neighbour) of one color with at least `min_area` pixels are objects; a component's
shape is read from its fill ratio area / bbox area (square ~1.0, circle ~0.78, triangle ~0.5) and its
position from its bbox center. On rendered ground truth the detector is exact (tests/test_shapes_world.py).

Scoring a `Spec` (tasks/shapes.py):
- strict (GenEval-style correctness, 0/1): exactly the asked objects, with the asked shapes, colors, counts
  and relation; no extra objects.
- partial (in [0, 1]): the mean of the checks the category makes (count right, each asked object found,
  color right, relation right), so a reward model can pay for progress.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mmrl.errors import ConfigError
from mmrl.evaluation import evaluate_generator
from tasks.shapes import BACKGROUND, COLORS, Prompt, Spec, parse, relation_holds, to_uint8

_NAMES = list(COLORS)
_PALETTE = np.array([COLORS[c] for c in _NAMES] + [BACKGROUND], dtype=np.float32)  # [C + 1, 3]


@dataclass(frozen=True)
class Detection:
    shape: str
    color: str
    cx: float
    cy: float
    area: int


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean mask [H, W]; each as an array of (y, x) pixel coordinates."""
    seen = np.zeros_like(mask, dtype=bool)
    h, w = mask.shape
    comps = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        stack, pix = [(y0, x0)], []
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            pix.append((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        comps.append(np.array(pix))
    return comps


def min_area_for(size: int) -> int:
    """Smallest component counted as an object: 6 px at 24 px, 10 px at 32 px (a third of the smallest shape)."""
    return max(6, size * size // 100)


def detect(img: np.ndarray, min_area: int | None = None) -> list[Detection]:
    """Objects in one uint8 image [H, W, 3], sorted by area (largest first); `min_area` defaults by image size."""
    min_area = min_area_for(img.shape[0]) if min_area is None else min_area
    d = ((img[:, :, None, :].astype(np.float32) - _PALETTE) ** 2).sum(-1)  # [H, W, C + 1]
    label = d.argmin(-1)
    out = []
    for ci, name in enumerate(_NAMES):
        for pix in _components(label == ci):
            if len(pix) < min_area:
                continue
            y0, x0 = pix.min(0)
            y1, x1 = pix.max(0)
            fill = len(pix) / ((y1 - y0 + 1) * (x1 - x0 + 1))
            shape = "square" if fill > 0.88 else "circle" if fill > 0.64 else "triangle"
            out.append(Detection(shape, name, (x0 + x1) / 2, (y0 + y1) / 2, len(pix)))
    return sorted(out, key=lambda o: -o.area)


def score(spec: Spec, dets: list[Detection], size: int) -> tuple[float, float]:
    """(strict, partial) for one image's detections."""
    want = spec.objects
    checks = [len(dets) == len(want)]
    if spec.category == "counting":
        checks.append(sum(d.shape == want[0].shape for d in dets) == len(want))
    else:
        # Greedy one-to-one match of asked objects to detections (shape, and color when asked).
        free = list(dets)
        matched = []
        for o in want:
            # prefer a detection with the asked color; else one of the asked shape (the color check then fails)
            hit = next((d for d in free if d.shape == o.shape and (o.color is None or d.color == o.color)), None)
            hit = hit or next((d for d in free if d.shape == o.shape), None)
            checks.append(hit is not None)
            if o.color is not None:
                checks.append(hit is not None and hit.color == o.color)
            matched.append(hit)
            if hit is not None:
                free.remove(hit)
        if spec.relation is not None:
            a, b = matched
            checks.append(a is not None and b is not None and relation_holds(a, b, spec.relation, size / 8))
    return float(all(checks)), float(np.mean(checks))


def saturation(imgs: np.ndarray) -> np.ndarray:
    """Mean chroma (max - min channel) / 255 of each image [N, H, W, 3] uint8 -> [N] in [0, 1]; the gray
    background, black and white score 0."""
    x = imgs.astype(np.float32)
    return ((x.max(-1) - x.min(-1)) / 255.0).mean(axis=(1, 2))


class ShapesReward:
    """Reward callable `(outputs, examples) -> {"overall": [N], "strict": [N], "partial": [N], ...}`.

    outputs: images [N, 3, H, W] in [-1, 1]; examples: the prompt texts (str) or dicts with a "prompt" key.
    `overall` is `strict_weight * strict + (1 - strict_weight) * partial + saturation_weight * saturation`.
    saturation_weight > 0 makes a hackable proxy (it pays for colored area whatever the prompt asks; the
    over-optimization experiment of the README): "saturation" is then logged, and "strict" stays the gold metric.
    """

    def __init__(self, strict_weight: float = 0.5, min_area: int | None = None, saturation_weight: float = 0.0):
        if not 0.0 <= strict_weight <= 1.0:
            raise ConfigError(f"strict_weight must be in [0, 1], got {strict_weight}")
        self.strict_weight = strict_weight
        self.min_area = min_area
        self.saturation_weight = saturation_weight

    def __call__(self, outputs: torch.Tensor, examples) -> dict[str, torch.Tensor]:
        imgs = to_uint8(outputs)
        size = imgs.shape[1]
        strict, partial = [], []
        for img, ex in zip(imgs, examples):
            text = ex if isinstance(ex, str) else ex["prompt"]
            s, p = score(parse(text), detect(img, self.min_area), size)
            strict.append(s)
            partial.append(p)
        strict_t, partial_t = torch.tensor(strict), torch.tensor(partial)
        overall = self.strict_weight * strict_t + (1 - self.strict_weight) * partial_t
        out = {"strict": strict_t, "partial": partial_t}
        if self.saturation_weight:
            out["saturation"] = torch.from_numpy(saturation(imgs))
            overall = overall + self.saturation_weight * out["saturation"]
        return {"overall": overall, **out}


# The benchmark protocol: 16 ODE steps without guidance (the small bases score best at CFG 1-2; see the docs).
EVAL_STEPS, EVAL_CFG = 16, 1.0


def evaluate(model, prompts: list[Prompt], seed: int = 0, num_steps: int = EVAL_STEPS, cfg_scale: float = EVAL_CFG,
             batch_size: int = 64, progress: bool = True) -> dict:
    """The shapes-world benchmark: strict and partial accuracy of `model` (a FlowModel) on `prompts`, overall and
    per category, ODE samples scored by ShapesReward; sample i uses noise seed seed + i."""
    examples = [{"prompt": p.text, "category": p.spec.category} for p in prompts]
    return evaluate_generator(model, examples, ShapesReward(), seed, num_steps, cfg_scale, batch_size, progress)
