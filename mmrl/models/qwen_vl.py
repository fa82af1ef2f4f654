"""Small Qwen-VL models built from configs in code (no hub): the real transformers classes with a tokenizer
and processor made locally. Used by the embedded grounding world and by the tests of the token policy.

    build_tokenizer(corpus)        byte-level BPE with Qwen's special tokens; digits are single tokens and
                                   <answer> / </answer> / <think> / </think> are added tokens (one id each)
    build_processor(kind, tok)     Qwen2VLProcessor | Qwen2_5_VLProcessor | Qwen3VLProcessor
    build_model(kind, tok, size)   Qwen2VLForConditionalGeneration | Qwen2_5_VL... | Qwen3VL...
    build_causal_lm(tok)           Qwen2ForCausalLM (text-only policies)

A saved folder (`save_pretrained` of model and processor) loads back with AutoModelForImageTextToText /
AutoProcessor like any Qwen-VL checkpoint.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|image_pad|>", "<|video_pad|>", "<|vision_pad|>", "<think>", "</think>", "<answer>", "</answer>"]

# Qwen2-VL's chat template, condensed: string or list-of-parts content, images and videos as pad tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' or 'video' in c %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
SIZES = {  # text hidden x layers, vision hidden x depth
    "tiny": dict(hidden=32, layers=1, vhidden=16, vdepth=1),
    "small": dict(hidden=128, layers=4, vhidden=64, vdepth=2),
}


def build_tokenizer(corpus: list[str], vocab_size: int = 384) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus + ["user assistant system You are a helpful assistant."], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", additional_special_tokens=SPECIALS[1:],
                                   chat_template=CHAT_TEMPLATE, padding_side="left")


def build_processor(kind: str, tok: PreTrainedTokenizerFast, frame_pixels: int = 56 * 56):
    """Processor whose frames resize to about `frame_pixels` pixels (qwen-vl-utils resizes videos first)."""
    from transformers import (Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)

    _check_kind(kind)
    patch = 16 if kind == "qwen3_vl" else 14
    f = 2 * patch
    lo, hi = f * f, max(f * f, frame_pixels)
    ip = Qwen2VLImageProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=lo, max_pixels=hi)
    if kind == "qwen3_vl":
        vp = Qwen3VLVideoProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2, do_sample_frames=False,
                                   size={"shortest_edge": lo, "longest_edge": hi * 768})
    else:
        vp = Qwen2VLVideoProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=lo,
                                   max_pixels=hi, do_sample_frames=False)
    cls = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[kind]
    return cls(image_processor=ip, tokenizer=tok, video_processor=vp, chat_template=CHAT_TEMPLATE)


def build_model(kind: str, tok: PreTrainedTokenizerFast, size: str = "tiny"):
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen3VLConfig, Qwen3VLForConditionalGeneration)

    _check_kind(kind)
    s = SIZES[size]
    hidden, heads = s["hidden"], max(2, s["hidden"] // 32)
    half = hidden // heads // 2
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in dict(
        image_token_id="<|image_pad|>", video_token_id="<|video_pad|>", vision_start_token_id="<|vision_start|>",
        vision_end_token_id="<|vision_end|>").items()}
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=s["layers"],
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]},
                bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vh, vd = s["vhidden"], s["vdepth"]
    if kind == "qwen2_5_vl":
        vision = dict(depth=vd, hidden_size=vh, intermediate_size=2 * vh, num_heads=2, out_hidden_size=hidden,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[vd - 1])
        return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                                                                   tie_word_embeddings=True, **ids))
    if kind == "qwen2_vl":
        vision = dict(depth=vd, embed_dim=vh, hidden_size=hidden, mlp_ratio=2, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision,
                                                             tie_word_embeddings=True, **ids))
    text.update(head_dim=hidden // heads)
    text["rope_parameters"]["mrope_interleaved"] = True
    vision = dict(depth=vd, hidden_size=vh, intermediate_size=2 * vh, num_heads=2, out_hidden_size=hidden,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0])
    return Qwen3VLForConditionalGeneration(Qwen3VLConfig(text_config=text, vision_config=vision,
                                                         tie_word_embeddings=True, **ids))


def build_causal_lm(tok: PreTrainedTokenizerFast, hidden: int = 32, layers: int = 1):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=1024, tie_word_embeddings=True,
                                        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                        pad_token_id=tok.pad_token_id))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown Qwen-VL kind {kind!r}; valid: {KINDS}")
