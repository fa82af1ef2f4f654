"""Your model, in one file: any network that predicts a flow-matching velocity becomes a flow policy.

    model:
      policy: tiny_generator:build     # a builder (cfg) -> Policy
      path: ""                         # unused here; a real builder would load weights from it

The builder wraps the network in a `FlowModel` (the transformer, a prompt encoder, a decoder, the latent shape
and how to call the network) and hands it to mmrl's `FlowPolicy`: SDE sampling with exact log-probs, LoRA or
full fine-tuning, trees, micro-batches and checkpoints then come for free. The network is a diffusers
`ModelMixin` so that checkpoints save and load with `save_pretrained` / `from_pretrained`.
"""

import dataclasses

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config

from mmrl.models.flow_model import FlowModel
from mmrl.policy.base import reference_kind
from mmrl.policy.flow import FlowPolicy

SIZE, TEXT_DIM, VOCAB = 16, 16, 512


class TinyVelocity(ModelMixin, ConfigMixin):
    """v(x, sigma, text): two convolutions, modulated by the text embedding and the noise level."""

    @register_to_config
    def __init__(self, channels: int = 3, width: int = 32, text_dim: int = TEXT_DIM):
        super().__init__()
        self.inp = torch.nn.Conv2d(channels + 1, width, 3, padding=1)
        self.film = torch.nn.Linear(text_dim, 2 * width)
        self.out = torch.nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, x, sigma, pooled):                              # x [N, C, H, W], sigma [N], pooled [N, D]
        s = sigma.view(-1, 1, 1, 1).expand(-1, 1, *x.shape[2:]).to(x)
        h = self.inp(torch.cat([x, s], 1))
        scale, shift = self.film(pooled).unsqueeze(-1).unsqueeze(-1).chunk(2, 1)
        return self.out(torch.nn.functional.silu(h * (1 + scale) + shift))


class HashedText(torch.nn.Module):
    """A frozen bag-of-words text encoder: words hashed into a fixed embedding table."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(VOCAB, TEXT_DIM)

    def forward(self, texts):
        ids = [torch.tensor([sum(map(ord, w)) % VOCAB for w in t.split()] or [0]) for t in texts]
        pooled = torch.stack([self.table(i.to(self.table.weight.device)).mean(0) for i in ids])  # [B, D]
        return pooled.unsqueeze(1), pooled                                                      # enc [B, 1, D]


def build(cfg):
    torch.manual_seed(cfg.train.seed)
    text = HashedText().requires_grad_(False).eval()  # frozen, as mmrl keeps every text encoder
    model = FlowModel(
        transformer=TinyVelocity(), encode_prompts=text, decode=lambda x: x.clamp(-1, 1),
        latent_shape=(3, SIZE, SIZE), text_modules=(text,),
        call=lambda net, x, sigma, enc, pooled: net(x, sigma, pooled))
    # no model family names this network's LoRA targets: the builder does, unless the config names others
    lora = dataclasses.replace(cfg.model.lora, target_modules=cfg.model.lora.target_modules or ["film", "out"])
    return FlowPolicy(model=model, sampler_cfg=cfg.sampler, lora_cfg=lora, reference=reference_kind(cfg),
                      model_path=cfg.model.path, progress=cfg.log.progress, tree_cfg=cfg.tree,
                      micro_batch=cfg.train.micro_batch, text_cache=cfg.model.text_cache)
