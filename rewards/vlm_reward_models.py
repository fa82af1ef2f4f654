"""Reward models on a Qwen2-VL backbone: a reward head read at special tokens' last hidden states.

- hpsv3 (Qwen2-VL-7B-Instruct): rm_head.{0,3,5} = Linear(D, 1024) ReLU Linear(1024, 16) ReLU Linear(16, 2) at
  <|Reward|> -> {"overall": mu, "sigma": exp(log sigma)}.
- video_align (Qwen2-VL-2B-Instruct): rm_head.weight = Linear(D, 1, bias=False) at <|VQ_reward|>, <|MQ_reward|>,
  <|TA_reward|> -> {"VQ", "MQ", "TA"} standardized, "overall" = their weighted sum.

HPSv3 (Ma et al. 2025; github.com/MizzenAI/HPSv3) and VideoAlign's VideoReward (Liu et al. 2025,
arXiv 2501.13918; github.com/KwaiVGI/VideoAlign) append their reward tokens to the user prompt (added to the
tokenizer as special tokens, rows appended to the embedding), run the backbone once, and apply the head to the last
hidden state at each token. Their forward embeds the vision features but calls the text model without M-RoPE
positions, so every token gets the sequential position 0..L-1 on all three rotary sections (transformers 4.45, which
they pin); that is what the models were trained with and what is computed here. Prompts are right-padded as there.

Weights (local files; no hub here):
- `path`: a transformers Qwen2-VL folder (config, processor, tokenizer, weights), read with from_pretrained
  (safetensors, trust_remote_code off). Either the base model together with `checkpoint`, or a folder that already
  holds the reward model: the reward tokens in its tokenizer and the `rm_head.*` tensors in its safetensors.
- `checkpoint`: the released file, whose backbone replaces the base weights and which holds the head.
  HPSv3: HPSv3.safetensors (the whole model; transformers-4.45 key names `visual.*`, `model.*`, renamed here).
  VideoAlign: the VideoReward folder (model_config.json + checkpoint-*/model.pth) or its model.pth: a PEFT
  state dict (`base_model.model.*`, LoRA on the text model) whose LoRA is merged here, W + alpha/r * B @ A; the
  LoRA scale, the frame sampling and the standardization are read from model_config.json when it is there.
A folder without the head refuses to load (the missing keys are named) unless `random_head: true` (tests, smoke).

Images [N, 3, H, W] / videos [N, 3, F, H, W] in [-1, 1] are resized in torch (bicubic, antialiased, to qwen-vl-utils'
`smart_resize` size) and given to the folder's processor, which normalizes and patchifies them. Heads run in fp32.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from typing import Callable

import torch
import torch.nn.functional as F

from mmrl.errors import ConfigError, MissingFile
from rewards.clip_models import _prompts, load_state

# hpsv3/dataset/data_collator_qwen.py (MizzenAI/HPSv3): INSTRUCTION.format(text_prompt=...) + prompt_with_special_token
HPSV3_INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


"""
HPSV3_SUFFIX = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"

# prompt_template.py (KwaiVGI/VideoAlign): DETAILED_PROMPT_WITH_SPECIAL_TOKEN, the "detailed_special" template
VIDEOALIGN_PROMPT = """
You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 being the worst and 10 being the best. Each evaluation should be independent of the others.

**Visual Quality:**  
Evaluate the overall visual quality of the video, with a focus on static factors. The following sub-dimensions should be considered:
- **Reasonableness:** The video should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

Please provide the ratings of Visual Quality: <|VQ_reward|>
END

**Motion Quality:**  
Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following sub-dimensions:
- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing body parts).
- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, mouth movements).
- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.
- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally with the background, without obvious artifacts or the feeling of cut-and-paste effects.
- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the video might have blurry or unsteady sections that hinder visual continuity.
- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion quality.

Please provide the ratings of Motion Quality: <|MQ_reward|>
END

**Text Alignment:**  
Assess how well the video matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, scale, and direction.
- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking if real-world locations or scenes are accurately represented, though some stylistic adaptation is acceptable.  
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the video adheres to this style.
- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) are consistent with the expected behavior from the prompt.

Textual prompt - {text_prompt}
Please provide the ratings of Text Alignment: <|TA_reward|>
END
"""

