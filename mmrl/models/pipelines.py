"""Flow models from folders: diffusers pipelines (SD3 / SD3.5, FLUX.1, Wan2.x, loaded with `from_pretrained`) and
mmrl's pixel-space model; `load_flow_model(path)` picks by the folder's model_index.json.

Each loader gives the FlowModel its transformer call: how the architecture takes latents, sigma and text.
Samplers and policies always see unpacked latents x [N, *latent_shape] and a velocity of the same shape:
- SD3 (`SD3Transformer2DModel`): x [N, 16, H, W]; timestep = 1000 sigma; T5+CLIP tokens and pooled CLIP.
- FLUX.1 (`FluxTransformer2DModel`): x [N, 16, H, W] is packed into 2x2 patches [N, HW/4, 64] for the call
  and unpacked after (a permutation, so densities are unchanged); timestep = sigma; the guidance embedding
  (FLUX.1-dev; `model.guidance`, 3.5 by default) replaces classifier-free guidance; image and text RoPE ids.
- Wan2.x (`WanTransformer3DModel`): video latents x [N, 16, F', H, W] (F' = (frames - 1) / 4 + 1);
  timestep = 1000 sigma; UMT5 tokens, no pooled embedding (an empty [N, 0] tensor stands in). Wan2.2 A14B's
  two experts: `transformer` for sigma >= boundary_ratio, `transformer_2` below, both trained.
Scheduler shifts come from sampler.shift (static), except FLUX's resolution-dependent shift, taken from the
pipeline's scheduler config (use_dynamic_shifting) as FluxPipeline applies it.
"""

from __future__ import annotations

import json
import os

import torch

from mmrl.models.flow_model import SD3_LORA_TARGETS, EncodeFn, FlowModel, dynamic_shift_mu, sd3_call
from mmrl.models.pixel_t2i import PIPELINE_CLASS

# LoRA targets per architecture (peft matches module-name suffixes)
WAN_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # self- and cross-attention of every block
PIPELINES = ("StableDiffusion3Pipeline", "FluxPipeline", "WanPipeline")


