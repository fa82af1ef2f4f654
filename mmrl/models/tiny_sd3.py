"""A tiny random-init diffusers StableDiffusion3Pipeline (2 CLIP + T5 + SD3 transformer + VAE), built from
configs and a locally trained BPE tokenizer: the stand-in for SD3.5 checkpoints in tests (no hub here)."""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, PreTrainedTokenizerFast, T5Config, T5EncoderModel

_CORPUS = ["a red circle and a blue square", "a photo of a cat on a mat", "two green triangles left of a dog"] * 20


def _tokenizer(max_length: int = 77) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=max_length, padding_side="right")


def build_tiny_sd3_pipeline(seed: int = 0) -> StableDiffusion3Pipeline:
    torch.manual_seed(seed)
    clip = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=77, projection_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=1,
                                          attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                                          caption_projection_dim=16, pooled_projection_dim=64, pos_embed_max_size=16),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                          up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                          latent_channels=16, norm_num_groups=8, sample_size=16, shift_factor=0.0609,
                          scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False),
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer=_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**clip)), tokenizer_2=_tokenizer(),
        text_encoder_3=T5EncoderModel(T5Config(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)),
        tokenizer_3=_tokenizer())
