"""Tiny random-init diffusers pipelines of the real classes, built from configs and a locally trained BPE
tokenizer: the stand-ins for SD3.5, FLUX.1, Wan2.x, Qwen-Image and Z-Image checkpoints in tests (no hub here). Saved with
save_pretrained, they load through the same `from_pretrained` code as the real checkpoints."""

from __future__ import annotations

import torch
from diffusers import (AutoencoderKL, AutoencoderKLQwenImage, AutoencoderKLWan, FlowMatchEulerDiscreteScheduler,
                       FluxPipeline, FluxTransformer2DModel, QwenImagePipeline, QwenImageTransformer2DModel,
                       SD3Transformer2DModel, StableDiffusion3Pipeline, WanPipeline, WanTransformer3DModel,
                       ZImagePipeline, ZImageTransformer2DModel)
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, PreTrainedTokenizerFast, T5Config,
                          T5EncoderModel, UMT5Config, UMT5EncoderModel)

_CORPUS = ["a red circle and a blue square", "a photo of a cat on a mat", "two green triangles left of a dog"] * 20


def _tokenizer(max_length: int = 77) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=max_length, padding_side="right")


CLIP = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=77, projection_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _vae() -> AutoencoderKL:  # 16 latent channels, x2 spatial compression
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                         latent_channels=16, norm_num_groups=8, sample_size=16, shift_factor=0.0609,
                         scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False)


def build_tiny_sd3_pipeline(seed: int = 0) -> StableDiffusion3Pipeline:
    torch.manual_seed(seed)
    clip = CLIP
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=1,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                          caption_projection_dim=16, pooled_projection_dim=64, pos_embed_max_size=16),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=_vae(),
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer=_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer_2=_tokenizer(),
        text_encoder_3=T5EncoderModel(T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)),
        tokenizer_3=_tokenizer())


def build_tiny_flux_pipeline(seed: int = 0, guidance_embeds: bool = True) -> FluxPipeline:
    """FLUX.1-dev layout: CLIP (pooled) + T5 (tokens), a FluxTransformer2DModel over 2x2-packed 16-channel latents
    (in_channels 64), the guidance embedding on (dev) or off (schnell)."""
    torch.manual_seed(seed)
    return FluxPipeline(
        transformer=FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                           pooled_projection_dim=32, guidance_embeds=guidance_embeds,
                                           axes_dims_rope=(4, 4, 8)),
        scheduler=FlowMatchEulerDiscreteScheduler(  # FLUX.1's scheduler config: resolution-dependent shift
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
            max_image_seq_len=4096), vae=_vae(),
        text_encoder=CLIPTextModel(CLIPTextConfig(**CLIP)), tokenizer=_tokenizer(),
        text_encoder_2=T5EncoderModel(T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)),
        tokenizer_2=_tokenizer(32))


def _wan_transformer() -> WanTransformer3DModel:
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                                 out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def build_tiny_wan_pipeline(seed: int = 0, two_experts: bool = False) -> WanPipeline:
    """Wan2.1 layout: UMT5 text encoder, WanTransformer3DModel over [16, F', H, W] video latents, the causal video
    VAE (x4 temporal, x8 spatial compression). two_experts: Wan2.2 A14B's layout, a low-noise transformer_2 used
    below boundary_ratio 0.875 (its T2V value)."""
    torch.manual_seed(seed)
    experts = dict(transformer_2=_wan_transformer(), boundary_ratio=0.875) if two_experts else {}
    return WanPipeline(
        transformer=_wan_transformer(), **experts,
        vae=AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                             temperal_downsample=[False, True, True]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=UMT5EncoderModel(UMT5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                 num_heads=4)),
        tokenizer=_tokenizer(32))


def build_tiny_qwen_image_pipeline(seed: int = 0) -> QwenImagePipeline:
    """Qwen-Image layout: a Qwen2.5-VL text encoder (its last hidden states, chat template), a
    QwenImageTransformer2DModel over 2x2-packed 16-channel latents (in_channels 64) with 3-axis RoPE, the Qwen-Image
    VAE (Wan-style, one frame, x8 spatial) and the dynamic-shift scheduler with its terminal sigma 0.02."""
    from mmrl.models.qwen_vl import build_model, build_tokenizer

    torch.manual_seed(seed)
    tok = build_tokenizer(_CORPUS + ["Describe the image by detailing the color shape size texture quantity text"])
    text_encoder = build_model("qwen2_5_vl", tok, "tiny")  # hidden size 32 = the transformer's joint_attention_dim
    return QwenImagePipeline(
        transformer=QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=1,
                                                attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                                axes_dims_rope=(4, 6, 6)),
        vae=AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                   temperal_downsample=[False, True, True]),
        scheduler=FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler config
            shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
            max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential"),
        text_encoder=text_encoder, tokenizer=tok)


def build_tiny_z_image_pipeline(seed: int = 0) -> ZImagePipeline:
    """Z-Image layout: a Qwen3 text encoder (its second-to-last hidden states, chat template), a single-stream
    ZImageTransformer2DModel (text and image refiners, then joint layers; 2x2 patches inside), the FLUX VAE and a
    static shift 3 scheduler (Z-Image-Turbo's)."""
    from transformers import Qwen3Config, Qwen3Model

    from mmrl.models.qwen_vl import build_tokenizer

    torch.manual_seed(seed)
    tok = build_tokenizer(_CORPUS)
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          max_position_embeddings=1024, pad_token_id=tok.pad_token_id))
    return ZImagePipeline(
        transformer=ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32,
                                             n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                             axes_dims=[4, 6, 6], axes_lens=[64, 32, 32]),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_vae(), text_encoder=text_encoder, tokenizer=tok)