DIMENSIONS = ("VQ", "MQ", "TA")
VIDEO_MIN_PIXELS = 128 * 28 * 28  # qwen-vl-utils' per-frame floor (VideoAlign's messages set only max_pixels)


# ------------------------------------------------------------------------------------------- preprocessing
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """qwen-vl-utils' resize rule: both sides multiples of `factor`, area within [min_pixels, max_pixels], aspect
    ratio kept (Python's round: halves to even, as there)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above Qwen-VL's limit of 200")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = math.floor(height / beta / factor) * factor, math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def resize_frames(x: torch.Tensor, factor: int, min_pixels: int, max_pixels: int) -> torch.Tensor:
    """[n, 3, H, W] in [-1, 1] -> [n, 3, h, w] in [0, 1] at smart_resize's size (bicubic, antialiased: the torch path
    of the public preprocessing; no uint8 rounding)."""
    size = smart_resize(*x.shape[-2:], factor, min_pixels, max_pixels)
    x = (x.detach().float().clamp(-1, 1) + 1) / 2
    if tuple(x.shape[-2:]) == size:
        return x
    return F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True).clamp(0, 1)


def frame_indices(total: int, num_frames: int | None, fps: float, video_fps: float | None,
                  min_frames: int = 4, max_frames: int = 768) -> list[int]:
    """Uniform frame sampling of VideoAlign's vision_process.py (smart_nframes, sample_type "uniform"): `num_frames`
    rounded to even, else total / video_fps * fps clamped to [min_frames, min(max_frames, total)] and rounded to
    even; indices linspace(0, total - 1, n).round()."""
    if num_frames is not None:
        n = round(num_frames / 2) * 2
    else:
        if not video_fps:
            raise ConfigError("video_align samples frames at `fps` of the source video: pass video_fps (the "
                              "generator's frame rate), or num_frames")
        lo, hi = math.ceil(min_frames / 2) * 2, math.floor(min(max_frames, total) / 2) * 2
        n = round(min(max(total / video_fps * fps, lo), hi) / 2) * 2
    n = min(n, total)
    if not 2 <= n <= total:
        raise ConfigError(f"video_align needs 2 <= sampled frames <= {total}; got {n} (videos of >= 2 frames)")
    return torch.linspace(0, total - 1, n).round().long().tolist()


# ------------------------------------------------------------------------------------------- checkpoints
def current_qwen2vl_key(key: str) -> str:
    """Qwen2-VL keys of transformers < 4.52 (`visual.*`, `model.*` = the text model) -> today's (`model.visual.*`,
    `model.language_model.*`); other keys (lm_head, rm_head, current names) pass unchanged."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model.") and not key.startswith(("model.visual.", "model.language_model.")):
        return "model.language_model." + key[len("model."):]
    return key


def merge_lora(state: dict, scale: float) -> dict:
    """A PEFT state dict (`base_model.model.` prefix, `<m>.base_layer.weight` + `<m>.lora_A/B.<adapter>.weight`) ->
    a plain one with W = W_base + scale * B @ A (scale = lora_alpha / r, or / sqrt(r) with rsLoRA). Merged in fp32."""
    state = {k[len("base_model.model."):] if k.startswith("base_model.model.") else k: v for k, v in state.items()}
    lora: dict[str, dict[str, list]] = {}  # module -> {"A": [key], "B": [key]}
    for k in state:
        m = re.fullmatch(r"(.*)\.lora_([AB])\.[^.]+\.weight", k)
        if m:
            lora.setdefault(m[1], {"A": [], "B": []})[m[2]].append(k)
        elif ".lora_" in k:
            raise ConfigError(f"unsupported LoRA tensor {k!r}: only linear lora_A / lora_B merge")
    out = {}
    for k, v in state.items():
        m = None if ".lora_" in k else re.fullmatch(r"(.*)\.base_layer\.(weight|bias)", k)
        if m is None:
            if ".lora_" not in k:
                out[k] = v
            continue
        prefix, kind = m.groups()
        if kind == "weight":
            ab = lora.pop(prefix, {"A": [], "B": []})
            if len(ab["A"]) != 1 or len(ab["B"]) != 1:
                raise ConfigError(f"{prefix}: expected one LoRA adapter (lora_A / lora_B), found {ab}")
            v = (v.float() + scale * state[ab["B"][0]].float() @ state[ab["A"][0]].float()).to(v.dtype)
        out[f"{prefix}.{kind}"] = v
    if lora:
        raise ConfigError(f"LoRA weights of modules without a base_layer: {sorted(lora)[:4]}")
    return out


