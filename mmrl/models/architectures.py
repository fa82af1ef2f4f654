"""Published architectures at real size, for `mmrl plan` without the weights (instantiated on the meta device).

Configs as the released checkpoints' config.json files give them (diffusers transformer configs; transformers
Qwen2.5-VL config). Parameter counts instantiated here: SD3.5-Medium 2.24 B (its MMDiT-X transformer), FLUX.1-dev
11.9 B, Wan2.1-T2V-14B 14.3 B, Qwen-Image 20.6 B, Qwen2.5-VL-7B 8.29 B.
"""

from __future__ import annotations

ARCHITECTURES = {
    # stabilityai/stable-diffusion-3.5-medium, transformer/config.json
    "sd35-medium": {"policy": "flow", "class": "SD3Transformer2DModel", "pipeline": "StableDiffusion3Pipeline",
                    "text_tokens": 77 + 256, "config": dict(
                        sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                        pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                        dual_attention_layers=list(range(13)), qk_norm="rms_norm")},
    # black-forest-labs/FLUX.1-dev, transformer/config.json
    "flux1-dev": {"policy": "flow", "class": "FluxTransformer2DModel", "pipeline": "FluxPipeline",
                  "text_tokens": 512, "config": dict(
                      patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                      num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                      guidance_embeds=True, axes_dims_rope=[16, 56, 56])},
    # Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json
    "wan21-14b": {"policy": "flow", "class": "WanTransformer3DModel", "pipeline": "WanPipeline",
                  "text_tokens": 512, "config": dict(
                      patch_size=[1, 2, 2], num_attention_heads=40, attention_head_dim=128, in_channels=16,
                      out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                      qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)},
    # Qwen/Qwen-Image, transformer/config.json (the diffusers defaults of QwenImageTransformer2DModel)
    "qwen-image": {"policy": "flow", "class": "QwenImageTransformer2DModel", "pipeline": "QwenImagePipeline",
                   "text_tokens": 128, "config": dict(
                       patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                       num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=[16, 56, 56])},
    # Qwen/Qwen2.5-VL-7B-Instruct, config.json
    "qwen25-vl-7b": {"policy": "token", "class": "Qwen2_5_VLForConditionalGeneration", "config": dict(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        tie_word_embeddings=False)},
}

# Wan-AI/Wan2.2-T2V-A14B-Diffusers: two transformers of the Wan2.1-14B architecture (dim 5120, 40 layers, 40 heads,
# ffn 13824; Wan-Video/Wan2.2 wan/configs/wan_t2v_A14B.py), the high-noise expert for t >= 0.875 and the low-noise
# one below, one per forward; both held in memory (and both trained by mmrl).
ARCHITECTURES["wan22-a14b"] = {**ARCHITECTURES["wan21-14b"], "experts": 2}

# The frozen parts of each pipeline at real size (text_encoder*/config.json and vae/config.json of the released
# folders): SD3.5 CLIP-L + CLIP-G + T5-XXL encoder (5.58 B) and a 16-channel VAE (84 M); FLUX.1 CLIP-L + T5-XXL;
# Wan2.x the umT5-XXL encoder (5.68 B) and the Wan2.1 VAE (127 M, diffusers' defaults); Qwen-Image Qwen2.5-VL-7B and
# its VAE (diffusers' defaults).
_CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
               max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
_CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
               num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
_T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu")
_VAE_16 = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
               down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
               layers_per_block=2, use_quant_conv=False, use_post_quant_conv=False)
FROZEN_PARTS = {  # pipeline -> ([(transformers class, its config class, config)], (diffusers VAE class, config))
    "StableDiffusion3Pipeline": ([("CLIPTextModelWithProjection", "CLIPTextConfig", _CLIP_L),
                                  ("CLIPTextModelWithProjection", "CLIPTextConfig", _CLIP_G),
                                  ("T5EncoderModel", "T5Config", _T5_XXL)], ("AutoencoderKL", _VAE_16)),
    "FluxPipeline": ([("CLIPTextModel", "CLIPTextConfig", _CLIP_L), ("T5EncoderModel", "T5Config", _T5_XXL)],
                     ("AutoencoderKL", _VAE_16)),
    "WanPipeline": ([("UMT5EncoderModel", "UMT5Config", {**_T5_XXL, "vocab_size": 256384})], ("AutoencoderKLWan", {})),
    "QwenImagePipeline": ([("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
                            ARCHITECTURES["qwen25-vl-7b"]["config"])], ("AutoencoderKLQwenImage", {})),
}
