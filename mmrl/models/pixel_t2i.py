"""Builders for the small pixel-space generators of the embedded worlds, from configs in code.

The image model is a real diffusers `SD3Transformer2DModel` (MMDiT) generating RGB pixels directly (no VAE);
the video model (motion world) a real `WanTransformer3DModel` generating RGB clips [3, F, H, W]. Both are
conditioned by a real transformers `CLIPTextModelWithProjection` over a word-level tokenizer trained locally
with `tokenizers`. Saved as a diffusers-style folder that `mmrl.models.pipelines.load_flow_model` reads:

    model_index.json   {"_class_name": "MMRLPixelPipeline", "sample_size": 36, "prediction": "velocity",
                        "transformer_class": "SD3Transformer2DModel" | "WanTransformer3DModel", "frames": F (video),
                        "coordinates": true when the video model takes 3 coordinate channels (wan_coord_call)}
    transformer/       SD3Transformer2DModel.save_pretrained (safetensors)
    text_encoder/      CLIPTextModelWithProjection.save_pretrained (safetensors)
    tokenizer/         PreTrainedTokenizerFast.save_pretrained
    scheduler/         FlowMatchEulerDiscreteScheduler.save_pretrained
"""

from __future__ import annotations

import json
import os

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the libraries load in the builders: a family's registration (mmrl validate) needs none of them
    from diffusers import SD3Transformer2DModel, WanTransformer3DModel
    from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

PIPELINE_CLASS = "MMRLPixelPipeline"
# <eos> must not get id 2: transformers' CLIP text model then takes its pooled embedding at the HIGHEST token id
# (a legacy path for the original CLIP vocabulary), i.e. at some word mid-sentence that, attending causally,
# cannot see the words after it. The committed bases were built with <eos> = 2 and keep that pooling.
SPECIALS = ["<pad>", "<bos>", "<unk>", "<eos>"]
MAX_TOKENS = 16


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `words` (lower-cased, whitespace split) with BOS/EOS/PAD/UNK."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(set(words)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()

    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", vocab["<bos>"]), ("<eos>", vocab["<eos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=MAX_TOKENS, padding_side="right")


def build_text_encoder(tokenizer: PreTrainedTokenizerFast, width: int = 64, layers: int = 2) -> CLIPTextModelWithProjection:
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    cfg = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=MAX_TOKENS,
                         projection_dim=width, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return CLIPTextModelWithProjection(cfg)


TRANSFORMER_SIZES = {
    # 4 x 32 heads, 4 layers: ~2.4 M params; the calibrated shapes-world model.
    "small": dict(num_layers=4, attention_head_dim=32, num_attention_heads=4, caption_projection_dim=128),
    # for tests and smoke runs
    "tiny": dict(num_layers=1, attention_head_dim=8, num_attention_heads=2, caption_projection_dim=16),
}


def build_transformer(size: str, sample_size: int, text_width: int, patch_size: int = 2) -> SD3Transformer2DModel:
    if size not in TRANSFORMER_SIZES:
        raise ValueError(f"unknown transformer size {size!r}; valid: {sorted(TRANSFORMER_SIZES)}")
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=sample_size, patch_size=patch_size, in_channels=3, out_channels=3,
                                 joint_attention_dim=text_width, pooled_projection_dim=text_width,
                                 pos_embed_max_size=sample_size // patch_size, **TRANSFORMER_SIZES[size])


VIDEO_SIZES = {
    # 4 x 16 heads, 4 layers: ~0.3 M params; the motion-world model
    "small": dict(num_layers=4, attention_head_dim=16, num_attention_heads=4, ffn_dim=256),
    "tiny": dict(num_layers=1, attention_head_dim=8, num_attention_heads=2, ffn_dim=16),
}


def build_video_transformer(size: str, text_width: int, patch_size: int = 4,
                            coordinates: bool = False) -> WanTransformer3DModel:
    """A pixel-space Wan transformer: RGB clips [3, F, H, W], patches of 1 frame x patch x patch pixels;
    coordinates: 3 more input channels for `mmrl.models.pipelines.wan_coord_call` (absolute positions)."""
    if size not in VIDEO_SIZES:
        raise ValueError(f"unknown transformer size {size!r}; valid: {sorted(VIDEO_SIZES)}")
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, patch_size, patch_size), in_channels=6 if coordinates else 3,
                                 out_channels=3,
                                 text_dim=text_width, freq_dim=64, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **VIDEO_SIZES[size])


def build_pipeline_parts(words: list[str], size: str = "small", sample_size: int = 36, text_width: int = 64,
                         text_layers: int = 2, patch_size: int = 2, frames: int = 0, coordinates: bool = False) -> dict:
    """frames > 0 builds the video model (clips of `frames` frames; with coordinate input channels if asked),
    else the image model."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    tokenizer = build_tokenizer(words)
    text_width = text_width if size != "tiny" else 16
    transformer = (build_video_transformer(size, text_width, patch_size, coordinates) if frames else
                   build_transformer(size, sample_size, text_width, patch_size))
    return dict(tokenizer=tokenizer, text_encoder=build_text_encoder(tokenizer, text_width, text_layers if size != "tiny" else 1),
                transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
                sample_size=sample_size, frames=frames)


def save_pipeline_parts(parts: dict, path: str, prediction: str = "velocity") -> None:
    """Write the folder described in the module docstring (the caller makes it atomic).
    prediction: what the transformer outputs, "velocity" or "sample" (see mmrl/models/flow_model.py)."""
    os.makedirs(path, exist_ok=True)
    for name in ("transformer", "text_encoder", "tokenizer", "scheduler"):
        parts[name].save_pretrained(os.path.join(path, name))
    tr = parts["transformer"]
    index = {"_class_name": PIPELINE_CLASS, "sample_size": parts.get("sample_size") or tr.config.sample_size,
             "channels": tr.config.out_channels, "prediction": prediction, "transformer_class": type(tr).__name__}
    if parts.get("frames"):
        index["frames"] = parts["frames"]
        index["coordinates"] = tr.config.in_channels > tr.config.out_channels
    with open(os.path.join(path, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