def _folder_tensors(path: str, prefix: str) -> dict:
    """The tensors under `prefix` in a folder's *.safetensors files (keys kept)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys() if k.startswith(prefix)})
    return out


# ------------------------------------------------------------------------------------------- shared scorer
class QwenVLScorer:
    """Qwen2-VL + a reward head applied at the last hidden state of each reward token, in the tokens' order.

    `make_head(hidden_size, head_state or None) -> nn.Module` builds the head (keys without the `rm_head.` prefix);
    `head_keys` are the keys a checkpoint must hold. `checkpoint_state()` returns the released checkpoint as a plain
    state dict in today's key names (None: the folder is the reward model, its safetensors hold rm_head.*). Calling
    it with T texts and images or videos gives [T, n_tokens * head_outputs] fp32 on CPU."""

    def __init__(self, path: str, reward_tokens: tuple[str, ...], make_head: Callable, head_keys: tuple[str, ...],
                 checkpoint_state: Callable[[], dict] | None = None, device: str = "cpu",
                 dtype: str = "float32", batch_size: int = 8, random_head: bool = False, name: str = "vlm reward"):
        if not os.path.isdir(path):
            raise MissingFile(f"{name}: path={path!r} is not a folder; give a transformers Qwen2-VL folder")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"{name}: dtype={dtype!r}; valid: float32, bfloat16, float16")
        self.path, self.reward_tokens, self.make_head, self.head_keys = path, reward_tokens, make_head, head_keys
        self.checkpoint_state, self.device, self.dtype = checkpoint_state, device, getattr(torch, dtype)
        self.batch_size, self.random_head, self.name = batch_size, random_head, name
        self.model = None

    def load(self):
        """-> (Qwen2VLForConditionalGeneration, processor, head); loaded once."""
        if self.model is not None:
            return self.model, self.processor, self.head
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        processor = AutoProcessor.from_pretrained(self.path)
        tok = processor.tokenizer
        tok.padding_side = "right"  # as the public code (with sequential positions a left shift would not matter)
        if self.checkpoint_state is None and not self.random_head and not all(
                t in tok.get_vocab() for t in self.reward_tokens):
            raise ConfigError(f"{self.name}: the tokenizer in {self.path} has no {', '.join(self.reward_tokens)}: this "
                              f"is a base Qwen2-VL folder; pass the released checkpoint as `checkpoint`")
        tok.add_special_tokens({"additional_special_tokens": list(self.reward_tokens)})  # the public code's step
        model = Qwen2VLForConditionalGeneration.from_pretrained(self.path, dtype=self.dtype, use_safetensors=True)
        if self.checkpoint_state is not None:
            state, source = self.checkpoint_state(), "the checkpoint"
        else:
            state, source = _folder_tensors(self.path, "rm_head."), self.path
        missing = [k for k in self.head_keys if "rm_head." + k not in state]
        if missing and not self.random_head:
            raise ConfigError(f"{self.name}: no reward head in {source} (missing "
                              f"{', '.join('rm_head.' + k for k in missing)}); pass the released checkpoint as "
                              f"`checkpoint`, or random_head: true for a smoke test (the scores are noise)")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # new token rows and a random head (tests) are the same at every load
            if model.get_input_embeddings().weight.shape[0] != len(tok):
                model.resize_token_embeddings(len(tok))
            head = self.make_head(model.config.text_config.hidden_size, None if missing else
                                  {k[len("rm_head."):]: v for k, v in state.items() if k.startswith("rm_head.")})
        if self.checkpoint_state is not None:
            self._load_backbone(model, state)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.head = head.float().to(self.device).eval().requires_grad_(False)
        self.processor, self.token_ids = processor, tok.convert_tokens_to_ids(list(self.reward_tokens))
        self.factor = processor.image_processor.patch_size * processor.image_processor.merge_size
        return self.model, self.processor, self.head

    def _load_backbone(self, model, state: dict) -> None:
        """The checkpoint's `model.*` tensors replace the backbone (lm_head is not used); all must be there."""
        sub = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
        emb = sub.get("language_model.embed_tokens.weight")
        rows = model.get_input_embeddings().weight.shape[0]  # = len(tokenizer) with the reward tokens
        if emb is not None and emb.shape[0] != rows:
            raise ConfigError(f"{self.name}: the checkpoint's embedding has {emb.shape[0]} rows, the tokenizer of "
                              f"{self.path} with {', '.join(self.reward_tokens)} has {rows}: is `path` the checkpoint's "
                              f"base model?")
        missing, unexpected = model.model.load_state_dict(sub, strict=False)
        if missing or unexpected:
            raise ConfigError(f"{self.name}: the checkpoint does not fit {self.path}'s Qwen2-VL: missing "
                              f"{missing[:4]}, unexpected {unexpected[:4]} ...")

    @torch.no_grad()
    def forward(self, batch: dict) -> torch.Tensor:
        """The processor's batch (on the device) -> head outputs [n, n_tokens * head_outputs] (fp32)."""
        ids = batch["input_ids"]  # [n, L]
        n, length = ids.shape
        at = []  # [n] position of each reward token
        for tok, tid in zip(self.reward_tokens, self.token_ids):
            hit = ids == tid  # [n, L]
            counts = hit.sum(1).tolist()
            if any(c != 1 for c in counts):
                raise ConfigError(f"{self.name}: {tok} must occur once per prompt; counts {counts} (a caption "
                                  f"containing the token?)")
            at.append(hit.int().argmax(1))
        pos = torch.arange(length, device=ids.device).view(1, 1, -1).expand(3, n, -1)  # sequential, as trained
        vision = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
                  if k in batch}
        h = self.model.model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=pos, use_cache=False,
                             **vision).last_hidden_state  # [n, L, D]
        rows = torch.arange(n, device=ids.device)
        picked = torch.stack([h[rows, a] for a in at], 1)  # [n, T, D]
        return self.head(picked.float()).reshape(n, -1)  # [n, T, out] -> [n, T * out]

    def __call__(self, texts: list[str], images: list | None = None, videos: list | None = None) -> torch.Tensor:
        """texts [T] (user prompts with the reward tokens) with one image [3, h, w] or video [f, 3, h, w] in [0, 1]
        each (already at a size that is a multiple of the patch grid) -> [T, n_tokens * head_outputs] on CPU."""
        _, proc, _ = self.load()
        kind = "image" if images is not None else "video"
        out = []
        for s in range(0, len(texts), self.batch_size):
            chats = [[{"role": "user", "content": [{"type": kind}, {"type": "text", "text": t}]}]
                     for t in texts[s:s + self.batch_size]]
            text = proc.apply_chat_template(chats, tokenize=False, add_generation_prompt=True)
            vis = ({"images": images[s:s + self.batch_size], "images_kwargs": {"do_rescale": False, "do_resize": False}}
                   if kind == "image" else
                   {"videos": videos[s:s + self.batch_size],
                    "videos_kwargs": {"do_rescale": False, "do_resize": False, "do_sample_frames": False,
                                      "cap_pixels_per_frame": False}})  # sampled and resized here
            batch = proc(text=text, padding=True, return_tensors="pt", **vis)
            batch = {k: v.to(self.device) for k, v in batch.items() if k != "mm_token_type_ids"}
            out.append(self.forward(batch).cpu())
        return torch.cat(out)


