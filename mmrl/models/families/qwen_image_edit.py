"""Qwen-Image-Edit (`QwenImageEditPipeline`): the Qwen-Image transformer editing one image per example.

Everything Qwen-Image does (mmrl/models/families/qwen_image.py): generated latents x [N, 16, H, W] packed 2x2 into
tokens [N, HW/4, 64]; timestep = sigma (the pipeline passes t / 1000); the last hidden states of its Qwen2.5-VL
after the chat template's first 64 tokens (the system prompt), padded and masked; the dynamic shift of its
scheduler config (mu from the generated tokens HW/4 only), stretched to the terminal sigma; "true CFG"
(`qwen_image.true_cfg`: the guided velocity renormalized per packed token to the conditional one's norm).

Conditioning (`"image": path`), as the pipeline builds it (Qwen-Image-Edit-Plus, qwen_image_edit_plus.py, differs
only in the `Edit` spec below: several images, each named "Picture i:" in the prompt, the VLM's copy smaller):
- the text encoder is the VLM that SEES the image: the chat template holds <|vision_start|><|image_pad|>
  <|vision_end|> before the prompt, the processor expands the pad into the image's vision tokens, and the image
  resized to the VAE's size (1024 px: `calculate_dimensions(1024 * 1024, aspect)`) goes through the vision tower;
- the image at that size in [-1, 1] through the VAE encoder's mode ("argmax"), normalized per channel
  z = (mode - latents_mean) / latents_std -> [16, s, s] (s = 1024 / 8 = 128 at real size), packed 2x2 and
  appended after x's tokens: hidden_states [N, HW/4 + s^2/4, 64], img_shapes [(1, H/2, W/2), (1, s/2, s/2)] (RoPE
  puts the i-th image on frame i); the output keeps the first HW/4 tokens (the generated image's);
- CFG: the negative prompt ("") is encoded WITH the same image, and the same image tokens are appended.
The pipeline keeps a condition image's aspect ratio; mmrl's rows need fixed shapes, so every condition image is
resized (stretched) to the square VAE_SIDE x VAE_SIDE, which is the pipeline's own size for square images. The
output's size is model.sample_size (H = W; 8H px), independent of the condition's, as the pipeline's height / width.

`encode_prompts(texts, images)` -> enc [B, L, 3584] (L = the template, vision tokens and text_max_length (128)
prompt tokens; longer prompts are cut), pooled [B, L + 1 + max_images * 16 s^2] = [the text mask | the row's
image count | its images' z flattened, zero-padded to max_images]; the call splits pooled again. Rows with
different counts (Edit-Plus) run as separate transformer calls (RoPE takes one layout per call), so under FSDP
give every example the same number of images.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from mmrl.errors import ConfigError
from mmrl.models.families import Family, LoadOptions, PlanInputs, qwen_image
from mmrl.models.families.common import (TEXT_LEN, dynamic_schedule, dynamic_shift_mu, from_pretrained, pack2x2,
                                         padded, unpack2x2)
from mmrl.models.flow_model import FlowModel

VAE_SIDE = 1024  # px: both pipelines VAE-encode condition images at calculate_dimensions(1024 * 1024, aspect ratio)


@dataclass(frozen=True)
class Edit:
    """What one edit pipeline feeds its VLM and its transformer."""
    family: str           # the Family's name
    pipeline: str         # its diffusers pipeline class
    max_images: int       # condition images a row carries (pooled has room for this many)
    vlm_side: int         # px of the square copy of each image that the VLM sees
    image_prompt: str = ""  # text naming image i before the prompt (Edit-Plus: "Picture {}: <vision tokens>")

    def prompt_prefix(self, k: int) -> str:
        return "".join(self.image_prompt.format(i + 1) for i in range(k))


EDIT = Edit("qwen_image_edit", "QwenImageEditPipeline", max_images=1, vlm_side=VAE_SIDE)


def edit_call(text_len: int, max_images: int, side: int, images: int | None = None):
    """The transformer call: pooled [N, text_len + 1 + max_images * 16 side^2] is split into the text mask, each
    row's image count and its images' latents z [N, max_images, 16, side, side]. images: a fixed count for every
    row (`mmrl plan` on meta tensors, which have no values to group by; Qwen-Image-Edit's rows: always 1)."""
    images = images or (1 if max_images == 1 else None)

    def call(transformer, x, sigma, enc, pooled):
        n, c, h, w = x.shape
        mask, count = pooled[:, :text_len], pooled[:, text_len]
        z = pooled[:, text_len + 1:].reshape(n, max_images, c, side, side)
        counts = [images] if images else sorted(set(count.long().tolist()))            # one host sync (Edit-Plus)
        groups = [(k, None if len(counts) == 1 else (count.long() == k).nonzero().squeeze(1)) for k in counts]
        outs = []
        for k, rows in groups:  # rows with k images (None: all)
            pick = (lambda t: t) if rows is None else (lambda t, r=rows: t[r])
            tokens = torch.cat([pack2x2(pick(x))] + [pack2x2(pick(z)[:, i]) for i in range(k)], 1)  # [n_k, T, 64]
            shapes = [[(1, h // 2, w // 2)] + [(1, side // 2, side // 2)] * k] * len(tokens)
            out = transformer(hidden_states=tokens, timestep=pick(sigma), encoder_hidden_states=pick(enc),
                              encoder_hidden_states_mask=pick(mask), img_shapes=shapes, return_dict=False)[0]
            outs.append(out[:, :h * w // 4])                                       # the generated tokens only
        out = outs[0] if len(outs) == 1 else \
            torch.cat(outs)[torch.argsort(torch.cat([rows for _, rows in groups]))]  # back in x's row order
        return unpack2x2(out, x.shape)

    return call


def prompt_tokens(pipe, spec: Edit) -> int:
    """Tokens of the empty prompt's embedding with max_images images: the template after its first 64 tokens,
    the vision tokens of images of the VLM's size (the processor alone counts them)."""
    from PIL import Image

    text = pipe.prompt_template_encode.format(spec.prompt_prefix(spec.max_images))
    blank = [Image.new("RGB", (spec.vlm_side, spec.vlm_side))] * spec.max_images
    ids = pipe.processor(text=[text], images=blank, return_tensors="pt")["input_ids"]
    return ids.shape[1] - pipe.prompt_template_encode_start_idx


def condition_encoder(pipe, spec: Edit, length: int):
    """(texts, one list of PIL images per row) -> (enc [B, length, D], pooled [B, length + 1 + max_images * 16 s^2])."""
    vae, proc = pipe.vae, pipe.image_processor
    mean, std = (torch.tensor(v).view(-1, 1, 1, 1) for v in (vae.config.latents_mean, vae.config.latents_std))
    room = spec.max_images * vae.config.z_dim * (VAE_SIDE // pipe.vae_scale_factor) ** 2

    def latents(image):  # PIL -> z [16 s s] flattened: the pipelines' _encode_vae_image of their preprocessed image
        pixels = proc.preprocess(image, VAE_SIDE, VAE_SIDE).unsqueeze(2)                 # [1, 3, 1, 1024, 1024]
        z = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()[0]           # [16, 1, s, s]
        return ((z - mean.to(z)) / std.to(z)).flatten()

    @torch.no_grad()
    def encode(texts, images=None):
        if images is None or len(images) != len(texts) or not all(0 < len(i) <= spec.max_images for i in images):
            raise ConfigError(f"{spec.pipeline} edits 1 to {spec.max_images} image(s) per prompt: "
                              f"encode_prompts(texts, [[image, ...], ...])")
        embeds, rows = [], []
        for text, imgs in zip(texts, images):
            seen = [proc.resize(im, spec.vlm_side, spec.vlm_side) for im in imgs]      # what the VLM looks at
            e, _ = pipe.encode_prompt([text], image=seen, device=pipe.text_encoder.device)  # [1, L_i, D]
            embeds.append(e[0, :length])
            z = torch.cat([latents(im) for im in imgs])                                 # [k 16 s s]
            rows.append(torch.cat([z.new_tensor([len(imgs)]), torch.nn.functional.pad(z, (0, room - len(z)))]))
        enc, mask = padded(embeds, length)                                               # [B, L, D], [B, L]
        return enc, torch.cat([mask, torch.stack(rows).to(enc)], 1)

    return encode


def load(folder: str, index: dict, options: LoadOptions, spec: Edit = EDIT) -> FlowModel:
    pipe = from_pretrained(folder, index, options)
    tr, side = pipe.transformer, VAE_SIDE // pipe.vae_scale_factor
    length = prompt_tokens(pipe, spec) + (options.text_max_length or TEXT_LEN)
    size, config = options.sample_size or pipe.default_sample_size, dict(pipe.scheduler.config)
    return FlowModel(tr, condition_encoder(pipe, spec, length), qwen_image.image_decoder(pipe.vae),
                     (tr.config.out_channels, size, size), (pipe.text_encoder, pipe.vae),
                     call=edit_call(length, spec.max_images, side), guide=qwen_image.true_cfg,
                     schedule=dynamic_schedule(dynamic_shift_mu((size // 2) ** 2, config), config.get("shift_terminal")))


def plan_inputs(config: dict, folder: str | None, options: LoadOptions, spec: Edit = EDIT) -> PlanInputs:
    """Every row with max_images images (the most a row costs). The text: Qwen2.5-VL's processor makes one vision
    token per 28 x 28 px (1369 at 1024 px, 196 at 384 px), about 8 template tokens around each image, and the
    prompt's text_max_length."""
    size, side = options.sample_size or 128, VAE_SIDE // 8  # the Qwen-Image VAE: x8
    text = spec.max_images * (round(spec.vlm_side / 28) ** 2 + 8) + (options.text_max_length or TEXT_LEN)
    pooled = text + 1 + spec.max_images * config["out_channels"] * side * side
    return PlanInputs(edit_call(text, spec.max_images, side, images=spec.max_images),
                      (config["out_channels"], size, size), text, config["joint_attention_dim"], pooled)


def tiny(seed: int = 0, spec: Edit = EDIT, **transformer):
    """Qwen-Image's tiny parts, a Qwen2-VL processor (the class Qwen-Image-Edit's folder names; images to 56 x 56 px:
    4 vision tokens) and a x32 VAE (six levels, 4 channels: the pipelines encode condition images at 1024 px, which
    is 32 x 32 latents, 256 tokens, here).
    transformer: config changes of the tiny transformer (zero_cond_t)."""
    import diffusers
    from diffusers import AutoencoderKLQwenImage

    from mmrl.models.qwen_vl import build_processor

    parts = qwen_image.tiny_parts(seed)
    if transformer:
        config = {k: v for k, v in parts["transformer"].config.items() if not k.startswith("_")}
        parts["transformer"] = type(parts["transformer"]).from_config({**config, **transformer})
    parts["vae"] = AutoencoderKLQwenImage(base_dim=4, z_dim=16, dim_mult=[1] * 6, num_res_blocks=0,
                                          temperal_downsample=[False] * 5)
    return getattr(diffusers, spec.pipeline)(processor=build_processor("qwen2_vl", parts["tokenizer"]), **parts)


def edit_family(spec: Edit, architectures: dict, **tiny_transformer) -> Family:
    """The Family of an edit pipeline (its tiny builder with `tiny_transformer` config changes)."""
    return Family(
        name=spec.family, pipelines=(spec.pipeline,), transformer="QwenImageTransformer2DModel",
        load=partial(load, spec=spec), lora_targets=qwen_image.LORA_TARGETS,
        plan_inputs=partial(plan_inputs, spec=spec), lora_pipeline=spec.pipeline, tiny=partial(tiny, spec=spec, **tiny_transformer),
        condition_images=1 if spec.max_images == 1 else -1, architectures=architectures, video_vae=True,
        frozen_parts=qwen_image.FAMILY.frozen_parts)  # Qwen2.5-VL-7B (the VLM, vision tower included) and the VAE


QWEN_IMAGE = qwen_image.FAMILY.architectures["qwen-image"]["config"]
# Qwen/Qwen-Image-Edit, transformer/config.json: Qwen-Image's transformer (20.6 B; plan: 20.43 B)
FAMILY = edit_family(EDIT, {"qwen-image-edit": {"config": QWEN_IMAGE}})
