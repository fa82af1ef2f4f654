"""The embedded "motion" text-to-video world: prompts such as "a red circle moving left" and a clip renderer.

One object (circle or square, one of four colors) crosses a mid-gray canvas in a straight line at constant
speed, in one of four directions, over F frames. Prompts are a core phrase in one of a few templates; a prompt
parses back into a `MotionSpec` that the renderer (pretraining clips) and the tracker reward
(`rewards/motion.py`: training reward and benchmark metric) share. Held-out texts: the shapes world's stable
hash split (`tasks.shapes.is_heldout`).

Clips are tensors [3, F, H, W] in [-1, 1], the layout of a video generator's output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw

from mmrl.errors import ConfigError
from tasks.shapes import BACKGROUND, COLORS as ALL_COLORS, is_heldout

SHAPES = ("circle", "square")
COLORS = {c: ALL_COLORS[c] for c in ("red", "green", "blue", "yellow")}
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy), y grows downwards
TEMPLATES = ("{}", "a video of {}", "a clip of {}", "footage of {}")
FRAMES, SIZE = 8, 16
TRAVEL = 0.5   # distance covered over the clip, as a fraction of the frame size
RADIUS = 2.5   # object half-size in pixels at SIZE 16 (scales with the size)


@dataclass(frozen=True)
class MotionSpec:
    shape: str
    color: str
    direction: str


@dataclass(frozen=True)
class Prompt:
    text: str
    spec: MotionSpec


def core_text(spec: MotionSpec) -> str:
    return f"a {spec.color} {spec.shape} moving {spec.direction}"


def all_prompts() -> list[Prompt]:
    specs = [MotionSpec(s, c, d) for s in SHAPES for c in COLORS for d in DIRECTIONS]
    return [Prompt(t.format(core_text(s)), s) for s in specs for t in TEMPLATES]


def parse(text: str) -> MotionSpec:
    words = text.lower().split()
    try:
        i = words.index("moving")
        return MotionSpec(shape=words[i - 1], color=words[i - 2], direction=words[i + 1])
    except (ValueError, IndexError):
        raise ConfigError(f"not a motion prompt: {text!r} (expected '... a <color> <shape> moving <direction>')")


def prompts(split: str) -> list[Prompt]:
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be train, heldout or all, got {split!r}")
    return [p for p in all_prompts() if split == "all" or is_heldout(p.text) == (split == "heldout")]


def balanced_prompts(split: str, n: int, seed: int) -> list[Prompt]:
    """n prompts of `split` with the four directions equally represented (cycled texts, seeded order)."""
    rng = random.Random(seed)
    by_dir = {d: [p for p in prompts(split) if p.spec.direction == d] for d in DIRECTIONS}
    out = []
    for i in range(n):
        pool = by_dir[list(DIRECTIONS)[i % len(DIRECTIONS)]]
        out.append(pool[rng.randrange(len(pool))])
    return out


def render(spec: MotionSpec, frames: int = FRAMES, size: int = SIZE, rng: random.Random | None = None) -> torch.Tensor:
    """A clip [3, F, H, W] in [-1, 1]: the object moves TRAVEL * size pixels in its direction, start position
    random (the whole path inside the frame), drawn at 4x and box-downsampled (sub-pixel motion)."""
    rng = rng or random.Random(0)
    r = RADIUS * size / SIZE
    travel = TRAVEL * size
    dx, dy = DIRECTIONS[spec.direction]
    lo = r + 0.5

    def start(d):  # the coordinate's start so that start + d * travel stays in [lo, size - lo]
        if d > 0:
            return rng.uniform(lo, size - lo - travel)
        if d < 0:
            return rng.uniform(lo + travel, size - lo)
        return rng.uniform(lo, size - lo)

    x0, y0 = start(dx), start(dy)
    k = 4
    clip = []
    for f in range(frames):
        t = f / (frames - 1)
        cx, cy = (x0 + dx * travel * t) * k, (y0 + dy * travel * t) * k
        img = Image.new("RGB", (size * k, size * k), BACKGROUND)
        box = (cx - r * k, cy - r * k, cx + r * k, cy + r * k)
        draw = ImageDraw.Draw(img)
        (draw.ellipse if spec.shape == "circle" else draw.rectangle)(box, fill=COLORS[spec.color])
        img = img.resize((size, size), Image.BOX)
        clip.append(torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1) / 127.5 - 1)
    return torch.stack(clip, 1)


class MotionTask:
    """The motion world as a task (task.name=motion): trains on one split of texts, evaluates on
    the other, the four directions equally represented (the example category is the direction)."""

    def __init__(self, cfg):
        self.train = prompts(cfg.split)
        self.eval = balanced_prompts(cfg.eval_split, cfg.eval_prompts, seed=1234)

    def sample(self, n, rng):
        return [{"prompt": p.text, "category": p.spec.direction} for p in (rng.choice(self.train) for _ in range(n))]

    def eval_examples(self):
        return [{"prompt": p.text, "category": p.spec.direction} for p in self.eval]
