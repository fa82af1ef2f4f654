"""OCR reward for text rendering (the Flow-GRPO OCR task): read the image with RapidOCR (PP-OCR models in
ONNX, shipped inside the `rapidocr_onnxruntime` wheel, so it runs offline) and compare with the text the prompt
asks for, the part between quotes: 'a sign that says "OPEN"' -> OPEN.

    reward = max(0, 1 - levenshtein(read, target) / len(target))     on lower-cased text without spaces

Images [N, 3, H, W] in [-1, 1]; components: "overall" and "found" (1 when OCR read anything). A prompt with no
quoted text raises (it cannot be scored; the reward runner counts it as a failed sample).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from mmrl.errors import ConfigError

_QUOTED = re.compile(r"[\"“”'‘’](.+?)[\"“”'‘’]")


def target_text(prompt: str) -> str:
    m = _QUOTED.findall(prompt)
    if not m:
        raise ConfigError(f"OCR reward: the prompt names no quoted text to render: {prompt!r}")
    return " ".join(m)


def levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _norm(s: str) -> str:
    return re.sub(r"\s+", "", s).lower()


def ocr_score(read: str, target: str) -> float:
    t = _norm(target)
    return max(0.0, 1.0 - levenshtein(_norm(read), t) / max(len(t), 1))


class OCRReward:
    def __init__(self, min_confidence: float = 0.0):
        self.min_confidence, self.engine = min_confidence, None

    def read(self, img: np.ndarray) -> str:
        """The text of one uint8 image [H, W, 3], boxes in reading order (top to bottom, left to right)."""
        if self.engine is None:
            from rapidocr_onnxruntime import RapidOCR

            self.engine = RapidOCR()
        res, _ = self.engine(img)
        boxes = sorted(res or [], key=lambda r: (round(min(p[1] for p in r[0]) / 8), min(p[0] for p in r[0])))
        return " ".join(r[1] for r in boxes if r[2] >= self.min_confidence)

    def __call__(self, images: torch.Tensor, examples) -> dict[str, torch.Tensor]:
        targets = [target_text(e if isinstance(e, str) else e["prompt"]) for e in examples]
        u8 = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        texts = [self.read(np.ascontiguousarray(im)) for im in u8]
        return {"overall": torch.tensor([ocr_score(r, t) for r, t in zip(texts, targets)]),
                "found": torch.tensor([float(bool(r.strip())) for r in texts])}
