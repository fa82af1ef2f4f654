"""FLUX.1 Kontext (`FluxKontextPipeline`, `FluxTransformer2DModel`): FLUX.1-dev's transformer editing an image.

Everything FLUX.1 does (mmrl/models/families/flux.py): x [N, 16, H, W] latents packed into 2x2 patches
[N, HW/4, 64] for the call; timestep = sigma (the pipeline passes t / 1000 with t = 1000 sigma); CLIP-L's pooled
embedding and T5-XXL tokens (512); the guidance embedding (model.guidance; Kontext's card uses 2.5) in place of
CFG; the resolution-dependent shift of the scheduler config, its mu from the generated tokens only (HW/4).

Conditioning: one image per example (`"image": path`). The pipeline resizes it (with `_auto_resize`, to the
PREFERRED_KONTEXT_RESOLUTIONS entry of the closest aspect ratio, else its own size floored to a multiple of 16),
maps it to [-1, 1] and VAE-encodes it to the distribution's mode (retrieve_latents sample_mode="argmax"),
z = (mode - shift_factor) * scaling_factor, packs z into 2x2 tokens, appends them after the noisy latents' tokens
with RoPE ids (1, row, col) (the generated ones are (0, row, col)), and keeps only the first HW/4 output tokens.
mmrl resizes every image to the output size (8H x 8W px, stretched; what the pipeline does with
`_auto_resize=False` for an image of that size, and with it for a square image at 1024 px, sample_size 128), so
the image tokens sit on the generated grid and every row has the same shapes (at 512 px, sample_size 64, the
image is encoded at 512 px too, where the pipeline's default would encode it at about 1 MP).
`encode_prompts(texts, images)` -> (enc [B, 512, 4096], pooled [B, 768 + 16 H W]): CLIP's pooled embedding, then
the image latents z [16, H, W] flattened; the call splits them off again.

CFG: none by default (guidance-distilled). sampler.cfg_scale > 1 is the pipeline's "true CFG" with
negative_prompt="": v_u + w (v_c - v_u), the negative branch on the same image and guidance embedding.
"""

from __future__ import annotations

import dataclasses

import torch

from mmrl.models.families import Family, LoadOptions, PlanInputs, flux
from mmrl.models.families.common import SD3_LORA_TARGETS, pack2x2
from mmrl.models.flow_model import FlowModel


class _WithImage:
    """The transformer as flux_call sees it, the image's tokens [N, HW/4, 64] appended after x's with ids whose
    first coordinate is 1 (the same grid: the image is at the output size), their outputs dropped."""

    def __init__(self, transformer, tokens: torch.Tensor):
        self.transformer, self.tokens, self.config = transformer, tokens, transformer.config

    def __call__(self, hidden_states, img_ids, **kw):
        image_ids = img_ids.clone()                                            # [HW/4, 3] (0, row, col)
        image_ids[:, 0] = 1                                                    # -> (1, row, col)
        out = self.transformer(hidden_states=torch.cat([hidden_states, self.tokens], 1),  # [N, HW/2, 64]
                               img_ids=torch.cat([img_ids, image_ids]), **kw)[0]
        return (out[:, :hidden_states.shape[1]],)                              # the generated tokens only


def kontext_call(guidance: float):
    call = flux.flux_call(guidance)

    def kontext(transformer, x, sigma, enc, pooled):
        p = transformer.config.pooled_projection_dim
        image = pooled[:, p:].reshape(x.shape)                                 # [N, 16, H, W] the image's z
        return call(_WithImage(transformer, pack2x2(image)), x, sigma, enc, pooled[:, :p])

    return kontext


def image_encoder(vae, size: int):
    """images (one PIL list per row) -> z [B, 16 * size * size]: each resized to the output size, in [-1, 1],
    the VAE posterior's mode, shifted and scaled (FluxKontextPipeline._encode_vae_image)."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.flux.pipeline_flux_kontext import retrieve_latents

    factor = 2 ** (len(vae.config.block_out_channels) - 1)                     # 8: pixels per latent
    processor, side = VaeImageProcessor(vae_scale_factor=factor * 2), size * factor

    @torch.no_grad()
    def encode(images):
        pixels = processor.preprocess([imgs[0] for imgs in images], side, side)  # [B, 3, 8H, 8W] in [-1, 1]
        z = retrieve_latents(vae.encode(pixels.to(vae.device, vae.dtype)), sample_mode="argmax")  # [B, 16, H, W]
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).flatten(1)

    return encode


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    model = flux.load(folder, index, options)  # the FLUX.1 model of the Kontext pipeline's parts
    text, encode_image = model.encode_prompts, image_encoder(model.text_modules[-1], model.latent_shape[-1])

    @torch.no_grad()
    def encode(texts, images=None):
        if images is None or len(images) != len(texts) or any(len(imgs) != 1 for imgs in images):
            raise ValueError("FLUX.1 Kontext edits one image per prompt: encode_prompts(texts, [[image], ...])")
        enc, pooled = text(texts)                                              # [B, L, 4096], [B, 768]
        return enc, torch.cat([pooled, encode_image(images).to(pooled)], 1)    # [B, 768 + 16 H W]

    return dataclasses.replace(model, encode_prompts=encode, call=kontext_call(options.guidance))


def plan_inputs(config: dict, folder: str | None, options: LoadOptions) -> PlanInputs:
    inputs = flux.plan_inputs(config, folder, options)
    image = inputs.latent_shape[0] * inputs.latent_shape[1] * inputs.latent_shape[2]
    return inputs._replace(call=kontext_call(options.guidance), pooled_dim=inputs.pooled_dim + image)


def tiny(seed: int = 0):
    """FLUX.1's tiny parts (guidance embedding on) as a FluxKontextPipeline."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**flux.tiny(seed).components)


FAMILY = Family(
    name="flux_kontext", pipelines=("FluxKontextPipeline",), transformer="FluxTransformer2DModel", load=load,
    lora_targets=SD3_LORA_TARGETS, plan_inputs=plan_inputs, lora_pipeline="FluxKontextPipeline", tiny=tiny,
    condition_images=1,
    # black-forest-labs/FLUX.1-Kontext-dev, transformer/config.json: FLUX.1-dev's (11.9 B; plan: 11.90 B)
    architectures={"flux1-kontext-dev": {"config": flux.FAMILY.architectures["flux1-dev"]["config"]}},
    frozen_parts=flux.FAMILY.frozen_parts)
