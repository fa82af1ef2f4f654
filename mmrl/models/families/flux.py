"""FLUX.1 (`FluxPipeline`, `FluxTransformer2DModel`): dev (guidance-distilled) and schnell.

x [N, 16, H, W] latents are packed into 2x2 patches [N, HW/4, 64] for the call and unpacked after (a permutation,
so densities are unchanged); timestep = sigma; CLIP-L's pooled embedding and T5-XXL tokens (512); FLUX.1-dev's
guidance embedding (model.guidance, 3.5) replaces classifier-free guidance (keep sampler.cfg_scale 1); image and
text RoPE ids; the resolution-dependent shift of the pipeline's scheduler config (use_dynamic_shifting).
"""

from __future__ import annotations

import torch

from mmrl.models.architectures import CLIP_L, T5_XXL, VAE_16
from mmrl.models.families import Family, LoadOptions, PlanInputs
from mmrl.models.families.common import (SD3_LORA_TARGETS, dynamic_schedule, dynamic_shift_mu, from_pretrained,
                                         pack2x2, unpack2x2, vae_decoder, vae_encoder)
from mmrl.models.flow_model import FlowModel


def flux_call(guidance: float):
    def call(transformer, x, sigma, enc, pooled):
        n, c, h, w = x.shape
        rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(x)   # [HW/4, 3]
        txt_ids = torch.zeros(enc.shape[1], 3).to(x)                                            # [L, 3]
        g = torch.full((n,), guidance).to(x) if transformer.config.guidance_embeds else None
        out = transformer(hidden_states=pack2x2(x), timestep=sigma, guidance=g, pooled_projections=pooled,
                          encoder_hidden_states=enc, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return unpack2x2(out, x.shape)

    return call


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    pipe = from_pretrained(folder, index, options)

    @torch.no_grad()
    def encode(texts):
        length = options.text_max_length or min(512, pipe.tokenizer_2.model_max_length)
        enc, pooled, _ = pipe.encode_prompt(list(texts), list(texts), device=pipe.device, max_sequence_length=length)
        return enc, pooled

    tr, size = pipe.transformer, options.sample_size or pipe.default_sample_size
    mu = dynamic_shift_mu((size // 2) ** 2, dict(pipe.scheduler.config))  # packed 2x2: (H/2)(W/2) tokens
    return FlowModel(tr, encode, vae_decoder(pipe.vae), (tr.config.in_channels // 4, size, size),
                     (pipe.text_encoder, pipe.text_encoder_2, pipe.vae), call=flux_call(options.guidance),
                     encode_latents=vae_encoder(pipe.vae), image_scale=pipe.vae_scale_factor,
                     **({} if mu is None else {"schedule": dynamic_schedule(mu)}))


def plan_inputs(config: dict, folder: str | None, options: LoadOptions) -> PlanInputs:
    size = options.sample_size or 128
    return PlanInputs(flux_call(options.guidance), (config["in_channels"] // 4, size, size),
                      options.text_max_length or 512, config["joint_attention_dim"], config["pooled_projection_dim"])


def tiny(seed: int = 0, guidance_embeds: bool = True):
    """FLUX.1-dev layout (guidance embedding on; off: schnell), 2x2-packed 16-channel latents (in_channels 64)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from mmrl.models.tiny_pipelines import CLIP, TINY_T5, tiny_tokenizer, tiny_vae

    torch.manual_seed(seed)
    return FluxPipeline(
        transformer=FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                           pooled_projection_dim=32, guidance_embeds=guidance_embeds,
                                           axes_dims_rope=(4, 4, 8)),
        scheduler=FlowMatchEulerDiscreteScheduler(  # FLUX.1's scheduler config: resolution-dependent shift
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
            max_image_seq_len=4096), vae=tiny_vae(),
        text_encoder=CLIPTextModel(CLIPTextConfig(**CLIP)), tokenizer=tiny_tokenizer(),
        text_encoder_2=T5EncoderModel(T5Config(**TINY_T5)), tokenizer_2=tiny_tokenizer(32))


FAMILY = Family(
    name="flux", pipelines=("FluxPipeline",), transformer="FluxTransformer2DModel", load=load,
    lora_targets=SD3_LORA_TARGETS, plan_inputs=plan_inputs, lora_pipeline="FluxPipeline", tiny=tiny,
    # black-forest-labs/FLUX.1-dev, transformer/config.json (11.9 B)
    architectures={"flux1-dev": {"config": dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=[16, 56, 56])}},
    frozen_parts=([("CLIPTextModel", "CLIPTextConfig", CLIP_L), ("T5EncoderModel", "T5Config", T5_XXL)],
                  ("AutoencoderKL", VAE_16)))
