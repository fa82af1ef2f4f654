"""Your own model family, in one file: Stable Diffusion 3 without its T5-XXL text encoder (4.7 B parameters and
~9 GiB of bf16 weights fewer; the pipeline then feeds zeros where T5's tokens go, as diffusers does for
`text_encoder_3=None`). Named in YAML without touching mmrl:

    model:
      path: /models/stable-diffusion-3.5-medium
      family: my_family:FAMILY

A family says how a folder becomes a FlowModel (`load`: text encoding, the transformer call, the schedule, the VAE
decode), its LoRA targets and the diffusers pipeline whose LoRA loader reads them, what `mmrl plan` feeds the
transformer, and optionally published sizes and a tiny builder (mmrl/models/families/__init__.py, `Family`). This one
reuses the built-in SD3 family's pieces and changes what it loads; the loader stamps it on the model it returns
(`model.family`), and training and `mmrl plan` read its LoRA targets from there.
"""

import dataclasses

import torch

from mmrl.models.families import Family, LoadOptions, sd3
from mmrl.models.families.common import vae_decoder
from mmrl.models.flow_model import FlowModel, sd3_call


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(folder, text_encoder_3=None, tokenizer_3=None,
                                                    dtype=options.dtype).to(options.device)

    @torch.no_grad()
    def encode(texts):  # CLIP-L + CLIP-G tokens [B, 77, D] then zeros [B, 256, D] where T5's would be; pooled [B, P]
        enc, _, pooled, _ = pipe.encode_prompt(list(texts), list(texts), None, device=pipe.device,
                                               do_classifier_free_guidance=False)
        return enc, pooled

    size = options.sample_size or pipe.default_sample_size
    return FlowModel(pipe.transformer, encode, vae_decoder(pipe.vae), (pipe.transformer.config.in_channels, size, size),
                     (pipe.text_encoder, pipe.text_encoder_2, pipe.vae), call=sd3_call)


# mmrl plan: the transformer sees the same shapes; the frozen parts are the two CLIPs and the VAE
FAMILY = dataclasses.replace(sd3.FAMILY, name="sd3_no_t5", load=load,
                             frozen_parts=(sd3.FAMILY.frozen_parts[0][:2], sd3.FAMILY.frozen_parts[1]))
assert isinstance(FAMILY, Family)