# ------------------------------------------------------------------------------------------- HPSv3
HPSV3_HEAD_KEYS = ("0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias")


def ranknet_head(hidden: int, state: dict | None) -> torch.nn.Module:
    """HPSv3's rm_head (rm_head_type "ranknet" without kwargs): Linear(D, 1024) ReLU Dropout Linear(1024, 16) ReLU
    Linear(16, 2); the indices 0 / 3 / 5 are the released keys (the Dropout, index 2, is inactive at inference)."""
    w1, w2, out = (state[f"{i}.weight"].shape[0] for i in (0, 3, 5)) if state else (1024, 16, 2)
    head = torch.nn.Sequential(torch.nn.Linear(hidden, w1), torch.nn.ReLU(), torch.nn.Identity(),
                               torch.nn.Linear(w1, w2), torch.nn.ReLU(), torch.nn.Linear(w2, out))
    if state:
        head.load_state_dict(state)
    return head


class HPSv3:
    """HPSv3: `(images [N, 3, H, W] in [-1, 1], examples) -> {"overall": mu [N], "sigma": [N]}`.

    The head's two outputs are the mean and the log standard deviation of the image's score under HPSv3's
    uncertainty-aware ranking loss (sigma = exp(second output), as in its trainer); mu is the score
    (hpsv3/inference.py: "miu and sigma. we select miu"). Each image is resized to min_pixels = max_pixels =
    `pixels` (256 * 28 * 28, i.e. 448 x 448 for a square image) and shown before the instruction with its caption.

    Args:
        path: a Qwen2-VL-7B-Instruct folder (with `checkpoint`), or a folder holding the whole reward model.
        checkpoint: HPSv3.safetensors (or a .pth / {"model": ...} file of the same state dict).
        device, dtype ("float32" | "bfloat16" | "float16"), batch_size: where, how and how many per forward.
        pixels: the resized image area (tests use a small one).
        random_head: allow a folder without the head (random head: scores are noise; tests, smoke runs).
    """

    def __init__(self, path: str, checkpoint: str | None = None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 8, pixels: int = 256 * 28 * 28, random_head: bool = False):
        self.checkpoint, self.pixels = checkpoint, pixels
        self.scorer = QwenVLScorer(path, ("<|Reward|>",), ranknet_head, HPSV3_HEAD_KEYS,
                                   self._checkpoint_state if checkpoint else None, device, dtype, batch_size,
                                   random_head, "hpsv3")

    def _checkpoint_state(self) -> dict:
        state = load_state(self.checkpoint)
        state = state.get("model", state)  # hpsv3/inference.py opens a {"model": ...} wrapper too
        return {current_qwen2vl_key(k): v for k, v in state.items()}

    @staticmethod
    def texts(examples) -> list[str]:
        return [HPSV3_INSTRUCTION.format(text_prompt=p) + HPSV3_SUFFIX for p in _prompts(examples)]

    def __call__(self, images: torch.Tensor, examples) -> dict[str, torch.Tensor]:
        if images.dim() != 4:
            raise ValueError(f"hpsv3 takes images [N, 3, H, W]; got shape {tuple(images.shape)}")
        self.scorer.load()
        x = resize_frames(images, self.scorer.factor, self.pixels, self.pixels).cpu()  # [N, 3, h, w] in [0, 1]
        out = self.scorer(self.texts(examples), images=list(x))  # [N, 2]: mu, log sigma
        return {"overall": out[:, 0], "sigma": out[:, 1].exp()}


