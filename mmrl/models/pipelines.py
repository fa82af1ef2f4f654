"""Flow models from folders: diffusers pipelines (SD3 / SD3.5, FLUX.1, Wan2.x, Qwen-Image; `from_pretrained`) and
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
- Qwen-Image (`QwenImageTransformer2DModel`): x [N, 16, H, W] packed 2x2 as FLUX; timestep = sigma; the last
  hidden states of its Qwen2.5-VL text encoder (chat template, padded to QWEN_IMAGE_TEXT_LEN) with their padding
  mask in the `pooled` slot; dynamic shift with the scheduler's terminal sigma. Its pipeline renormalizes the
  guided velocity to the conditional one's norm ("true CFG"); mmrl's CFG is the plain v_u + w (v_c - v_u).
- Z-Image (`ZImageTransformer2DModel`): lists of one-frame latents and of each prompt's unpadded Qwen3 tokens
  (padded + masked in mmrl, unpadded for the call); time t = 1 - sigma and output x0 - eps, so v = -output.
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
# Qwen-Image: the joint-attention projections of every dual-stream block (image and text streams) and the MLPs
QWEN_IMAGE_LORA_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                           "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj",
                           "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
Z_IMAGE_LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")
QWEN_IMAGE_TEXT_LEN = 128  # Qwen-Image / Z-Image prompts are padded to this many tokens (after the template), masked
PIPELINES = ("StableDiffusion3Pipeline", "FluxPipeline", "WanPipeline", "QwenImagePipeline", "ZImagePipeline")


def flux_call(guidance: float):
    def call(transformer, x, sigma, enc, pooled):
        n, c, h, w = x.shape
        packed = pack2x2(x)
        rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).to(x)   # [HW/4, 3]
        txt_ids = torch.zeros(enc.shape[1], 3).to(x)                                            # [L, 3]
        g = torch.full((n,), guidance).to(x) if transformer.config.guidance_embeds else None
        out = transformer(hidden_states=packed, timestep=sigma, guidance=g, pooled_projections=pooled,
                          encoder_hidden_states=enc, txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        return unpack2x2(out, x.shape)

    return call


def pack2x2(x: torch.Tensor) -> torch.Tensor:
    """[N, C, H, W] -> [N, HW/4, 4C]: 2x2 latent patches as tokens (FLUX, Qwen-Image; a permutation)."""
    n, c, h, w = x.shape
    return x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, h * w // 4, c * 4)


def unpack2x2(tokens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    n, c, h, w = shape
    return tokens.view(n, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c, h, w)


def qwen_image_call(transformer, x, sigma, enc, mask):
    """Qwen-Image: x [N, 16, H, W] packed 2x2 like FLUX; timestep = sigma; the text padding mask [N, L] rides in
    the `pooled` slot (Qwen-Image has no pooled embedding); one image of (1, H/2, W/2) tokens per row for RoPE."""
    n, _, h, w = x.shape
    out = transformer(hidden_states=pack2x2(x), timestep=sigma, encoder_hidden_states=enc,
                      encoder_hidden_states_mask=mask, img_shapes=[[(1, h // 2, w // 2)]] * n, return_dict=False)[0]
    return unpack2x2(out, x.shape)


def z_image_call(transformer, x, sigma, enc, mask):
    """Z-Image: lists of one-frame latents [16, 1, H, W] and of each prompt's unpadded tokens; its time runs the
    other way (t = 1 - sigma) and it predicts x0 - eps, so v = -output."""
    caps = [e[m.bool()] for e, m in zip(enc, mask)]
    out = transformer(list(x.unsqueeze(2).unbind(0)), 1 - sigma, caps, return_dict=False)[0]
    return -torch.stack([o.float() for o in out]).squeeze(2)


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
                        num_frames: int | None, guidance: float, text_max_length: int | None = None):
    """A FlowModel of the diffusers pipeline folder `path` whose model_index.json names `cls`. text_max_length:
    the T5 / UMT5 prompt length (the pipeline's default when None: SD3 256, FLUX 512, Wan 512)."""
    length_kw = {} if text_max_length is None else {"max_sequence_length": text_max_length}
    import diffusers

    pipe = getattr(diffusers, cls).from_pretrained(path, dtype=dtype).to(device)
    vae, tr = pipe.vae, pipe.transformer

    if cls == "WanPipeline":
        @torch.no_grad()
        def encode(texts):
            enc, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, device=pipe.device, **length_kw)
            return enc, enc.new_zeros(len(texts), 0)

        decode = _wan_vae_decoder(vae)  # [N, 16, F', H, W] -> video [N, 3, F, 8H, 8W] in [-1, 1]
        frames = num_frames or 81
        size = sample_size or 60  # 480 px
        shape = (tr.config.in_channels, (frames - 1) // pipe.vae_scale_factor_temporal + 1, size, size)
        # Wan2.2 A14B: transformer_2 denoises below boundary_ratio (sigma; = timestep / num_train_timesteps)
        boundary = pipe.config.get("boundary_ratio") if getattr(pipe, "transformer_2", None) is not None else None
        return FlowModel(tr, encode, decode, shape, (pipe.text_encoder, vae), pipeline_class=cls,
                         call=wan_call, lora_targets=WAN_LORA_TARGETS,
                         transformer_2=pipe.transformer_2 if boundary is not None else None, boundary=boundary)

    if cls == "QwenImagePipeline":
        return _qwen_image_model(pipe, sample_size)
    if cls == "ZImagePipeline":
        return _z_image_model(pipe, sample_size)

    if cls == "FluxPipeline":
        @torch.no_grad()
        def encode(texts):
            length = text_max_length or min(512, pipe.tokenizer_2.model_max_length)
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
                                                   do_classifier_free_guidance=False, **length_kw)
            return enc, pooled

        channels, call = tr.config.in_channels, sd3_call
        size = sample_size or pipe.default_sample_size
        texts = tuple(m for m in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3) if m is not None)

    return FlowModel(tr, encode, _vae_decoder(vae), (channels, size, size), texts + (vae,), pipeline_class=cls, call=call,
                     lora_targets=SD3_LORA_TARGETS, schedule_mu=mu if cls == "FluxPipeline" else None)


