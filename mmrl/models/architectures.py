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
