"""Wan2.1 / Wan2.2 image-to-video (`WanImageToVideoPipeline`, `WanTransformer3DModel`).

Wan T2V's model (mmrl/models/families/wan.py) animating one image per example (`"image": path`): generated video
latents x [N, 16, F', H, W] (F' = (frames - 1) / 4 + 1 of the causal video VAE, x8 spatial, TI2V-5B's x16; latent
H = W = model.sample_size, the image stretched to 8H x 8W px as the pipeline's `video_processor.preprocess` does);
timestep = 1000 sigma; UMT5 tokens, 512 (the transformer's image cross-attention takes the first L - 512 context
tokens as the image's, so the prompt must be 512); classifier-free guidance with the empty prompt on the SAME image
conditioning (the pipeline's negative branch passes the same latents, condition and image_embeds); a static shift
(sampler.shift: the released pipelines' flow_shift, 5 for Wan2.2 I2V, 3 for Wan2.1 I2V at 480P) of linspace(1, 0),
as FlowMatchEulerDiscreteScheduler sets them (the released folders ship UniPC, a multistep solver of the same ODE).

Conditioning, as `WanImageToVideoPipeline.prepare_latents` / `encode_image` build it (mmrl calls them):
- Wan2.1 I2V 14B (in_channels 36): the video [image, 0, ..., 0] (frames) through the VAE encoder's mode, normalized
  (z - latents_mean) / latents_std -> [16, F', H, W], after a 4-channel frame mask (1 on the first frame's 4 video
  frames, 0 elsewhere) -> condition [20, F', H, W], concatenated to x along channels (16 + 20 = 36); and the CLIP
  ViT-H/14 image encoder's penultimate hidden states [257, 1280] as `encoder_hidden_states_image` (a second
  cross-attention, add_k_proj / add_v_proj).
- Wan2.2 I2V A14B: the same 36 channels, no image encoder (transformer.config.image_dim is None); two experts,
  `transformer` for sigma >= boundary_ratio (0.9 for I2V) and `transformer_2` below, both trained.
- Wan2.2 TI2V-5B (`expand_timesteps`, in_channels == out_channels = 48): the image's latents [C, 1, H, W] replace
  the first latent frame of the transformer's input, whose tokens get timestep 0. Its output for that frame is
  replaced by v = (x - z) / sigma, which pins it: x0 = x - sigma v = z, so an ODE step to sigma = 0 (the sampler's
  last step) ends it on z exactly as the pipeline does; it carries no parameters (ratio 1 under SDE steps).
  (A TI2V-5B folder is a `WanPipeline`; load it with model.family=wan_i2v.)
`encode_prompts(texts, images)` -> (enc [B, 512, 4096], pooled [B, P]): pooled = the condition flattened (then the
CLIP states flattened, when the transformer has an image cross-attention); the call splits it again.
"""

from __future__ import annotations

import torch

from mmrl.errors import ConfigError
from mmrl.models.families import Family, LoadOptions, PlanInputs
from mmrl.models.families.common import from_pretrained, wan_vae_decoder
from mmrl.models.families.wan import (LORA_TARGETS, UMT5_XXL, WAN21_14B, tiny_text_encoder, tiny_transformer,
                                      tiny_vae)
from mmrl.models.flow_model import FlowModel

TEXT_LEN = 512     # the transformer splits its context as [image tokens, the last 512 = the prompt's]
CLIP_TOKENS = 257  # CLIP ViT-H/14 at 224 px: 16 x 16 patches + the class token


def i2v_call(transformer, x, sigma, enc, pooled):
    """x [N, C, F', H, W]; pooled [N, P] the row's conditioning (see the module docstring)."""
    n, c, f, h, w = x.shape
    config, t = transformer.config, sigma * 1000                                  # t [N]
    extra = config.in_channels - c                                                # 20 (4 mask + 16 latents) or 0
    if extra == 0:                                                                # expand_timesteps (TI2V-5B)
        return first_frame_call(transformer, x, sigma, enc, pooled.view(n, c, 1, h, w))
    cond = pooled[:, :extra * f * h * w].view(n, extra, f, h, w)                   # [N, 20, F', H, W]
    image = pooled[:, extra * f * h * w:].view(n, -1, config.image_dim) if config.image_dim else None  # [N, 257, D]
    return transformer(hidden_states=torch.cat([x, cond], 1), timestep=t, encoder_hidden_states=enc,
                       encoder_hidden_states_image=image, return_dict=False)[0]    # [N, C, F', H, W]


