"""The embedded "shapes" text-to-image world: a GenEval-like prompt grammar and a PIL renderer.

Six GenEval categories over 3 shapes x 6 colors on a mid-gray canvas:

    single_object   "a circle"
    two_object      "a circle and a square"
    counting        "three triangles"
    colors          "a red square"
    position        "a circle left of a triangle"
    color_attr      "a red circle and a blue square"

Every prompt is a core phrase inside one of a few templates ("a photo of {core}", ...). A prompt is parsed
back into a `Spec` (what must be in the image), which both the renderer (pretraining data) and the detector
(`rewards/shapes.py`: training reward and benchmark metric) use, so the three can never disagree.

Held-out split: a text is held out when a stable hash of it says so (`is_heldout`), so GRPO trains on one
set of texts and the benchmark scores another, with no list to keep in sync.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image, ImageDraw

from mmrl.errors import ConfigError

SHAPES = ("circle", "square", "triangle")
PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles"}
COLORS = {  # RGB; far from each other and from the background in RGB distance
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 215, 40),
    "black": (20, 20, 20),
    "white": (240, 240, 240),
}
BACKGROUND = (128, 128, 128)  # mid-gray = 0 after [-1, 1] normalization
CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")
NUMBERS = {2: "two", 3: "three"}
TEMPLATES = ("{}", "a photo of {}", "an image of {}", "a picture of {}")
HELDOUT_FRACTION = 0.5


@dataclass(frozen=True)
class Obj:
    shape: str
    color: str | None = None  # None: any color


@dataclass(frozen=True)
class Spec:
    """What an image must show. `relation` ("left of", ...) relates objects[0] to objects[1]."""

    category: str
    objects: tuple[Obj, ...]
    relation: str | None = None


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _obj_text(o: Obj) -> str:
    return _a(f"{o.color} {o.shape}" if o.color else o.shape)


def core_text(spec: Spec) -> str:
    """The template-free phrase of a spec."""
    o = spec.objects
    if spec.category == "counting":
        return f"{NUMBERS[len(o)]} {PLURALS[o[0].shape]}"
    if spec.category in ("single_object", "colors"):
        return _obj_text(o[0])
    if spec.category == "position":
        return f"{_obj_text(o[0])} {spec.relation} {_obj_text(o[1])}"
    return f"{_obj_text(o[0])} and {_obj_text(o[1])}"


def all_specs() -> list[Spec]:
    """Every spec of the grammar, in a fixed order."""
    pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    cpairs = [(a, b) for a in COLORS for b in COLORS if a != b]
    specs = [Spec("single_object", (Obj(s),)) for s in SHAPES]
    specs += [Spec("two_object", (Obj(a), Obj(b))) for a, b in pairs]
    specs += [Spec("counting", (Obj(s),) * n) for n in NUMBERS for s in SHAPES]
    specs += [Spec("colors", (Obj(s, c),)) for c in COLORS for s in SHAPES]
    specs += [Spec("position", (Obj(a), Obj(b)), r) for r in RELATIONS for a, b in pairs]
    specs += [Spec("color_attr", (Obj(a, ca), Obj(b, cb))) for a, b in pairs for ca, cb in cpairs]
    return specs


@dataclass(frozen=True)
class Prompt:
    text: str
    spec: Spec


def all_prompts() -> list[Prompt]:
    return [Prompt(t.format(core_text(s)), s) for s in all_specs() for t in TEMPLATES]


_BY_TEXT: dict[str, Spec] = {}


def parse(text: str) -> Spec:
    """The spec a prompt text asks for. Raises ValueError naming the grammar for text outside it."""
    if not _BY_TEXT:
        _BY_TEXT.update({p.text: p.spec for p in all_prompts()})
    try:
        return _BY_TEXT[text.strip()]
    except KeyError:
        raise ConfigError(f"{text!r} is not a shapes-world prompt; see tasks/shapes.py for the grammar "
                          f"(e.g. 'a red circle and a blue square')") from None


def is_heldout(text: str) -> bool:
    """Stable split by text: held-out texts never appear in GRPO training."""
    h = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < HELDOUT_FRACTION


def prompts(split: str) -> list[Prompt]:
    """split: 'train' | 'heldout' | 'all'."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    ps = all_prompts()
    if split == "all":
        return ps
    return [p for p in ps if is_heldout(p.text) == (split == "heldout")]


