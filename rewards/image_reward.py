"""ImageReward (Xu et al. 2023) on transformers' BLIP classes, loading the released `ImageReward.pt` directly
(the `image-reward` package pins timm 0.6 and fairscale; mmrl does not need it).

The model: BLIP's ViT-L/16 image encoder (224 px) and its BERT-base text encoder with cross-attention to the
image tokens; the [CLS] state of the caption (bert-base-uncased, padded to 35 tokens) goes through a 5-layer
MLP head, and the score is standardized with the training statistics:

    score = (mlp(text_encoder(caption | image)[:, 0]) - 0.16717362830052426) / 1.0333394966054072

`checkpoint`: ImageReward.pt (keys blip.visual_encoder.*, blip.text_encoder.*, mlp.layers.*; loaded with
weights_only=True and renamed to the transformers modules here). `tokenizer`: a bert-base-uncased folder.
Images [N, 3, H, W] in [-1, 1]; scores are roughly N(0, 1) over the ImageReward benchmark.
"""

from __future__ import annotations

import re

import torch

from mmrl.errors import ConfigError
from rewards.clip_models import AestheticMLP, _prompts, clip_preprocess, load_state

MEAN, STD = 0.16717362830052426, 1.0333394966054072
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
LARGE = dict(vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                         image_size=224, patch_size=16, layer_norm_eps=1e-6),
             text=dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       num_attention_heads=12, encoder_hidden_size=1024, max_position_embeddings=512))

_VISION_RENAMES = [(r"^cls_token$", "embeddings.class_embedding"), (r"^pos_embed$", "embeddings.position_embedding"),
                   (r"^patch_embed\.proj\.", "embeddings.patch_embedding."), (r"^norm\.", "post_layernorm."),
                   (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
                   (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
                   (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
                   (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
                   (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp.")]


def convert_checkpoint(sd: dict) -> dict:
    """ImageReward.pt keys -> this module's keys (vision.*, text.*, mlp.*); BLIP's unused heads are dropped."""
    out = {}
    for k, v in sd.items():
        if k.startswith("blip.visual_encoder."):
            k = k[len("blip.visual_encoder."):]
            for pat, rep in _VISION_RENAMES:
                k = re.sub(pat, rep, k)
            out["vision." + k] = v
        elif k.startswith("blip.text_encoder.") and "position_ids" not in k and ".pooler." not in k:
            out["text." + k[len("blip.text_encoder."):]] = v
        elif k.startswith("mlp."):
            out[k] = v
    return out


class ImageRewardModel(torch.nn.Module):
    def __init__(self, vision: dict, text: dict):
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        super().__init__()
        self.vision = BlipVisionModel(BlipVisionConfig(**vision))
        self.text = BlipTextModel(BlipTextConfig(**text), add_pooling_layer=False)
        self.mlp = AestheticMLP(text["hidden_size"])  # the same head layout (layers.0/2/4/6/7)

    def forward(self, pixel_values, input_ids, attention_mask) -> torch.Tensor:
        img = self.vision(pixel_values=pixel_values).last_hidden_state                 # [N, 1 + P, Dv]
        att = torch.ones(img.shape[:2], dtype=torch.long, device=img.device)
        txt = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=img,
                        encoder_attention_mask=att).last_hidden_state[:, 0]            # [N, Dt]
        return (self.mlp(txt) - MEAN) / STD


class ImageReward:
    """`(images, examples) -> {"overall": [N]}`; the model loads on first use. `config` overrides the ViT-L /
    BERT-base sizes (tests build tiny ones)."""

    def __init__(self, checkpoint: str, tokenizer: str, config: dict | None = None, batch_size: int = 16,
                 device: str = "cpu"):
        self.checkpoint, self.tokenizer_path, self.config = checkpoint, tokenizer, config or LARGE
        self.batch_size, self.device, self.model = batch_size, device, None

    def _load(self):
        if self.model is None:
            from transformers import AutoTokenizer

            model = ImageRewardModel(self.config["vision"], self.config["text"])
            missing, _ = model.load_state_dict(convert_checkpoint(load_state(self.checkpoint)), strict=False)
            if missing:
                raise ConfigError(f"{self.checkpoint}: not an ImageReward checkpoint, missing {missing[:4]} ...")
            self.model = model.to(self.device).eval().requires_grad_(False)
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            self.size = self.config["vision"]["image_size"]
        return self.model

    @torch.no_grad()
    def __call__(self, images, examples) -> dict[str, torch.Tensor]:
        m, texts, out = self._load(), _prompts(examples), []
        for s in range(0, len(texts), self.batch_size):
            px = clip_preprocess(images[s:s + self.batch_size], self.size, CLIP_MEAN, CLIP_STD).to(self.device)
            tok = self.tokenizer(texts[s:s + self.batch_size], padding="max_length", truncation=True, max_length=35,
                                 return_tensors="pt").to(self.device)
            out.append(m(px, tok.input_ids, tok.attention_mask).float().cpu())
        return {"overall": torch.cat(out)}
