"""Z-Image (`ZImagePipeline`, `ZImageTransformer2DModel`, single-stream DiT).

The call takes lists of one-frame latents [16, 1, H, W] and of each prompt's unpadded Qwen3 tokens (padded + masked
in mmrl, the mask in the `pooled` slot); its time runs the other way (t = 1 - sigma) and it predicts x0 - eps, so
v = -output; the FLUX VAE; a static shift of linspace(1, 1/S, S), as its pipeline sets the sigmas.
"""

from __future__ import annotations

import torch

from mmrl.models.architectures import VAE_16
from mmrl.models.families import Family, LoadOptions, PlanInputs
from mmrl.models.families.common import TEXT_LEN, from_pretrained, padded, sigma_schedule, vae_decoder, vae_encoder
from mmrl.models.flow_model import FlowModel

LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")


def z_image_call(transformer, x, sigma, enc, mask):
    caps = [e[m.bool()] for e, m in zip(enc, mask)] if mask is not None else list(enc)  # each prompt's own tokens
    out = transformer(list(x.unsqueeze(2).unbind(0)), 1 - sigma, caps, return_dict=False)[0]
    return -torch.stack([o.float() for o in out]).squeeze(2)


def linspace_schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    return sigma_schedule(num_steps, shift, linspace=True)


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    pipe = from_pretrained(folder, index, options)
    tr = pipe.transformer

    @torch.no_grad()
    def encode(texts):  # (enc [B, L, D], mask [B, L]): the prompt's tokens, padded to one length for the cache
        embeds, _ = pipe.encode_prompt(list(texts), device=pipe.device, do_classifier_free_guidance=False,
                                       max_sequence_length=TEXT_LEN)
        return padded(embeds)

    size = options.sample_size or 2 * (1024 // (pipe.vae_scale_factor * 2))
    return FlowModel(tr, encode, vae_decoder(pipe.vae), (tr.config.in_channels, size, size),
                     (pipe.text_encoder, pipe.vae), call=z_image_call,
                     schedule=linspace_schedule, encode_latents=vae_encoder(pipe.vae), image_scale=pipe.vae_scale_factor)


def plan_inputs(config: dict, folder: str | None, options: LoadOptions) -> PlanInputs:
    size = options.sample_size or 128
    def call(transformer, x, sigma, enc, mask):  # on meta tensors: every prompt at its full TEXT_LEN tokens
        return z_image_call(transformer, x, sigma, enc, None)

    return PlanInputs(call, (config["in_channels"], size, size), TEXT_LEN, config["cap_feat_dim"], TEXT_LEN)


def tiny(seed: int = 0):
    """A Qwen3 text encoder (second-to-last hidden states, chat template), the single-stream transformer (text and
    image refiners, then joint layers; 2x2 patches inside), the FLUX VAE, a static shift 3 (Z-Image-Turbo's)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from mmrl.models.qwen_vl import build_tokenizer
    from mmrl.models.tiny_pipelines import CORPUS, tiny_vae

    torch.manual_seed(seed)
    tok = build_tokenizer(CORPUS)
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          max_position_embeddings=1024, pad_token_id=tok.pad_token_id))
    return ZImagePipeline(
        transformer=ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32,
                                             n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                             axes_dims=[4, 6, 6], axes_lens=[64, 32, 32]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_vae(), text_encoder=text_encoder, tokenizer=tok)


FAMILY = Family(
    name="z_image", pipelines=("ZImagePipeline",), transformer="ZImageTransformer2DModel", load=load,
    lora_targets=LORA_TARGETS, plan_inputs=plan_inputs, lora_pipeline="ZImagePipeline", tiny=tiny,
    # Tongyi-MAI/Z-Image-Turbo: the diffusers defaults of ZImageTransformer2DModel (dim 3840, 30 layers + 2 + 2
    # refiners, 30 heads, Qwen3-4B caption features of 2560)
    architectures={"z-image-turbo": {"config": dict(
        all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
        n_heads=30, n_kv_heads=30, cap_feat_dim=2560)}},
    # Qwen3-4B (its hidden states as the caption features, 2560) and the FLUX VAE
    frozen_parts=([("Qwen3Model", "Qwen3Config", dict(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True))],
        ("AutoencoderKL", VAE_16)))