def first_frame_call(transformer, x, sigma, enc, z):
    """expand_timesteps: the first latent frame is the image's z [N, C, 1, H, W], its tokens at timestep 0."""
    n, c, f, h, w = x.shape
    _, ph, pw = transformer.config.patch_size
    per_frame = (h // ph) * (w // pw)                                             # tokens of one latent frame
    t = torch.cat([torch.zeros(n, per_frame).to(sigma), (sigma * 1000)[:, None].expand(n, (f - 1) * per_frame)], 1)
    out = transformer(hidden_states=torch.cat([z.to(x), x[:, :, 1:]], 2), timestep=t,  # t [N, F' H W / 4]
                      encoder_hidden_states=enc, return_dict=False)[0]
    pin = (x[:, :, :1] - z.to(x)) / sigma.view(n, 1, 1, 1, 1)                     # x0 = z on the first frame
    return torch.cat([pin.to(out), out[:, :, 1:]], 2)


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    # a TI2V-5B folder is a WanPipeline: the I2V pipeline reads the same parts (image_encoder is optional)
    pipe = from_pretrained(folder, {**index, "_class_name": "WanImageToVideoPipeline"}, options)
    tr, vae = pipe.transformer, pipe.vae
    clip = tr.config.image_dim is not None
    if (tr.config.in_channels == tr.config.out_channels) != bool(pipe.config.get("expand_timesteps")):
        raise ConfigError(f"{folder}: an image-to-video transformer takes 16 + 20 input channels, or as many as it "
                          f"outputs with expand_timesteps (Wan2.2 TI2V-5B); this one takes {tr.config.in_channels} "
                          f"(expand_timesteps={pipe.config.get('expand_timesteps')}): is it a text-to-video model?")
    length = options.text_max_length or TEXT_LEN
    if clip and length != TEXT_LEN:
        raise ConfigError(f"Wan2.1 I2V reads the last {TEXT_LEN} context tokens as the prompt: text_max_length must be "
                          f"{TEXT_LEN}, got {length}")
    frames, size = options.num_frames or 81, options.sample_size or 60                # 60: 480 px
    side, latent_frames = size * pipe.vae_scale_factor_spatial, (frames - 1) // pipe.vae_scale_factor_temporal + 1

    def condition(image) -> torch.Tensor:
        """One PIL image -> its conditioning, flattened [P]."""
        pixels = pipe.video_processor.preprocess(image, height=side, width=side).to(pipe.device, torch.float32)
        # latents given (not drawn): only its device and dtype are read; returns (latents, condition[, mask])
        cond = pipe.prepare_latents(pixels, 1, vae.config.z_dim, side, side, frames, torch.float32, pipe.device,
                                    None, torch.zeros(1, device=pipe.device))[1]  # [1, 20, F', H, W] | [1, C, 1, H, W]
        parts = [cond.flatten()]
        if clip:
            parts.append(pipe.encode_image(image, pipe.device).float().flatten())  # [257 * 1280]
        return torch.cat(parts)

    @torch.no_grad()
    def encode(texts, images=None):
        if images is None or len(images) != len(texts) or any(len(imgs) != 1 for imgs in images):
            raise ValueError("Wan I2V animates one image per prompt: encode_prompts(texts, [[image], ...])")
        enc, _ = pipe.encode_prompt(list(texts), do_classifier_free_guidance=False, device=pipe.device,
                                    max_sequence_length=length)                   # [B, 512, D]
        return enc, torch.stack([condition(imgs[0]) for imgs in images]).to(enc)  # [B, P]

    shape = (tr.config.out_channels, latent_frames, size, size)
    boundary = pipe.config.get("boundary_ratio") if getattr(pipe, "transformer_2", None) is not None else None
    frozen = tuple(m for m in (pipe.text_encoder, pipe.image_encoder if clip else None, vae) if m is not None)
    return FlowModel(tr, encode, wan_vae_decoder(vae), shape, frozen, call=i2v_call,
                     transformer_2=pipe.transformer_2 if boundary is not None else None, boundary=boundary)


def plan_inputs(config: dict, folder: str | None, options: LoadOptions) -> PlanInputs:
    size, frames, c = options.sample_size or 60, options.num_frames or 81, config["out_channels"]
    f, extra = (frames - 1) // 4 + 1, config["in_channels"] - c
    pooled = extra * f * size * size + CLIP_TOKENS * (config.get("image_dim") or 0) if extra else c * size * size
    return PlanInputs(i2v_call, (c, f, size, size), options.text_max_length or TEXT_LEN, config["text_dim"], pooled)


def tiny_image_encoder():
    """(a CLIP vision tower of 17 tokens of width 16, its processor at 32 px)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=16)
    return CLIPVisionModel(config), CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32)


def tiny(seed: int = 0, layout: str = "wan21"):
    """layout: "wan21" (Wan2.1 I2V: a CLIP image encoder, 36 input channels), "wan22_a14b" (no image encoder, two
    experts switching at boundary_ratio 0.9) or "ti2v" (Wan2.2 TI2V-5B's expand_timesteps, 16 input channels)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline

    from mmrl.models.tiny_pipelines import tiny_tokenizer

    torch.manual_seed(seed)
    if layout == "wan21":
        encoder, processor = tiny_image_encoder()
        parts = dict(transformer=tiny_transformer(36, image_dim=16, added_kv_proj_dim=24),  # 24 = 2 heads x 12
                     image_encoder=encoder, image_processor=processor)
    elif layout == "wan22_a14b":
        parts = dict(transformer=tiny_transformer(36), transformer_2=tiny_transformer(36), boundary_ratio=0.9)
    elif layout == "ti2v":
        parts = dict(transformer=tiny_transformer(16), expand_timesteps=True)
    else:
        raise ValueError(f"unknown layout {layout!r}: wan21 | wan22_a14b | ti2v")
    return WanImageToVideoPipeline(**parts, vae=tiny_vae(), scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
                                   text_encoder=tiny_text_encoder(), tokenizer=tiny_tokenizer(32))


# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (and -720P), transformer/config.json: the T2V 14B architecture with 36 input
# channels and the CLIP image cross-attention (diffusers scripts/convert_wan_to_diffusers.py "Wan-I2V-14B-480p";
# plan: 16.39 B, as the 32.8 GB fp16 checkpoint)
WAN21_I2V_14B = {**WAN21_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
# Wan-AI/Wan2.2-I2V-A14B-Diffusers: two experts of the T2V 14B architecture with 36 input channels, no image
# encoder (convert_wan_to_diffusers.py "Wan2.2-I2V-14B-720p"; Wan-Video/Wan2.2 wan/configs/wan_i2v_A14B.py:
# boundary 0.9, shift 5, 40 steps, guidance 3.5; plan: 2 x 14.29 B)
WAN22_I2V_A14B = {**WAN21_14B, "in_channels": 36}
# open-clip XLM-RoBERTa-large ViT-H/14's vision tower as diffusers stores it (image_encoder/config.json, 632 M)
CLIP_VIT_H = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                  image_size=224, patch_size=14, projection_dim=1024, hidden_act="gelu")
UMT5 = ("UMT5EncoderModel", "UMT5Config", UMT5_XXL)

FAMILY = Family(
    name="wan_i2v", pipelines=("WanImageToVideoPipeline",), transformer="WanTransformer3DModel", load=load,
    lora_targets=LORA_TARGETS, plan_inputs=plan_inputs, lora_pipeline="WanImageToVideoPipeline", tiny=tiny,
    video_vae=True, condition_images=1,
    architectures={"wan21-i2v-14b": {"config": WAN21_I2V_14B},
                   # its frozen parts lack the CLIP tower (read by plan where an entry names them)
                   "wan22-i2v-a14b": {"config": WAN22_I2V_A14B, "experts": 2, "boundary": 0.9,
                                      "frozen_parts": ([UMT5], ("AutoencoderKLWan", {}))}},
    # umT5-XXL (5.68 B), the CLIP ViT-H/14 vision tower (Wan2.1 I2V only) and the Wan2.1 VAE (127 M)
    frozen_parts=([UMT5, ("CLIPVisionModel", "CLIPVisionConfig", CLIP_VIT_H)], ("AutoencoderKLWan", {})))