# ------------------------------------------------------------------------------------------- VideoAlign
def linear_head(hidden: int, state: dict | None) -> torch.nn.Module:
    """VideoAlign's rm_head: Linear(D, output_dim=1, bias=False), applied at each of the three reward tokens."""
    head = torch.nn.Linear(hidden, state["weight"].shape[0] if state else 1, bias=False)
    if state:
        head.load_state_dict(state)
    if head.out_features != 1:
        raise ConfigError(f"video_align: rm_head has {head.out_features} outputs; the released model has 1 per token")
    return head


def videoreward_files(checkpoint: str) -> tuple[str, dict]:
    """The VideoReward folder (model_config.json + checkpoint-<step>/model.pth; the latest step, as the public
    loader) or its model.pth -> (model.pth, the parsed model_config.json or {} when absent)."""
    if os.path.isdir(checkpoint):
        steps = sorted(glob.glob(os.path.join(checkpoint, "checkpoint-*")), key=lambda p: int(p.rsplit("-", 1)[-1]))
        model = os.path.join(steps[-1], "model.pth") if steps else ""
        if not os.path.isfile(model):
            raise MissingFile(f"video_align: no checkpoint-<step>/model.pth in {checkpoint} (found {steps}); "
                              f"the adapter-only layout (adapter_model.safetensors) is not supported")
        roots = [checkpoint]
    else:
        model, roots = checkpoint, [os.path.dirname(checkpoint), os.path.dirname(os.path.dirname(checkpoint))]
    for r in roots:
        if os.path.isfile(os.path.join(r, "model_config.json")):
            with open(os.path.join(r, "model_config.json")) as f:
                return model, json.load(f)
    return model, {}