def _vae_decoder(vae):
    """SD3 / FLUX / Z-Image (AutoencoderKL): latents [N, 16, H, W] -> images [N, 3, fH, fW] in [-1, 1]."""
    def decode(latents):
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0].float().clamp(-1, 1)

    return decode


def _wan_vae_decoder(vae):
    """Wan / Qwen-Image VAEs (per-channel latents_mean / latents_std): [N, 16, F', H, W] -> [N, 3, F, fH, fW]."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)

    def decode(latents):
        z = latents.to(vae.dtype) * std.to(latents) + mean.to(latents)
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    return decode


def _qwen_image_model(pipe, sample_size: int | None) -> FlowModel:
    vae, tr = pipe.vae, pipe.transformer

    @torch.no_grad()
    def encode(texts):  # (enc [B, L, D], mask [B, L]) at L = QWEN_IMAGE_TEXT_LEN: every prompt one shape, cacheable
        enc, mask = pipe.encode_prompt(list(texts), device=pipe.device, max_sequence_length=QWEN_IMAGE_TEXT_LEN)
        return _padded(list(enc) if mask is None else [e[m.bool()] for e, m in zip(enc, mask)])

    video_decode = _wan_vae_decoder(vae)

    def decode(latents):  # [N, 16, H, W] -> images [N, 3, 8H, 8W] in [-1, 1] (the VAE's one-frame video axis)
        return video_decode(latents[:, :, None])[:, :, 0]

    size = sample_size or pipe.default_sample_size
    config = dict(pipe.scheduler.config)
    return FlowModel(tr, encode, decode, (tr.config.out_channels, size, size), (pipe.text_encoder, vae),
                     pipeline_class="QwenImagePipeline", call=qwen_image_call, lora_targets=QWEN_IMAGE_LORA_TARGETS,
                     schedule_mu=dynamic_shift_mu((size // 2) ** 2, config), shift_terminal=config.get("shift_terminal"))


def _padded(embeds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt token embeddings [L_i, D] -> (enc [B, QWEN_IMAGE_TEXT_LEN, D] zero-padded, mask [B, L] 1 = token)."""
    enc = torch.stack([torch.nn.functional.pad(e, (0, 0, 0, QWEN_IMAGE_TEXT_LEN - len(e))) for e in embeds])
    mask = torch.stack([(torch.arange(QWEN_IMAGE_TEXT_LEN) < len(e)).to(enc) for e in embeds])
    return enc, mask


