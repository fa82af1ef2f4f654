"""Qwen-Image (`QwenImagePipeline`, `QwenImageTransformer2DModel`, MMDiT with 3-axis RoPE).

x [N, 16, H, W] packed 2x2 as FLUX; timestep = sigma; the last hidden states of its Qwen2.5-VL text encoder (chat
template, padded to TEXT_LEN) with their padding mask in the `pooled` slot (Qwen-Image has no pooled embedding); the
dynamic shift of its scheduler config, stretched to end at the terminal sigma. Its pipeline's "true CFG" renormalizes
the guided velocity to the conditional one's norm per packed token; mmrl guides the same way (`true_cfg`).
"""

from __future__ import annotations

import torch

from mmrl.models.architectures import ARCHITECTURES
from mmrl.models.families import Family, LoadOptions, PlanInputs
from mmrl.models.families.common import (TEXT_LEN, dynamic_schedule, dynamic_shift_mu, from_pretrained, pack2x2,
                                         padded, unpack2x2, wan_vae_decoder)
from mmrl.models.flow_model import FlowModel

# the joint-attention projections of every dual-stream block (image and text streams) and the MLPs
LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2")


def qwen_image_call(transformer, x, sigma, enc, mask):
    """x [N, 16, H, W] packed 2x2; the text padding mask [N, L] rides in the `pooled` slot; one image of
    (1, H/2, W/2) tokens per row for RoPE."""
    n, _, h, w = x.shape
    out = transformer(hidden_states=pack2x2(x), timestep=sigma, encoder_hidden_states=enc,
                      encoder_hidden_states_mask=mask, img_shapes=[[(1, h // 2, w // 2)]] * n, return_dict=False)[0]
    return unpack2x2(out, x.shape)


def true_cfg(v_u: torch.Tensor, v_c: torch.Tensor, w: float) -> torch.Tensor:
    """QwenImagePipeline's guidance: v = v_u + w (v_c - v_u) rescaled, per packed 2x2 token [64], to the norm of v_c.
    v_u, v_c: [N, 16, H, W]."""
    v, c = pack2x2(v_u + w * (v_c - v_u)), pack2x2(v_c)                                   # [N, HW/4, 64]
    return unpack2x2(v * (c.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True)), v_c.shape)


def image_decoder(vae):
    """[N, 16, H, W] -> images [N, 3, 8H, 8W] in [-1, 1] through the VAE's one-frame video axis."""
    video = wan_vae_decoder(vae)
    return lambda latents: video(latents[:, :, None])[:, :, 0]


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    pipe = from_pretrained(folder, index, options)
    tr = pipe.transformer

    @torch.no_grad()
    def encode(texts):  # (enc [B, L, D], mask [B, L]) at L = TEXT_LEN: every prompt one shape, cacheable
        enc, mask = pipe.encode_prompt(list(texts), device=pipe.device, max_sequence_length=TEXT_LEN)
        return padded(list(enc) if mask is None else [e[m.bool()] for e, m in zip(enc, mask)])

    size, config = options.sample_size or pipe.default_sample_size, dict(pipe.scheduler.config)
    return FlowModel(tr, encode, image_decoder(pipe.vae), (tr.config.out_channels, size, size),
                     (pipe.text_encoder, pipe.vae), call=qwen_image_call, guide=true_cfg,
                     schedule=dynamic_schedule(dynamic_shift_mu((size // 2) ** 2, config), config.get("shift_terminal")))


def plan_inputs(config: dict, folder: str | None, options: LoadOptions) -> PlanInputs:
    size = options.sample_size or 128  # the text mask rides in the pooled slot: [N, TEXT_LEN]
    return PlanInputs(qwen_image_call, (config["out_channels"], size, size), TEXT_LEN, config["joint_attention_dim"],
                      TEXT_LEN)


def tiny_text_encoder(seed: int = 0, words: tuple[str, ...] = ()):
    """(a Qwen2.5-VL of hidden size 32 = the tiny transformer's joint_attention_dim, its tokenizer)."""
    from mmrl.models.qwen_vl import build_model, build_tokenizer
    from mmrl.models.tiny_pipelines import CORPUS

    torch.manual_seed(seed)
    tok = build_tokenizer(CORPUS + ["Describe the image by detailing the color shape size texture quantity text",
                                    *words])
    return build_model("qwen2_5_vl", tok, "tiny"), tok


def tiny_parts(seed: int = 0, in_channels: int = 64, words: tuple[str, ...] = ()) -> dict:
    """The tiny transformer, VAE (Wan-style, one frame, x8 spatial), scheduler (Qwen-Image's: dynamic shift to the
    terminal sigma 0.02) and text encoder that Qwen-Image and Qwen-Image-Edit share."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    text_encoder, tok = tiny_text_encoder(seed, words)
    return dict(
        transformer=QwenImageTransformer2DModel(patch_size=2, in_channels=in_channels, out_channels=16, num_layers=1,
                                                attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                                axes_dims_rope=(4, 6, 6)),
        vae=AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                   temperal_downsample=[False, True, True]),
        scheduler=FlowMatchEulerDiscreteScheduler(
            shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
            max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential"),
        text_encoder=text_encoder, tokenizer=tok)


def tiny(seed: int = 0):
    from diffusers import QwenImagePipeline

    return QwenImagePipeline(**tiny_parts(seed))


FAMILY = Family(
    name="qwen_image", pipelines=("QwenImagePipeline",), transformer="QwenImageTransformer2DModel", load=load,
    lora_targets=LORA_TARGETS, plan_inputs=plan_inputs, lora_pipeline="QwenImagePipeline", tiny=tiny, video_vae=True,
    # Qwen/Qwen-Image, transformer/config.json (the model card's "20 B"; these diffusers defaults of
    # QwenImageTransformer2DModel instantiate 20.43 B)
    architectures={"qwen-image": {"config": dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=3584, axes_dims_rope=[16, 56, 56])}},
    # Qwen2.5-VL-7B and its VAE (diffusers' defaults)
    frozen_parts=([("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", ARCHITECTURES["qwen25-vl-7b"]["config"])],
                  ("AutoencoderKLQwenImage", {})))