def balanced_prompts(split: str, n: int, seed: int) -> list[Prompt]:
    """n prompts with categories equally represented (texts repeat within small categories)."""
    rng = random.Random(seed)
    by_cat = {c: [p for p in prompts(split) if p.spec.category == c] for c in CATEGORIES}
    out = []
    for i in range(n):
        pool = by_cat[CATEGORIES[i % len(CATEGORIES)]]
        out.append(pool[rng.randrange(len(pool))])
    return out


# ---------------------------------------------------------------------------------------------------------
# Renderer: ground-truth images for pretraining (and for testing the detector).

@dataclass
class Placed:
    shape: str
    color: str
    cx: float
    cy: float
    r: int  # half-size in pixels
    bbox: tuple[int, int, int, int] = field(default=(0, 0, 0, 0))


def _draw(d: ImageDraw.ImageDraw, p: Placed) -> None:
    x0, y0, x1, y1 = round(p.cx - p.r), round(p.cy - p.r), round(p.cx + p.r), round(p.cy + p.r)
    rgb = COLORS[p.color]
    if p.shape == "circle":
        d.ellipse([x0, y0, x1, y1], fill=rgb)
    elif p.shape == "square":
        d.rectangle([x0, y0, x1, y1], fill=rgb)
    else:
        d.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=rgb)
    p.bbox = (x0, y0, x1, y1)


def relation_holds(a, b, relation: str, margin: float) -> bool:
    """Whether object a (anything with cx, cy; y grows downwards) is `relation` object b by more than margin px."""
    dx, dy = b.cx - a.cx, b.cy - a.cy
    return {"left of": dx > margin, "right of": -dx > margin, "above": dy > margin, "below": -dy > margin}[relation]


SLOTS = 3  # objects sit in the cells of a SLOTS x SLOTS grid


def slot_geometry(size: int) -> tuple[int, int]:
    """(cell size, object half-size) in px on a size x size canvas: objects fill their cell but one pixel."""
    cell = size // SLOTS
    return cell, cell // 2 - 1


def render(spec: Spec, size: int = 36, rng: random.Random | None = None) -> Image.Image:
    """One ground-truth image of `spec`: each object in its own cell of a 3 x 3 grid (so objects never touch,
    and the relation of two objects is the relation of their cells); unspecified colors drawn at random."""
    rng = rng or random.Random()
    cell, r = slot_geometry(size)
    cells = [(i, j) for i in range(SLOTS) for j in range(SLOTS)]
    for _ in range(1000):
        chosen = rng.sample(cells, len(spec.objects))
        placed = [Placed(o.shape, o.color or rng.choice(list(COLORS)), cell * i + cell // 2, cell * j + cell // 2, r)
                  for o, (i, j) in zip(spec.objects, chosen)]
        if spec.relation and not relation_holds(placed[0], placed[1], spec.relation, margin=cell / 2):
            continue
        img = Image.new("RGB", (size, size), BACKGROUND)
        d = ImageDraw.Draw(img)
        for p in placed:
            _draw(d, p)
        return img
    raise RuntimeError(f"could not place {spec} on a {size}px canvas")


def to_tensor(img: Image.Image):
    """PIL RGB -> float tensor [3, H, W] in [-1, 1]."""
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0).permute(2, 0, 1)


def to_uint8(x) -> np.ndarray:
    """Tensor [3, H, W] (or [N, 3, H, W]) in [-1, 1] -> uint8 array [H, W, 3] (or [N, H, W, 3])."""
    arr = ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return arr.movedim(-3, -1).cpu().numpy()


class ShapesTask:
    """The shapes world as a task (task.name=shapes): trains on one split of texts, evaluates on another.

    kwargs: balanced (default True) draws each training prompt's category uniformly, then a text of it; the
    texts themselves are far from balanced (3/4 of them are color attribution), like the benchmark is."""

    def __init__(self, cfg, balanced: bool = True):
        self.train = prompts(cfg.split)
        self.by_category: dict[str, list] = {}
        for p in self.train:
            self.by_category.setdefault(p.spec.category, []).append(p)
        self.categories = sorted(self.by_category) if balanced else []
        self.eval = balanced_prompts(cfg.eval_split, cfg.eval_prompts, seed=1234)

    def _draw(self, rng):
        if self.categories:
            texts = self.by_category[self.categories[rng.randrange(len(self.categories))]]
            return texts[rng.randrange(len(texts))]
        return self.train[rng.randrange(len(self.train))]

    def sample(self, n, rng):
        return [{"prompt": p.text, "category": p.spec.category} for p in (self._draw(rng) for _ in range(n))]

    def eval_examples(self):
        return [{"prompt": p.text, "category": p.spec.category} for p in self.eval]
