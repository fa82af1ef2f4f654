"""mmrl's pixel-space generators, the embedded worlds' base models (`MMRLPixelPipeline`; mmrl/models/pixel_t2i.py).

An `SD3Transformer2DModel` over RGB images [N, 3, H, W] (shapes world), or a `WanTransformer3DModel` over RGB clips
[N, 3, F, H, W] (motion world; with `coordinates`, three fixed frame / row / column channels are concatenated to
its input, the way Wan I2V concatenates its conditioning latents), conditioned by a CLIP text model over a
word-level tokenizer; no VAE (decode = clamp); a static shift. The two are two families of one pipeline class,
told apart by the folder's `transformer_class`: `pixel` (this file) and `pixel_video` (pixel_video.py), each with
its own LoRA targets and LoRA pipeline.
"""

from __future__ import annotations

import json
import os

import torch

from mmrl.errors import ConfigError
from mmrl.models.families import Family, LoadOptions, PlanInputs
from mmrl.models.families.common import SD3_LORA_TARGETS
from mmrl.models.families.wan import wan_call
from mmrl.models.flow_model import EncodeFn, FlowModel, sd3_call
from mmrl.models.pixel_t2i import PIPELINE_CLASS

PARTS = ("transformer", "text_encoder", "tokenizer")  # the folders a pixel model needs
TRANSFORMERS = ("SD3Transformer2DModel", "WanTransformer3DModel")


def coordinates(x: torch.Tensor) -> torch.Tensor:
    """Fixed frame, row and column ramps in [-1, 1] for a video x [N, C, F, H, W] -> [N, 3, F, H, W]."""
    n, _, f, h, w = x.shape
    grid = torch.meshgrid(*(torch.linspace(-1, 1, k) for k in (f, h, w)), indexing="ij")
    return torch.stack(grid).to(x).expand(n, -1, -1, -1, -1)


def wan_coord_call(transformer, x, sigma, enc, pooled):
    """wan_call with the three `coordinates` channels concatenated to the input (in_channels = C + 3). Wan's 3-D RoPE
    is relative only, so from pure noise a token cannot tell where it is; these channels give absolute positions."""
    return wan_call(transformer, torch.cat([x, coordinates(x)], 1), sigma, enc, pooled)


def make_clip_encoder(tokenizer, text_encoder) -> EncodeFn:
    """Encode texts with a CLIP text model: (last_hidden_state [B, L, D], text_embeds [B, D])."""

    def encode(texts: list[str]):
        ids = tokenizer(list(texts), padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").to(text_encoder.device)
        out = text_encoder(input_ids=ids.input_ids, attention_mask=ids.attention_mask)
        return out.last_hidden_state, out.text_embeds

    return encode


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    import diffusers
    from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

    cls = index.get("transformer_class", "SD3Transformer2DModel")
    if cls not in TRANSFORMERS:
        raise ConfigError(f"{folder}: unsupported transformer_class {cls!r} ({', '.join(TRANSFORMERS)})")
    if "transformer" in options.meta:  # weights loaded later, into shards (mmrl.models.pipelines.load_into_shards)
        from mmrl.models.shard_load import meta_component

        transformer = meta_component(folder, "transformer", options.dtype)
    else:
        transformer = getattr(diffusers, cls).from_pretrained(os.path.join(folder, "transformer"), dtype=options.dtype)
    text_encoder = CLIPTextModelWithProjection.from_pretrained(os.path.join(folder, "text_encoder"))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(folder, "tokenizer"))
    size, ch = index["sample_size"], index["channels"]
    video = cls == "WanTransformer3DModel"
    shape = (ch, index["frames"], size, size) if video else (ch, size, size)
    call = (wan_coord_call if index.get("coordinates") else wan_call) if video else sd3_call
    return FlowModel(transformer, make_clip_encoder(tokenizer, text_encoder), lambda x: x.clamp(-1, 1), shape,
                     (text_encoder,), prediction=index.get("prediction", "velocity"), call=call,
                     encode_latents=None if video else (lambda images: images.float()))


def plan_inputs(config: dict, folder: str | None, options: LoadOptions) -> PlanInputs:
    index = json.load(open(os.path.join(folder, "model_index.json")))
    tokens = json.load(open(os.path.join(folder, "tokenizer", "tokenizer_config.json"))).get("model_max_length", 77)
    size = index["sample_size"]
    if "text_dim" in config:  # the video model: its clip size, no VAE compression
        coords = index.get("coordinates", False)
        return PlanInputs(wan_coord_call if coords else wan_call,
                          (config["in_channels"] - (3 if coords else 0), index["frames"], size, size), tokens,
                          config["text_dim"], 0)
    size = options.sample_size or size
    return PlanInputs(sd3_call, (config["in_channels"], size, size), tokens, config["joint_attention_dim"],
                      config["pooled_projection_dim"])


# adapters are also written in diffusers' format, through the pipeline of the transformer class
FAMILY = Family(name="pixel", pipelines=(PIPELINE_CLASS,), transformer="SD3Transformer2DModel", load=load,
                lora_targets=SD3_LORA_TARGETS, plan_inputs=plan_inputs, lora_pipeline="StableDiffusion3Pipeline",
                diffusers=False)