class VideoAlign:
    """VideoAlign's VideoReward: `(videos [N, 3, F, H, W] in [-1, 1], examples) -> {"overall", "VQ", "MQ", "TA"}`.

    VQ (visual quality), MQ (motion quality), TA (text alignment) are the head's outputs at <|VQ_reward|>,
    <|MQ_reward|>, <|TA_reward|>, standardized with the checkpoint's statistics ((raw - mean) / std from
    model_config.json's inference_config; raw without them, as the public inference; `normalize`);
    overall = sum_d weights[d] * d (the public "Overall" is the plain sum: weights 1, 1, 1). Frames are sampled
    uniformly at `fps` of the source video (video_fps: the generator's frame rate) or `num_frames`, and resized to
    at most `max_frame_pixels` (at least `min_frame_pixels`) per frame.

    Args:
        path: a Qwen2-VL-2B-Instruct folder (with `checkpoint`), or a folder holding the whole reward model.
        checkpoint: the VideoReward folder or its checkpoint-<step>/model.pth. model_config.json, when found, gives
            fps / num_frames / max_frame_pixels / the standardization / the LoRA scale unless passed here.
        device, dtype, batch_size: where, how and how many videos per forward.
        fps (default 2.0), video_fps, num_frames: frame sampling (give num_frames or video_fps, not fps and num_frames).
        max_frame_pixels (default 448 * 448), min_frame_pixels: per-frame area bounds.
        weights: {"VQ": w, "MQ": w, "TA": w} for overall.
        normalize: standardize the three scores; lora_scale: alpha / r when no model_config.json says it.
        random_head: allow a folder without the head (scores are noise; tests, smoke runs).
    """

    def __init__(self, path: str, checkpoint: str | None = None, device: str = "cpu", dtype: str = "float32",
                 batch_size: int = 4, fps: float | None = None, video_fps: float | None = None,
                 num_frames: int | None = None, max_frame_pixels: int | None = None,
                 min_frame_pixels: int = VIDEO_MIN_PIXELS, weights: dict | None = None, normalize: bool = True,
                 lora_scale: float | None = None, random_head: bool = False):
        if fps is not None and num_frames is not None:
            raise ConfigError("video_align: give fps or num_frames, not both (VideoAlign samples by one of them)")
        self.model_file, config = videoreward_files(checkpoint) if checkpoint else (None, {})
        data, peft = config.get("data_config", {}), config.get("peft_lora_config", {})
        if data.get("prompt_template_type", "detailed_special") != "detailed_special":
            raise ConfigError(f"video_align: {checkpoint} uses prompt template {data['prompt_template_type']!r}; only "
                              f"the reward-token template 'detailed_special' is implemented")
        self.fps = fps if fps is not None else (None if num_frames is not None else data.get("fps", 2.0))
        self.num_frames = num_frames if num_frames is not None or fps is not None else data.get("num_frames")
        self.video_fps, self.min_pixels = video_fps, min_frame_pixels
        self.max_pixels = max_frame_pixels or data.get("max_frame_pixels", 448 * 448)
        if self.num_frames is None and not video_fps:
            raise ConfigError("video_align samples frames at fps of the source video: pass video_fps (the "
                              "generator's frame rate) or num_frames")
        inf = config.get("inference_config") or {}
        # the checkpoint's own statistics; without them the raw scores, as VideoAlign's inference.py does
        self.norm = {d: (inf[f"{d}_mean"], inf[f"{d}_std"]) if f"{d}_mean" in inf else (0.0, 1.0)
                     for d in DIMENSIONS}
        self.normalize = normalize
        self.weights = {d: 1.0 for d in DIMENSIONS} if weights is None else {k: float(v) for k, v in weights.items()}
        if not self.weights or set(self.weights) - set(DIMENSIONS):
            raise ConfigError(f"video_align weights {sorted(self.weights)}; valid keys: {DIMENSIONS}")
        if lora_scale is None and peft.get("lora_enable"):
            r = peft["lora_r"]
            lora_scale = peft["lora_alpha"] / (math.sqrt(r) if peft.get("use_rslora") else r)
        self.lora_scale = lora_scale
        self.scorer = QwenVLScorer(path, tuple(f"<|{d}_reward|>" for d in DIMENSIONS), linear_head, ("weight",),
                                   self._checkpoint_state if checkpoint else None, device, dtype, batch_size,
                                   random_head, "video_align")

    def _checkpoint_state(self) -> dict:
        state = load_state(self.model_file)
        if any(".lora_" in k for k in state):
            if self.lora_scale is None:
                raise ConfigError(f"video_align: {self.model_file} holds LoRA weights and no model_config.json says "
                                  f"their scale: pass lora_scale (lora_alpha / lora_r; VideoReward: 128 / 64 = 2)")
            state = merge_lora(state, self.lora_scale)
        state = {k[len("base_model.model."):] if k.startswith("base_model.model.") else k: v for k, v in state.items()}
        return {current_qwen2vl_key(k): v for k, v in state.items()}

    @staticmethod
    def texts(examples) -> list[str]:
        return [VIDEOALIGN_PROMPT.format(text_prompt=p) for p in _prompts(examples)]

    def frames(self, videos: torch.Tensor) -> torch.Tensor:
        """[N, 3, F, H, W] in [-1, 1] -> [N, n, 3, h, w] in [0, 1] on CPU: sampled and resized."""
        if videos.dim() != 5:
            raise ValueError(f"video_align takes videos [N, 3, F, H, W]; got shape {tuple(videos.shape)}")
        n, _, f, h, w = videos.shape
        idx = frame_indices(f, self.num_frames, self.fps, self.video_fps)
        x = videos[:, :, idx].transpose(1, 2).reshape(n * len(idx), 3, h, w)
        x = resize_frames(x, self.scorer.factor, self.min_pixels, self.max_pixels)
        return x.reshape(n, len(idx), *x.shape[1:]).cpu()

    def __call__(self, videos: torch.Tensor, examples) -> dict[str, torch.Tensor]:
        self.scorer.load()
        raw = self.scorer(self.texts(examples), videos=list(self.frames(videos)))  # [N, 3]
        out = {d: (raw[:, i] - self.norm[d][0]) / self.norm[d][1] if self.normalize else raw[:, i]
               for i, d in enumerate(DIMENSIONS)}
        return {"overall": sum(w * out[d] for d, w in self.weights.items()), **out}
