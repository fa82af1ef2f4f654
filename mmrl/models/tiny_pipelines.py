"""Parts of the tiny random-init pipelines that the families' `tiny` builders share (mmrl/models/families/*.py): a
locally trained BPE tokenizer, a 16-channel VAE and small CLIP / T5 configs. Saved with save_pretrained, a tiny
pipeline loads through the same `from_pretrained` code as the real checkpoint (no hub here).

`build_tiny(family, seed, **kw)` builds one by family name: "sd3", "flux", "wan", "qwen_image", "z_image", ..."""

from __future__ import annotations

from diffusers import AutoencoderKL
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = ["a red circle and a blue square", "a photo of a cat on a mat", "two green triangles left of a dog"] * 20
CLIP = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            max_position_embeddings=77, projection_dim=32, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_T5 = dict(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)


def tiny_tokenizer(max_length: int = 77) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=max_length, padding_side="right")


def tiny_vae() -> AutoencoderKL:  # 16 latent channels, x2 spatial compression
    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                         latent_channels=16, norm_num_groups=8, sample_size=16, shift_factor=0.0609,
                         scaling_factor=1.5035, use_quant_conv=False, use_post_quant_conv=False)


def build_tiny(family: str, seed: int = 0, **kw):
    """The tiny pipeline of a registered family (its `tiny` builder)."""
    from mmrl.models.families import FAMILIES

    fam = FAMILIES[family]
    if fam.tiny is None:
        raise ValueError(f"family {family!r} has no tiny builder")
    return fam.tiny(seed, **kw)
