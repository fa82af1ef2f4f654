"""VLM judges: a Qwen-VL checkpoint (any folder `AutoModelForImageTextToText.from_pretrained` reads: Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, e.g. UnifiedReward or UnifiedReward-Think) asked about generated images or videos.

    VLMJudge            pairwise: `(outputs_a [P, ...], outputs_b, examples) -> verdicts [P]` in {+1, 0, -1};
                        mmrl/rollout/pairwise.py turns them into group win rates (Pref-GRPO).
    UnifiedRewardScore  pointwise reward: `(outputs [N, ...], examples) -> {"overall": [N], ..., "parsed": [N]}`.

Outputs are images [N, 3, H, W] or videos [N, 3, F, H, W] in [-1, 1]; each example's caption is its "prompt".
A prompt style (PAIRWISE_STYLES, POINTWISE_STYLES) names the instruction text, how the outputs are shown (one
image, a video input, or video frames as images) and how the answer is read. The UnifiedReward styles use the
public prompts verbatim (rewards/unified_reward_prompts.py says where each comes from): a judge model answers
well only in the format it was trained on. Both judges run on ChatVLM: the model loads on first use, each
sample is one user turn (media first, then the text, as in every public UnifiedReward script), decoding is
greedy, batched with left padding, batch_size turns per `generate`, so an answer is a function of its inputs.
Unreadable answers never become a score: a pairwise one is a tie (0), a pointwise one is NaN (the reward
runner marks the sample invalid); both are counted in `unparseable`.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

import torch

from mmrl.errors import ConfigError
from mmrl.registry import Registry
from rewards import unified_reward_prompts as ur

log = logging.getLogger(__name__)

JUDGE_PROMPT = (
    "You will see two images generated from the same caption. Compare them on how faithfully each follows the "
    "caption (objects, counts, colors, positions), then on visual quality. Give each image a score from 1 to 10 "
    "for every aspect you consider, add the scores up, and reason step by step inside <think> </think>. Then "
    "write your verdict inside <answer> </answer>: exactly 'Image 1 is better' or 'Image 2 is better'.\n"
    "Caption: {caption}")


# ----------------------------------------------------------------------------------------------- styles
@dataclass(frozen=True)
class PairwiseStyle:
    """prompt: format string with {caption}. media: "image" (one image each), "video" (one video input each)
    or "frames" (`frames` frames of each video as images, a's first). noun: the answer says "<noun> 1 is better".
    require_answer: only an <answer> block counts (the Think models' format; no block is a tie)."""

    prompt: str
    media: str = "image"
    noun: str = "image"
    require_answer: bool = False
    frames: int = 8


@dataclass(frozen=True)
class PointwiseStyle:
    """prompt: format string with {caption}. media: as PairwiseStyle. scores: {name: regex with one number
    group}; every score must be found, in [lo, hi], for an answer to count. frames: for media "frames"."""

    prompt: str
    scores: dict
    lo: float
    hi: float
    media: str = "image"
    frames: int = 16


_NUM = r"\**\s*(\d+(?:\.\d+)?)"  # a plain decimal, perhaps in markdown bold ("**4.5**")
_FINAL = {"score": r"final\s*score\s*[:：]\s*" + _NUM}


def _named(*names: str) -> dict:  # "Alignment Score (1-5): 3.2"
    return {n: rf"{n}\s*score\s*(?:\(1-5\))?\s*[:：]\s*" + _NUM for n in names}


# name -> style; the UnifiedReward texts are the public ones (rewards/unified_reward_prompts.py)
PAIRWISE_STYLES = Registry("pairwise judge style", {
    "default": PairwiseStyle(JUDGE_PROMPT),
    "unified_reward": PairwiseStyle(ur.UR_PAIR),
    "unified_reward_think": PairwiseStyle(ur.UR_THINK, require_answer=True),
    "unified_reward_think_video": PairwiseStyle(ur.UR_THINK_VIDEO, "video", "video", require_answer=True),
    "unified_reward_think_qwen3": PairwiseStyle(ur.UR_THINK_QWEN3, require_answer=True),
    "unified_reward_think_qwen3_video": PairwiseStyle(ur.UR_THINK_QWEN3_VIDEO, "frames", "video",
                                                        require_answer=True, frames=8),
})
POINTWISE_STYLES = Registry("pointwise judge style", {
    "unified_reward": PointwiseStyle(ur.UR_POINT, _FINAL, 1, 5),
    "unified_reward_video": PointwiseStyle(ur.UR_POINT_VIDEO, _FINAL, 1, 10, "video"),
    "unified_reward_2": PointwiseStyle(ur.UR2_POINT, _named("alignment", "coherence", "style"), 1, 5),
    "unified_reward_2_video": PointwiseStyle(ur.UR2_POINT_VIDEO, _named("alignment", "physics", "style"), 1, 5,
                                             "frames", frames=16),
})


# ---------------------------------------------------------------------------------------------- parsers
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_VERDICTS = {noun: re.compile(rf"{noun}\s*([12])\s*is\s*(?:the\s*)?better", re.IGNORECASE)
             for noun in ("image", "video")}


_FIRST_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
VERDICT_READINGS = ("mmrl", "reference")


def parse_verdict(text: str, noun: str = "image", require_answer: bool = False, reading: str = "mmrl") -> int:
    """+1 ("Image 1 is better"), -1 (Image 2), 0 (tie, no answer, or both named). Never raises on a string.

    reading "mmrl": the last <answer> block decides (any case, "is the better" too); without one (and unless
    require_answer), the text after the last </think> (or the whole text) must contain exactly one verdict.
    reading "reference": Pref-GRPO's (CodeGoat24/Pref-GRPO, `_pairwise_win_rate` / `_extract_answer`): the first
    <answer> block, stripped, case-sensitive: "Image 1 is better" in it wins, else "Image 2 is better", else a tie;
    no block is a tie. noun: "image" or "video"."""
    if not isinstance(text, str):
        return 0
    if reading == "reference":
        block = _FIRST_ANSWER.search(text)
        answer = block.group(1).strip() if block else ""
        first, second = (f"{noun.capitalize()} {k} is better" for k in (1, 2))
        return 1 if first in answer else -1 if second in answer else 0
    if reading != "mmrl":
        raise ValueError(f"verdict reading {reading!r}: use one of {VERDICT_READINGS}")
    blocks = _ANSWER.findall(text)
    if require_answer and not blocks:
        return 0
    body = blocks[-1] if blocks else text.rsplit("</think>", 1)[-1]
    named = set(_VERDICTS[noun].findall(body))
    if len(named) != 1:
        return 0
    return 1 if named.pop() == "1" else -1


def parse_scores(text: str, style: PointwiseStyle) -> dict[str, float] | None:
    """{score name: value} read from a pointwise answer (the last match of each score's pattern), or None when
    a score is missing or outside [style.lo, style.hi]. Never raises on a string.

    >>> parse_scores("subject (object): 1\\nFinal Score: 4.5", POINTWISE_STYLES["unified_reward"])
    {'score': 4.5}
    """
    if not isinstance(text, str):
        return None
    out = {}
    for name, pattern in style.scores.items():
        found = re.findall(pattern, text, re.IGNORECASE)
        value = float(found[-1]) if found else math.nan
        if not style.lo <= value <= style.hi:  # also False for NaN and inf
            return None
        out[name] = value
    return out


# ---------------------------------------------------------------------------------------- media + model
def to_pil(img: torch.Tensor):
    """An image [3, H, W] in [-1, 1] (any device) as a PIL RGB image."""
    from PIL import Image

    x = ((img.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return Image.fromarray(x.permute(1, 2, 0).cpu().numpy())


def video_frames(video: torch.Tensor) -> torch.Tensor:
    """A video [3, F, H, W] in [-1, 1] as the processor's frames [F, 3, H, W], float 0..255 on the CPU."""
    return ((video.detach().float().clamp(-1, 1) + 1) * 127.5).round().permute(1, 0, 2, 3).cpu()


def frame_images(video: torch.Tensor, n: int) -> list:
    """n frames of a video [3, F, H, W], evenly spaced from first to last (as the public scripts sample), as PIL."""
    idx = torch.linspace(0, video.shape[1] - 1, min(n, video.shape[1])).long().tolist()
    return [to_pil(video[:, i]) for i in idx]


def show(output: torch.Tensor, media: str, frames: int) -> list:
    """One output (image [3, H, W] or video [3, F, H, W]) as the media items of a user turn."""
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"a VLM judge scores images or videos (tensors); got {type(output).__name__} outputs")
    want = 3 if media == "image" else 4
    if output.dim() != want:
        kind = "images [N, 3, H, W]" if media == "image" else "videos [N, 3, F, H, W]"
        raise ConfigError(f"this judge style shows {media} inputs and takes {kind}; got outputs of shape "
                          f"[N, {', '.join(map(str, output.shape))}]: pick a style for this modality")
    if media == "image":
        return [to_pil(output)]
    if media == "video":
        return [video_frames(output)]
    return frame_images(output, frames)


def caption(example) -> str:
    return example if isinstance(example, str) else example["prompt"]


class ChatVLM:
    """A Qwen-VL folder answering user turns greedily. A turn is (media, text): media a list of PIL images and
    video frame tensors [F, 3, H, W] (0..255), shown in order before the text.

    min_pixels / max_pixels: forwarded to the processor when set. Video inputs: `clip_fps` is the frame rate of
    the given clips (the generator's, e.g. 16 for Wan); their frames are then sampled uniformly at `video_fps`
    (2, the rate the public scripts' qwen-vl-utils samples at; at least 4 frames, an even count) and the processor
    is told that rate (Qwen2.5-VL / Qwen3-VL read time from it). Without clip_fps every frame is shown and the
    processor is told `video_fps`: set it to the clips' rate then. trust_remote_code stays off unless asked."""

    def __init__(self, path: str, device: str = "cpu", dtype: str = "float32", max_new_tokens: int = 512,
                 min_pixels: int | None = None, max_pixels: int | None = None, trust_remote_code: bool = False,
                 video_fps: float = 2.0, clip_fps: float | None = None):
        self.path, self.device, self.dtype, self.max_new_tokens = path, device, getattr(torch, dtype), max_new_tokens
        self.pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v}
        self.trust_remote_code, self.video_fps, self.clip_fps = trust_remote_code, video_fps, clip_fps
        self.model = self.processor = None

    def load(self):
        if self.model is None:
            from mmrl.policy.token import load_token_model

            model, proc = load_token_model(self.path, self.dtype, self.device, self.trust_remote_code)
            if not hasattr(proc, "image_processor"):
                raise ConfigError(f"judge path {self.path!r} is a text-only model; an image/video judge needs a VLM")
            proc.tokenizer.padding_side = "left"  # generation continues every row at its end
            self.model, self.processor = model.eval(), proc
        return self.model, self.processor

    def encode(self, turns: list[tuple[list, str]]):
        """The processor's batch for the turns (left-padded), on the device."""
        _, proc = self.load()
        texts, images, videos = [], [], []
        for media, text in turns:
            content = [{"type": "video"} if isinstance(m, torch.Tensor) else {"type": "image"} for m in media]
            msgs = [{"role": "user", "content": content + [{"type": "text", "text": text}]}]
            texts.append(proc.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
            images += [m for m in media if not isinstance(m, torch.Tensor)]
            videos += [self.sampled(m) for m in media if isinstance(m, torch.Tensor)]
        kw = dict(self.pixels)
        if images:
            kw["images"] = images
        if videos:
            meta = [{"fps": self.video_fps, "frames_indices": list(range(len(v))), "total_num_frames": len(v)}
                    for v in videos]
            kw.update(videos=videos, video_metadata=meta, do_sample_frames=False)
        return proc(text=texts, padding=True, return_tensors="pt", **kw).to(self.device)

    def sampled(self, frames: torch.Tensor) -> torch.Tensor:
        """A clip's frames [F, 3, H, W] sampled at video_fps when its own rate (clip_fps) is known."""
        if not self.clip_fps:
            return frames
        from rewards.vlm_reward_models import frame_indices

        return frames[frame_indices(len(frames), None, self.video_fps, self.clip_fps)]

    @torch.no_grad()
    def generate(self, turns: list[tuple[list, str]], batch_size: int) -> list[str]:
        """The decoded answers, batch_size turns per `generate` call."""
        model, proc = self.load()
        answers = []
        for s in range(0, len(turns), batch_size):
            batch = self.encode(turns[s:s + batch_size])
            out = model.generate(**batch, max_new_tokens=self.max_new_tokens, do_sample=False,
                                 pad_token_id=proc.tokenizer.pad_token_id)                 # [b, P + T]
            answers += self.decode(out[:, batch["input_ids"].shape[1]:])
        return answers

    def decode(self, ids: torch.Tensor) -> list[str]:
        """Answers [b, T] as text, each cut at its first end or pad token. Other special tokens are kept: a
        tokenizer may mark <think> / <answer> special, and the answer's parser needs them."""
        model, proc = self.load()
        ends = model.generation_config.eos_token_id
        stop = {proc.tokenizer.pad_token_id, proc.tokenizer.eos_token_id,
                *(ends if isinstance(ends, (list, tuple)) else [ends])} - {None}
        rows = [next((row[:i] for i, t in enumerate(row) if t in stop), row) for row in ids.cpu().tolist()]
        return proc.batch_decode(rows, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------- judges
class VLMJudge:
    """`(outputs_a [P, 3, H, W] or [P, 3, F, H, W] in [-1, 1], outputs_b, examples) -> verdicts [P]`.

    style: a PAIRWISE_STYLES name ("default": mmrl's own prompt; "unified_reward_think" for UnifiedReward-Think-
    qwen-7b; "unified_reward_think_qwen3" for the Qwen3-VL Think models, as Pref-GRPO uses them; ...). prompt:
    replaces the style's text (a format string with {caption}); the style's media and parsing stay.
    max_new_tokens: room for the reasoning and the answer. num_frames: frames per video for "frames" styles
    (default: the style's). reading: how an answer is read (`parse_verdict`): "mmrl" (the last <answer> block, any
    case, an answer naming both is a tie) or "reference" (Pref-GRPO's: the first block, case-sensitive, "Image 1"
    before "Image 2"). The rest as ChatVLM.
    """

    def __init__(self, path: str, max_new_tokens: int = 512, batch_size: int = 8, device: str = "cpu",
                 dtype: str = "float32", prompt: str | None = None, style: str = "default",
                 min_pixels: int | None = None, max_pixels: int | None = None, trust_remote_code: bool = False,
                 num_frames: int | None = None, video_fps: float = 2.0, clip_fps: float | None = None,
                 reading: str = "mmrl"):
        if reading not in VERDICT_READINGS:
            raise ConfigError(f"reading={reading!r}: use one of {VERDICT_READINGS} (reference: Pref-GRPO's)")
        self.style, self.reading = PAIRWISE_STYLES[style], reading
        self.prompt, self.batch_size = prompt or self.style.prompt, batch_size
        self.frames = num_frames or self.style.frames
        self.vlm = ChatVLM(path, device, dtype, max_new_tokens, min_pixels, max_pixels, trust_remote_code, video_fps,
                           clip_fps)
        self.unparseable = 0
        self.last_texts: list[str] = []

    @property
    def model(self):
        return self.vlm.load()[0]

    @property
    def processor(self):
        return self.vlm.load()[1]

    def turns(self, outputs_a, outputs_b, examples) -> list[tuple[list, str]]:
        m, f = self.style.media, self.frames
        return [(show(a, m, f) + show(b, m, f), self.prompt.format(caption=caption(ex)))
                for a, b, ex in zip(outputs_a, outputs_b, examples)]

    def inputs(self, outputs_a, outputs_b, examples):
        """The processor's batch: one chat per pair (output a, output b, instruction with the caption)."""
        return self.vlm.encode(self.turns(outputs_a, outputs_b, examples))

    def __call__(self, outputs_a, outputs_b, examples) -> torch.Tensor:
        self.last_texts = self.vlm.generate(self.turns(outputs_a, outputs_b, examples), self.batch_size)
        verdicts = [parse_verdict(t, self.style.noun, self.style.require_answer, self.reading) for t in self.last_texts]
        bad = sum(v == 0 for v in verdicts)
        if bad:
            self.unparseable += bad
            log.info("judge: %d of %d answers named no single winner (ties)", bad, len(verdicts))
        return torch.tensor(verdicts, dtype=torch.float32)


class UnifiedRewardScore:
    """A pointwise VLM judge as a reward: `(outputs [N, 3, H, W] or [N, 3, F, H, W] in [-1, 1], examples) ->
    {"overall": [N], <each score of the style>: [N] (raw, e.g. 1..5), "parsed": [N] (1 read, 0 not)}`.

    overall = scale * (weighted mean of the style's scores); an answer without every score in range is NaN in
    overall and the scores (the reward runner marks the sample invalid) and is counted in `unparseable`.

    style: a POINTWISE_STYLES name: "unified_reward" (UnifiedReward-qwen-*, "Final Score: x" in 1..5, the default),
    "unified_reward_video" (the same models on a video input, 1..10), "unified_reward_2" (UnifiedReward-2.0:
    alignment / coherence / style in 1..5), "unified_reward_2_video" (alignment / physics / style, 16 frames as
    images). prompt: replaces the style's text ({caption}). scale: default 1 / the style's top score, so a
    perfect answer gives 1 (flow_grpo's unifiedreward_score_sglang divides its 1..5 score by 5). weights:
    {score name: w} for overall (default equal). num_frames: frames for "frames" styles. The rest as ChatVLM.
    """

    def __init__(self, path: str, device: str = "cpu", dtype: str = "float32", batch_size: int = 8,
                 max_new_tokens: int = 512, style: str = "unified_reward", prompt: str | None = None,
                 scale: float | None = None, weights: dict | None = None, min_pixels: int | None = None,
                 max_pixels: int | None = None, num_frames: int | None = None, video_fps: float = 2.0,
                 clip_fps: float | None = None, trust_remote_code: bool = False):
        self.style = POINTWISE_STYLES[style]
        unknown = set(weights or {}) - set(self.style.scores)
        if unknown:
            raise ConfigError(f"weights name {sorted(unknown)}, not scores of style {style!r}: "
                              f"{sorted(self.style.scores)}")
        self.weights = {k: float((weights or {}).get(k, 1.0)) for k in self.style.scores}
        if min(self.weights.values()) < 0 or sum(self.weights.values()) <= 0:
            raise ConfigError(f"weights must be >= 0 with a positive sum; got {self.weights}")
        self.prompt, self.batch_size = prompt or self.style.prompt, batch_size
        self.scale = 1.0 / self.style.hi if scale is None else scale
        self.frames = num_frames or self.style.frames
        self.vlm = ChatVLM(path, device, dtype, max_new_tokens, min_pixels, max_pixels, trust_remote_code, video_fps,
                           clip_fps)
        self.unparseable = 0
        self.last_texts: list[str] = []

    def turns(self, outputs, examples) -> list[tuple[list, str]]:
        return [(show(o, self.style.media, self.frames), self.prompt.format(caption=caption(ex)))
                for o, ex in zip(outputs, examples)]

    def __call__(self, outputs, examples) -> dict[str, torch.Tensor]:
        self.last_texts = self.vlm.generate(self.turns(outputs, examples), self.batch_size)
        parsed = [parse_scores(t, self.style) for t in self.last_texts]
        nan = dict.fromkeys(self.style.scores, math.nan)
        cols = {k: torch.tensor([(p or nan)[k] for p in parsed], dtype=torch.float32) for k in self.style.scores}
        total = sum(self.weights.values())
        overall = self.scale * sum(w * cols[k] for k, w in self.weights.items()) / total
        bad = sum(p is None for p in parsed)
        if bad:
            self.unparseable += bad
            log.info("unified_reward: %d of %d answers had no readable score (NaN: invalid samples)", bad, len(parsed))
        return {"overall": overall, **cols, "parsed": torch.tensor([float(p is not None) for p in parsed])}
