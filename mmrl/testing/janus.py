"""A word-level tokenizer with Janus-Pro's special tokens and chat template, offline: what tiny Janus models (the
tests) and the embedded AR shapes world (scripts/pretrain_ar_world.py) tokenize with."""

from __future__ import annotations

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|User|>", "<|Assistant|>", "<image_placeholder>", "<begin_of_image>",
            "<end_of_image>"]
# Janus-Pro's prompt form: <|User|>: {text}\n\n<|Assistant|>: (the processor then appends <begin_of_image>)
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|User|>: {% else %}<|Assistant|>: {% endif %}"
            "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{{ '\\n\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}<|Assistant|>:{% endif %}")


def word_tokenizer(words: list[str]):
    """A PreTrainedTokenizerFast over SPECIALS + words (left padding, a BOS before every text, Janus's image tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + list(words))}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.add_special_tokens(SPECIALS)
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="left", additional_special_tokens=SPECIALS[4:],
                                   extra_special_tokens={"image_token": "<image_placeholder>",
                                                         "boi_token": "<begin_of_image>", "eoi_token": "<end_of_image>"})
