"""Published architectures at real size, for `mmrl plan --arch` without the weights (instantiated on the meta
device): the token policies' and Janus-Pro's here (transformers configs as the released config.json files give them;
Qwen2.5-VL-7B 8.29 B, Janus-Pro-1B 2.08 B, Janus-Pro-7B 7.41 B), the flow generators' in their families
(mmrl/models/families/*.py), all of them listed by `mmrl.models.families.all_architectures`.
"""

from __future__ import annotations

# Janus-Pro (deepseek-ai/Janus-Pro-1B / -7B, as transformers' convert_janus_weights_to_hf.py builds the
# deepseek-community folders): a DeepSeek-LLM (Llama architecture; -1B's text config as the converted folder gives it,
# -7B's language_config names 30 layers and takes LlamaConfig's 7B defaults: hidden 4096, intermediate 11008, 32 heads),
# the SigLIP-L/16 understanding tower at 384 px (its aligner: 2 layers to the LM's width), the VQ-16 tokenizer of
# LlamaGen (codebook 16384 x 8, 24 x 24 = 576 tokens per 384 px image; the generation embeddings 16384 x 8 -> aligner
# -> LM width; the generation head LM width -> 16384). The text head is the LM's own (not tied to its embeddings):
# -7B instantiates 7.408 B parameters, its bf16 checkpoint holds 14.84 GB = 7.42 B (the 12.6 M more: SigLIP's
# attention-pooling head, which the conversion drops).
_SIGLIP_L_384 = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, mlp_ratio=4.0, patch_size=16,
                     image_size=384, depth=2, num_image_tokens=576)
_VQ_16 = dict(embed_dim=8, num_embeddings=16384, latent_channels=256, base_channels=128,
              channel_multiplier=[1, 1, 2, 2, 4], num_res_blocks=2, num_hidden_layers=2)

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
    "janus-pro-1b": {"policy": "janus", "class": "JanusForConditionalGeneration", "config": dict(
        text_config=dict(model_type="llama", vocab_size=102400, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
                         max_position_embeddings=16384, rms_norm_eps=1e-6),
        vision_config=dict(projection_dim=2048, **_SIGLIP_L_384),
        vq_config=dict(projection_dim=2048, image_token_embed_dim=2048, **_VQ_16),
        image_token_id=100581, tie_word_embeddings=False)},
    "janus-pro-7b": {"policy": "janus", "class": "JanusForConditionalGeneration", "config": dict(
        text_config=dict(model_type="llama", vocab_size=102400, hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=30, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                         max_position_embeddings=16384, rms_norm_eps=1e-6),
        vision_config=dict(projection_dim=4096, **_SIGLIP_L_384),
        vq_config=dict(projection_dim=4096, image_token_embed_dim=4096, **_VQ_16),
        image_token_id=100581, tie_word_embeddings=False)},
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