def flux_call(guidance: float):
    def call(transformer, x, sigma, enc, pooled):
        n, c, h, w = x.shape
        packed = x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, h * w // 4, c * 4)
        rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(x)   # [HW/4, 3]
        txt_ids = torch.zeros(enc.shape[1], 3).to(x)                                            # [L, 3]
        g = torch.full((n,), guidance).to(x) if transformer.config.guidance_embeds else None
        out = transformer(hidden_states=packed, timestep=sigma, guidance=g, pooled_projections=pooled,
                          encoder_hidden_states=enc, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return out.view(n, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c, h, w)

    return call


def wan_call(transformer, x, sigma, enc, pooled):
    return transformer(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=enc, return_dict=False)[0]


def coordinates(x: torch.Tensor) -> torch.Tensor:
    """Fixed frame, row and column ramps in [-1, 1] for a video x [N, C, F, H, W] -> [N, 3, F, H, W]."""
    n, _, f, h, w = x.shape
    grid = torch.meshgrid(*(torch.linspace(-1, 1, k) for k in (f, h, w)), indexing="ij")
    return torch.stack(grid).to(x).expand(n, -1, -1, -1, -1)


def wan_coord_call(transformer, x, sigma, enc, pooled):
    """wan_call with the three `coordinates` channels concatenated to the input (in_channels = C + 3), the way
    Wan I2V concatenates its conditioning latents. Wan's 3-D RoPE is relative only, so from pure noise a token
    cannot tell where it is; these channels give the embedded pixel-space video model absolute positions."""
    return wan_call(transformer, torch.cat([x, coordinates(x)], 1), sigma, enc, pooled)


def load_pipeline_model(cls: str, path: str, dtype: torch.dtype, device: str, sample_size: int | None,
                        num_frames: int | None, guidance: float):
    """A FlowModel of the diffusers pipeline folder `path` whose model_index.json names `cls`."""
    import diffusers

    pipe = getattr(diffusers, cls).from_pretrained(path, dtype=dtype).to(device)
    vae, tr = pipe.vae, pipe.transformer

    if cls == "WanPipeline":
        @torch.no_grad()
        def encode(texts):
            enc, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, device=pipe.device)
            return enc, enc.new_zeros(len(texts), 0)

        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

        def decode(latents):  # [N, 16, F', H, W] -> video [N, 3, F, 8H, 8W] in [-1, 1]
            z = latents.to(vae.dtype) * std.to(latents) + mean.to(latents)
            return vae.decode(z, return_dict=False)[0].float().clamp(-1, 1)

        frames = num_frames or 81
        size = sample_size or 60  # 480 px
        shape = (tr.config.in_channels, (frames - 1) // pipe.vae_scale_factor_temporal + 1, size, size)
        # Wan2.2 A14B: transformer_2 denoises below boundary_ratio (sigma; = timestep / num_train_timesteps)
        boundary = pipe.config.get("boundary_ratio") if getattr(pipe, "transformer_2", None) is not None else None
        return FlowModel(tr, encode, decode, shape, (pipe.text_encoder, vae), pipeline_class=cls,
                         call=wan_call, lora_targets=WAN_LORA_TARGETS,
                         transformer_2=pipe.transformer_2 if boundary is not None else None, boundary=boundary)

    if cls == "FluxPipeline":
        @torch.no_grad()
        def encode(texts):
            length = min(512, pipe.tokenizer_2.model_max_length)
            enc, pooled, _ = pipe.encode_prompt(list(texts), list(texts), device=pipe.device, max_sequence_length=length)
            return enc, pooled

        channels, call = tr.config.in_channels // 4, flux_call(guidance)
        size = sample_size or pipe.default_sample_size
        texts = (pipe.text_encoder, pipe.text_encoder_2)
        mu = dynamic_shift_mu((size // 2) ** 2, dict(pipe.scheduler.config))  # packed 2x2: (H/2)(W/2) tokens
    else:
        @torch.no_grad()
        def encode(texts):
            enc, _, pooled, _ = pipe.encode_prompt(list(texts), list(texts), list(texts), device=pipe.device,
                                                   do_classifier_free_guidance=False)
            return enc, pooled

        channels, call = tr.config.in_channels, sd3_call
        size = sample_size or pipe.default_sample_size
        texts = tuple(m for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3) if m is not None)

    def decode(latents):  # [N, 16, H, W] -> images [N, 3, 8H, 8W] in [-1, 1]
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0].float().clamp(-1, 1)

    return FlowModel(tr, encode, decode, (channels, size, size), texts + (vae,), pipeline_class=cls, call=call,
                     lora_targets=SD3_LORA_TARGETS, schedule_mu=mu if cls == "FluxPipeline" else None)


def _pixel_model(path: str, dtype: torch.dtype) -> FlowModel:
    import diffusers
    from transformers import CLIPTextModelWithProjection, PreTrainedTokenizerFast

    index = json.load(open(os.path.join(path, "model_index.json")))
    cls = index.get("transformer_class", "SD3Transformer2DModel")
    if cls not in ("SD3Transformer2DModel", "WanTransformer3DModel"):
        raise ValueError(f"{path}: unsupported transformer_class {cls!r} (SD3Transformer2DModel, WanTransformer3DModel)")
    transformer = getattr(diffusers, cls).from_pretrained(os.path.join(path, "transformer"), dtype=dtype)
    text_encoder = CLIPTextModelWithProjection.from_pretrained(os.path.join(path, "text_encoder"))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(os.path.join(path, "tokenizer"))
    size, ch = index["sample_size"], index["channels"]
    video = cls == "WanTransformer3DModel"
    shape = (ch, index["frames"], size, size) if video else (ch, size, size)
    return FlowModel(transformer, make_clip_encoder(tokenizer, text_encoder), lambda x: x.clamp(-1, 1), shape,
                     (text_encoder,), prediction=index.get("prediction", "velocity"),
                     call=(wan_coord_call if index.get("coordinates") else wan_call) if video else sd3_call, lora_targets=WAN_LORA_TARGETS if video else SD3_LORA_TARGETS)


def make_clip_encoder(tokenizer, text_encoder) -> EncodeFn:
    """Encode texts with a CLIP text model: (last_hidden_state [B, L, D], text_embeds [B, D])."""

    def encode(texts: list[str]):
        ids = tokenizer(list(texts), padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        return_tensors="pt").to(text_encoder.device)
        out = text_encoder(input_ids=ids.input_ids, attention_mask=ids.attention_mask)
        return out.last_hidden_state, out.text_embeds

    return encode


def load_flow_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    sample_size: int | None = None, num_frames: int | None = None, guidance: float = 3.5) -> FlowModel:
    """Load a flow generator folder: a diffusers SD3 / FLUX / Wan pipeline or mmrl's pixel model.
    `sample_size` overrides the latent size (H = W) of pipelines, `num_frames` the video length of Wan,
    `guidance` is FLUX's guidance-embedding scale."""
    index_file = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_file):
        raise FileNotFoundError(f"{path!r} has no model_index.json: point model.path at a diffusers "
                                f"pipeline folder ({', '.join(PIPELINES)}) or an mmrl pixel-model folder "
                                f"(scripts/pretrain_world.py writes one)")
    cls = json.load(open(index_file)).get("_class_name")
    if cls == PIPELINE_CLASS:
        model = _pixel_model(path, dtype)
    elif cls in PIPELINES or cls == "StableDiffusion3Img2ImgPipeline":
        cls = "StableDiffusion3Pipeline" if cls.startswith("StableDiffusion3") else cls
        model = load_pipeline_model(cls, path, dtype, device, sample_size, num_frames, guidance)
    else:
        raise ValueError(f"unsupported pipeline class {cls!r} in {index_file}; supported: "
                         f"{PIPELINE_CLASS}, {', '.join(PIPELINES)}")
    for m in model.text_modules:
        m.requires_grad_(False).eval()
    model.transformer.to(device)
    if model.transformer_2 is not None:
        model.transformer_2.to(device)
    for m in model.text_modules:
        m.to(device)
    return model
