"""Parts several families share: loading a diffusers pipeline folder, 2x2 latent packing, VAE decoders, the
padded prompt layout of chat-template text encoders, the flow-matching sigma schedules, SD3's LoRA targets."""

from __future__ import annotations

import numpy as np
import torch

from mmrl.models.families import LoadOptions

TEXT_LEN = 128  # Qwen-Image / Z-Image prompts are padded to this many tokens (after the template), masked
# LoRA targets of SD3-family transformers (SD3, FLUX.1, mmrl's pixel image model; peft matches module-name suffixes):
# the joint attention projections
SD3_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")


def from_pretrained(folder: str, index: dict, options: LoadOptions):
    """The diffusers pipeline of `folder` (its model_index.json class), on options.device."""
    import diffusers

    from mmrl.models.shard_load import meta_component

    skip = {name: None for name in options.meta}  # built below without weights (options.meta)
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(folder, dtype=options.dtype, **skip).to(options.device)
    for name in options.meta:
        setattr(pipe, name, meta_component(folder, name, options.dtype))
    return pipe


def pack2x2(x: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] -> [N, HW/4, 4C]: 2x2 latent patches as tokens (FLUX, Qwen-Image; a permutation)."""
    n, c, h, w = x.shape
    return x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, h * w // 4, c * 4)


def unpack2x2(tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    n, c, h, w = shape
    return tokens.view(n, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c, h, w)


def vae_decoder(vae):
    """AutoencoderKL (SD3, FLUX.1, Z-Image): latents [N, 16, H, W] -> images [N, 3, fH, fW] in [-1, 1]."""
    def decode(latents):
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0].float().clamp(-1, 1)

    decode.vae, decode.costs = vae, {}  # rollouts decode in memory-bounded batches (mmrl/models/decode_batch.py)
    return decode


def vae_encoder(vae):
    """AutoencoderKL: images [N, 3, fH, fW] in [-1, 1] -> latents [N, 16, H, W], the posterior's mode shifted and
    scaled as the pipelines do for image-to-image."""
    @torch.no_grad()
    def encode(images):
        z = vae.encode(images.to(vae.device, vae.dtype)).latent_dist.mode()
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()

    return encode


def wan_vae_decoder(vae):
    """Wan / Qwen-Image VAEs (per-channel latents_mean / latents_std): [N, 16, F', H, W] -> [N, 3, F, fH, fW]."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

    def decode(latents):
        z = latents.to(vae.dtype) * std.to(latents) + mean.to(latents)
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    decode.vae, decode.costs = vae, {}  # rollouts decode in memory-bounded batches (mmrl/models/decode_batch.py)
    return decode


def padded(embeds: list[torch.Tensor], length: int = TEXT_LEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt token embeddings [L_i, D] -> (enc [B, length, D] zero-padded, mask [B, length] 1 = token)."""
    enc = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, length - len(e))) for e in embeds])
    mask = torch.stack([(torch.arange(length) < len(e)).to(enc) for e in embeds])
    return enc, mask


# ------------------------------------------------------------------------------------------------ schedules
def sigma_schedule(num_steps: int, shift: float = 1.0, mu: float | None = None,
                   shift_terminal: float | None = None, linspace: bool = False) -> torch.Tensor:
    """[num_steps + 1] sigmas from 1 to 0 as diffusers' FlowMatchEulerDiscreteScheduler sets them: a static shift
    s (SD3: sigma' = s sigma / (1 + (s - 1) sigma)), or, when mu is given, FLUX's resolution-dependent shift
    sigma' = e^mu / (e^mu + 1 / sigma - 1) of sigma = linspace(1, 1 / S, S), as FluxPipeline calls it, stretched
    to end at shift_terminal when given (Qwen-Image). linspace: the static shift of linspace(1, 1 / S, S) (Z-Image)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if mu is None:
        sch = FlowMatchEulerDiscreteScheduler(shift=shift)
        sch.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps) if linspace else None)
    else:
        sch = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift_terminal=shift_terminal)
        sch.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return sch.sigmas.float().clone()


def static_schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """The default schedule: sampler.shift applied to linspace(1, 0) (SD3, Wan, the pixel worlds)."""
    return sigma_schedule(num_steps, shift)


def dynamic_schedule(mu: float, shift_terminal: float | None = None):
    """A schedule whose shift is fixed by the resolution (mu; sampler.shift is not used)."""
    def schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
        return sigma_schedule(num_steps, mu=mu, shift_terminal=shift_terminal)

    schedule.mu = mu
    return schedule


def dynamic_shift_mu(image_seq_len: int, scheduler_config: dict) -> float | None:
    """FLUX's mu: linear in the packed image sequence length between (base_image_seq_len, base_shift) and
    (max_image_seq_len, max_shift); None when the scheduler does not shift dynamically."""
    c = scheduler_config
    if not c.get("use_dynamic_shifting"):
        return None
    lo, hi = c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096)
    b0, b1 = c.get("base_shift", 0.5), c.get("max_shift", 1.15)
    return b0 + (image_seq_len - lo) * (b1 - b0) / (hi - lo)
