"""Published architectures at real size, for `mmrl plan --arch` without the weights (instantiated on the meta
device): the token policies' here (transformers configs as the released config.json files give them; Qwen2.5-VL-7B
8.29 B), the flow generators' in their families (mmrl/models/families/*.py), all of them listed by
`mmrl.models.families.all_architectures`.
"""

from __future__ import annotations

ARCHITECTURES = {
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

# The frozen parts the flow families share at real size (text_encoder*/config.json and vae/config.json of the
# released folders): CLIP-L, CLIP-G, the T5-XXL encoder and the 16-channel VAE of SD3 / FLUX.1 / Z-Image.
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
               num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
               feed_forward_proj="gated-gelu")
VAE_16 = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[128, 256, 512, 512],
               down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
               layers_per_block=2, use_quant_conv=False, use_post_quant_conv=False)

