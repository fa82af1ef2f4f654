"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`, `SD3Transformer2DModel`, MMDiT).

x [N, 16, H, W] latents of its 16-channel VAE; timestep = 1000 sigma; the prompt as CLIP-L + CLIP-G tokens
concatenated with T5-XXL tokens (77 + 256 by default; Flow-GRPO's SD3 recipes pad T5 to 128: model.text_max_length)
and the two CLIPs' pooled embeddings; classifier-free guidance; a static shift (sampler.shift, 3.0 for SD3.5).
"""

from __future__ import annotations

import torch

from mmrl.models.architectures import CLIP_G, CLIP_L, T5_XXL, VAE_16
from mmrl.models.families import Family, LoadOptions, PlanInputs
from mmrl.models.families.common import SD3_LORA_TARGETS, from_pretrained, vae_decoder, vae_encoder
from mmrl.models.flow_model import FlowModel, sd3_call


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    pipe = from_pretrained(folder, index, options)
    length = {} if options.text_max_length is None else {"max_sequence_length": options.text_max_length}

    @torch.no_grad()
    def encode(texts):
        enc, _, pooled, _ = pipe.encode_prompt(list(texts), list(texts), list(texts), device=pipe.device,
                                               do_classifier_free_guidance=False, **length)
        return enc, pooled

    size = options.sample_size or pipe.default_sample_size
    texts = tuple(m for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3) if m is not None)
    return FlowModel(pipe.transformer, encode, vae_decoder(pipe.vae), (pipe.transformer.config.in_channels, size, size),
                     texts + (pipe.vae,), call=sd3_call,
                     encode_latents=vae_encoder(pipe.vae), image_scale=pipe.vae_scale_factor)


def plan_inputs(config: dict, folder: str | None, options: LoadOptions) -> PlanInputs:
    size = options.sample_size or config["sample_size"]
    return PlanInputs(sd3_call, (config["in_channels"], size, size), 77 + (options.text_max_length or 256),
                      config["joint_attention_dim"], config["pooled_projection_dim"])


def tiny(seed: int = 0):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from mmrl.models.tiny_pipelines import CLIP, TINY_T5, tiny_tokenizer, tiny_vae

    torch.manual_seed(seed)
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=1,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                          caption_projection_dim=16, pooled_projection_dim=64, pos_embed_max_size=16),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_vae(),
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**CLIP)), tokenizer=tiny_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**CLIP)), tokenizer_2=tiny_tokenizer(),
        text_encoder_3=T5EncoderModel(T5Config(**TINY_T5)), tokenizer_3=tiny_tokenizer())


FAMILY = Family(
    name="sd3", pipelines=("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline"),
    transformer="SD3Transformer2DModel", load=load, lora_targets=SD3_LORA_TARGETS, plan_inputs=plan_inputs,
    lora_pipeline="StableDiffusion3Pipeline", tiny=tiny,
    # stabilityai/stable-diffusion-3.5-medium, transformer/config.json (MMDiT-X: 2.24 B parameters)
    architectures={"sd35-medium": {"config": dict(
        sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
        joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
        pos_embed_max_size=384, dual_attention_layers=list(range(13)), qk_norm="rms_norm")}},
    # CLIP-L + CLIP-G + T5-XXL encoder (5.58 B) and the 16-channel VAE (84 M)
    frozen_parts=([("CLIPTextModelWithProjection", "CLIPTextConfig", CLIP_L),
                   ("CLIPTextModelWithProjection", "CLIPTextConfig", CLIP_G),
                   ("T5EncoderModel", "T5Config", T5_XXL)], ("AutoencoderKL", VAE_16)))
