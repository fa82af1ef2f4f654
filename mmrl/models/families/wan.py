"""Wan2.1 / Wan2.2 text-to-video (`WanPipeline`, `WanTransformer3DModel`).

Video latents x [N, 16, F', H, W] (F' = (frames - 1) / 4 + 1 of its causal video VAE, x8 spatial); timestep =
1000 sigma; UMT5 tokens (512), no pooled embedding (an empty [N, 0] tensor stands in); classifier-free guidance; a
static shift. Wan2.2 A14B's two experts: `transformer` for sigma >= boundary_ratio, `transformer_2` below, both
trained.
"""

from __future__ import annotations

import torch

from mmrl.models.architectures import T5_XXL
from mmrl.models.families import Family, LoadOptions, PlanInputs
from mmrl.models.families.common import from_pretrained, wan_vae_decoder
from mmrl.models.flow_model import FlowModel

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention of every block


def wan_call(transformer, x, sigma, enc, pooled):
    return transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=enc, return_dict=False)[0]


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    pipe = from_pretrained(folder, index, options)
    length = {"max_sequence_length": options.text_max_length or 512}  # WanPipeline's (encode_prompt's own is 226)

    @torch.no_grad()
    def encode(texts):
        enc, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, device=pipe.device, **length)
        return enc, enc.new_zeros(len(texts), 0)

    tr, frames, size = pipe.transformer, options.num_frames or 81, options.sample_size or 60  # 480 px
    shape = (tr.config.in_channels, (frames - 1) // pipe.vae_scale_factor_temporal + 1, size, size)
    # Wan2.2 A14B: transformer_2 denoises below boundary_ratio (sigma; = timestep / num_train_timesteps)
    boundary = pipe.config.get("boundary_ratio") if getattr(pipe, "transformer_2", None) is not None else None
    return FlowModel(tr, encode, wan_vae_decoder(pipe.vae), shape, (pipe.text_encoder, pipe.vae), call=wan_call,
                     transformer_2=pipe.transformer_2 if boundary is not None else None, boundary=boundary)


def plan_inputs(config: dict, folder: str | None, options: LoadOptions) -> PlanInputs:
    size, frames = options.sample_size or 60, options.num_frames or 81
    return PlanInputs(wan_call, (config["in_channels"], (frames - 1) // 4 + 1, size, size),
                      options.text_max_length or 512, config["text_dim"], 0)


def tiny_transformer(in_channels: int = 16, **kw):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=in_channels, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                 num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 rope_max_seq_len=32, **kw)


def tiny_vae():
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def tiny_text_encoder():
    from transformers import UMT5Config, UMT5EncoderModel

    from mmrl.models.tiny_pipelines import TINY_T5

    return UMT5EncoderModel(UMT5Config(**TINY_T5))


def tiny(seed: int = 0, two_experts: bool = False):
    """Wan2.1 layout: UMT5, the 3-D transformer, the causal video VAE (x4 temporal, x8 spatial). two_experts: Wan2.2
    A14B's layout, a low-noise transformer_2 below boundary_ratio 0.875 (its T2V value)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    from mmrl.models.tiny_pipelines import tiny_tokenizer

    torch.manual_seed(seed)
    experts = dict(transformer_2=tiny_transformer(), boundary_ratio=0.875) if two_experts else {}
    return WanPipeline(transformer=tiny_transformer(), **experts, vae=tiny_vae(),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=tiny_text_encoder(),
                       tokenizer=tiny_tokenizer(32))


WAN21_14B = dict(patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16,
                 out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json: dim 1536 (12 heads x 128), ffn 8960, 30 layers
WAN21_1_3B = {**WAN21_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}
UMT5_XXL = {**T5_XXL, "vocab_size": 256384}

FAMILY = Family(
    name="wan", pipelines=("WanPipeline",), transformer="WanTransformer3DModel", load=load,
    lora_targets=LORA_TARGETS, plan_inputs=plan_inputs, lora_pipeline="WanPipeline", tiny=tiny, video_vae=True,
    architectures={
        "wan21-1.3b": {"config": WAN21_1_3B},  # the 1.3 B model of configs/t2v/wan_lora.yaml
        "wan21-14b": {"config": WAN21_14B},  # Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json (14.3 B)
        # Wan-AI/Wan2.2-T2V-A14B-Diffusers: two transformers of the Wan2.1-14B architecture (Wan-Video/Wan2.2
        # wan/configs/wan_t2v_A14B.py), the high-noise expert for t >= 0.875 and the low-noise one below, one per
        # forward; both held in memory (and both trained by mmrl)
        "wan22-a14b": {"config": WAN21_14B, "experts": 2, "boundary": 0.875}},
    # the umT5-XXL encoder (5.68 B) and the Wan2.1 VAE (127 M, diffusers' defaults)
    frozen_parts=([("UMT5EncoderModel", "UMT5Config", UMT5_XXL)], ("AutoencoderKLWan", {})))
