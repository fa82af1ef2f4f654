"""Pairwise judges (mmrl/rollout/pairwise.py turns their verdicts into group win rates).

VLMJudge: a Qwen-VL checkpoint (any folder `AutoModelForImageTextToText.from_pretrained` reads: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, e.g. UnifiedReward-Think) shown the caption and two images, asked to reason in
<think>...</think> and answer `<answer>Image 1 is better</answer>` or `<answer>Image 2 is better</answer>`.
Decoding is greedy by default, so a verdict is a function of its inputs. Unparseable answers are ties (0) and
are counted in `unparseable`.
"""

from __future__ import annotations

import logging
import re

import torch

log = logging.getLogger(__name__)

JUDGE_PROMPT = (
    "You will see two images generated from the same caption. Compare them on how faithfully each follows the "
    "caption (objects, counts, colors, positions), then on visual quality. Give each image a score from 1 to 10 "
    "for every aspect you consider, add the scores up, and reason step by step inside <think> </think>. Then "
    "write your verdict inside <answer> </answer>: exactly 'Image 1 is better' or 'Image 2 is better'.\n"
    "Caption: {caption}")

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_VERDICT = re.compile(r"image\s*([12])\s*is\s*(?:the\s*)?better", re.IGNORECASE)


def parse_verdict(text: str) -> int:
    """+1 (Image 1 is better), -1 (Image 2), 0 (tie, no answer, or both named). Never raises on a string.

    The last <answer> block decides; without one, the text after the last </think> (or the whole text) must
    contain exactly one verdict."""
    if not isinstance(text, str):
        return 0
    blocks = _ANSWER.findall(text)
    body = blocks[-1] if blocks else text.rsplit("</think>", 1)[-1]
    named = {m for m in _VERDICT.findall(body)}
    if len(named) != 1:
        return 0
    return 1 if named.pop() == "1" else -1


def _to_pil(img: torch.Tensor):
    from PIL import Image

    x = ((img.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [3, H, W] in [-1, 1]
    return Image.fromarray(x.permute(1, 2, 0).cpu().numpy())


class VLMJudge:
    """`(images_a [P, 3, H, W] in [-1, 1], images_b, examples) -> verdicts [P]`; the model loads on first use.

    path: a transformers Qwen-VL folder. max_new_tokens: room for the reasoning and the answer. min_pixels /
    max_pixels: forwarded to the image processor when set. trust_remote_code stays off unless asked.
    """

    def __init__(self, path: str, max_new_tokens: int = 512, batch_size: int = 8, device: str = "cpu",
                 dtype: str = "float32", prompt: str = JUDGE_PROMPT, min_pixels: int | None = None,
                 max_pixels: int | None = None, trust_remote_code: bool = False):
        self.path, self.max_new_tokens, self.batch_size = path, max_new_tokens, batch_size
        self.device, self.dtype, self.prompt = device, getattr(torch, dtype), prompt
        self.pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
        self.trust_remote_code = trust_remote_code
        self.model = self.processor = None
        self.unparseable = 0
        self.last_texts: list[str] = []

    def _load(self):
        if self.model is None:
            from mmrl.policy.vlm import load_token_model

            self.model, self.processor = load_token_model(self.path, self.dtype, self.device, self.trust_remote_code)
            if not hasattr(self.processor, "image_processor"):
                raise ValueError(f"judge path {self.path!r} is a text-only model; a pairwise image judge needs a VLM")
            self.model.eval()
            self.processor.tokenizer.padding_side = "left"  # generation continues every row at its end
        return self.model, self.processor

    def inputs(self, images_a, images_b, examples) -> dict:
        """The processor's batch: one chat per pair (image 1, image 2, instruction with the caption)."""
        _, proc = self._load()
        texts, images = [], []
        for a, b, ex in zip(images_a, images_b, examples):
            caption = ex if isinstance(ex, str) else ex["prompt"]
            msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                 {"type": "text", "text": self.prompt.format(caption=caption)}]}]
            texts.append(proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
            images.append([_to_pil(a), _to_pil(b)])
        return proc(text=texts, images=images, padding=True, return_tensors="pt", **self.pixels).to(self.device)

    @torch.no_grad()
    def __call__(self, images_a, images_b, examples) -> torch.Tensor:
        model, proc = self._load()
        verdicts, self.last_texts = [], []
        for s in range(0, len(examples), self.batch_size):
            batch = self.inputs(images_a[s:s + self.batch_size], images_b[s:s + self.batch_size],
                                examples[s:s + self.batch_size])
            out = model.generate(**batch, max_new_tokens=self.max_new_tokens, do_sample=False,
                                 pad_token_id=proc.tokenizer.pad_token_id)
            texts = proc.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
            self.last_texts += texts
            verdicts += [parse_verdict(t) for t in texts]
        bad = sum(v == 0 for v in verdicts)
        if bad:
            self.unparseable += bad
            log.info("judge: %d of %d answers named no single winner (ties)", bad, len(verdicts))
        return torch.tensor(verdicts, dtype=torch.float32)