def _z_image_model(pipe, sample_size: int | None) -> FlowModel:
    vae, tr = pipe.vae, pipe.transformer

    @torch.no_grad()
    def encode(texts):  # (enc [B, L, D], mask [B, L]): the prompt's tokens, padded to one length for the cache
        embeds, _ = pipe.encode_prompt(list(texts), device=pipe.device, do_classifier_free_guidance=False,
                                       max_sequence_length=QWEN_IMAGE_TEXT_LEN)
        return _padded(embeds)

    size = sample_size or 2 * (1024 // (pipe.vae_scale_factor * 2))
    config = dict(pipe.scheduler.config)
    return FlowModel(tr, encode, _vae_decoder(vae), (tr.config.in_channels, size, size), (pipe.text_encoder, vae),
                     pipeline_class="ZImagePipeline", call=z_image_call, lora_targets=Z_IMAGE_LORA_TARGETS,
                     schedule_mu=dynamic_shift_mu((size // 2) ** 2, config), linspace_sigmas=True)


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


PIXEL_PARTS = ("transformer", "text_encoder", "tokenizer")  # mmrl's pixel models (the embedded worlds)


def missing_parts(path: str, index: dict) -> list[str]:
    """The component folders a pipeline's model_index.json names that `path` lacks."""
    parts = PIXEL_PARTS if index.get("_class_name") == PIPELINE_CLASS else \
        [k for k, v in index.items() if isinstance(v, list) and v[0]]
    return [k for k in parts if not os.path.isdir(os.path.join(path, k))]


def load_flow_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    sample_size: int | None = None, num_frames: int | None = None, guidance: float = 3.5,
                    text_max_length: int | None = None) -> FlowModel:
    """Load a flow generator folder: a diffusers SD3 / FLUX / Wan pipeline or mmrl's pixel model.
    `sample_size` overrides the latent size (H = W) of pipelines, `num_frames` the video length of Wan,
    `guidance` is FLUX's guidance-embedding scale, `text_max_length` the T5 / UMT5 prompt length."""
    index_file = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_file):
        raise FileNotFoundError(f"{path!r} has no model_index.json: point model.path at a diffusers "
                                f"pipeline folder ({', '.join(PIPELINES)}) or an mmrl pixel-model folder "
                                f"(scripts/pretrain_world.py writes one)")
    index = json.load(open(index_file))
    cls, missing = index.get("_class_name"), missing_parts(path, index)
    if missing:  # else from_pretrained would look for them on the hub ("couldn't connect to huggingface.co")
        raise FileNotFoundError(f"{path!r}: model_index.json names {missing}, but the folder has no "
                                f"{', '.join(m + '/' for m in missing)}; copy the whole folder")
    if cls == PIPELINE_CLASS:
        model = _pixel_model(path, dtype)
    elif cls in PIPELINES or cls == "StableDiffusion3Img2ImgPipeline":
        cls = "StableDiffusion3Pipeline" if cls.startswith("StableDiffusion3") else cls
        model = load_pipeline_model(cls, path, dtype, device, sample_size, num_frames, guidance, text_max_length)
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
