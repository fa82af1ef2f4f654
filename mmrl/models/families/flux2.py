"""FLUX.2-dev (`Flux2Pipeline`, `Flux2Transformer2DModel`): 8 double-stream + 48 single-stream blocks, 32 B.

x [N, 128, H/2, W/2] is what the transformer denoises: the VAE's 32-channel latents [N, 32, H, W] (x8 spatial,
H = model.sample_size, 128 = 1024 px) patchified 2x2 into channels and normalized by the VAE's batch-norm running
statistics (AutoencoderKLFlux2.bn); the pipeline draws its noise in this layout, so seeds match. The call flattens x
into H/2 * W/2 tokens of 128 channels (no further packing) with 4-axis RoPE ids (t, h, w, l): the image at
(0, h, w, 0), the text tokens at (0, 0, 0, l); timestep = sigma. Decoding undoes the normalization and the
patchify, then runs the VAE.

Text: Mistral Small 3.2 24 B (Mistral3ForConditionalGeneration) over its chat template with the pipeline's system
message, padded to 512 tokens (model.text_max_length), the hidden states of layers 10, 20 and 30 stacked per token:
enc [N, 512, 3 x 5120 = 15360]; no pooled embedding (an empty [N, 0] tensor stands in); the padding is not masked
in the transformer (as in the pipeline). Guidance: FLUX.2-dev is guidance-distilled; its guidance embedding
(model.guidance, the pipeline's default 4.0) replaces classifier-free guidance (keep sampler.cfg_scale 1).

Schedule: sigmas linspace(1, 1/S, S) shifted by the scheduler's exponential time shift with FLUX.2's empirical mu,
which depends on the image sequence length (H/2 * W/2) AND the number of steps S (compute_empirical_mu), so
`schedule(num_steps, shift)` recomputes it per step count; sampler.shift is not used.

FLUX.2-klein (Qwen3 text encoders, 4 B / 9 B) shares all of this: mmrl/models/families/flux2_klein.py.
"""

from __future__ import annotations

import numpy as np
import torch

from mmrl.models.families import Family, LoadOptions, PlanInputs
from mmrl.models.families.common import SD3_LORA_TARGETS, from_pretrained
from mmrl.models.flow_model import FlowModel


def flux2_lora_targets(num_single_layers: int = 48) -> tuple[str, ...]:
    """The joint attention of the double-stream blocks (image and text projections) and, in every single-stream
    block, the fused QKV + MLP-in projection and the output projection (named by index: `attn.to_out` alone would
    also name the double blocks' ModuleList; diffusers' FLUX.2 LoRA trainers do the same). A family names the
    single blocks of its largest model: peft skips the names a smaller one lacks (a tiny model's one block)."""
    return (*SD3_LORA_TARGETS, "attn.to_qkv_mlp_proj",
            *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(num_single_layers)))


def flux2_call(guidance: float | None):
    """The transformer call; guidance: the embedded guidance scale (dev) or None (klein: no guidance embedding)."""
    from diffusers import Flux2Pipeline

    def call(transformer, x, sigma, enc, pooled):
        n = len(x)                                                               # x [N, 128, H/2, W/2]
        img_ids = Flux2Pipeline._prepare_latent_ids(x[:1]).to(x.device)         # [1, HW/4, 4]: (0, h, w, 0)
        txt_ids = Flux2Pipeline._prepare_text_ids(enc[:1]).to(x.device)         # [1, L, 4]: (0, 0, 0, l)
        g = None if guidance is None or not transformer.config.guidance_embeds else torch.full((n,), guidance).to(x)
        out = transformer(hidden_states=x.flatten(2).transpose(1, 2), encoder_hidden_states=enc, timestep=sigma,
                          guidance=g, img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]   # [N, HW/4, 128]
        return out.transpose(1, 2).reshape(x.shape)

    return call


def flux2_schedule(scheduler, image_seq_len: int):
    """(num_steps, shift) -> sigmas [S + 1]: the pipeline's linspace(1, 1/S, S) through its scheduler (config as
    loaded) at compute_empirical_mu(image_seq_len, S)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    def schedule(num_steps: int, shift: float = 1.0) -> torch.Tensor:
        sch = type(scheduler).from_config(scheduler.config)
        sch.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
                          mu=compute_empirical_mu(image_seq_len, num_steps))
        return sch.sigmas.float().clone()

    return schedule


def bn_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) [1, 4C, 1, 1] of the patchified latents: AutoencoderKLFlux2's batch-norm running statistics."""
    mean, var = vae.bn.running_mean.float(), vae.bn.running_var.float()
    return mean.view(1, -1, 1, 1), torch.sqrt(var + vae.config.batch_norm_eps).view(1, -1, 1, 1)


def flux2_decoder(vae):
    """AutoencoderKLFlux2: normalized patchified latents [N, 4C, H/2, W/2] -> images [N, 3, 8H, 8W] in [-1, 1]."""
    from diffusers import Flux2Pipeline

    def decode(x):
        mean, std = bn_stats(vae)
        z = Flux2Pipeline._unpatchify_latents(x.float() * std.to(x.device) + mean.to(x.device))  # [N, C, H, W]
        return vae.decode(z.to(vae.dtype), return_dict=False)[0].float().clamp(-1, 1)

    return decode


def flux2_encoder(vae):
    """Images [N, 3, 8H, 8W] in [-1, 1] -> x0 [N, 4C, H/2, W/2]: the posterior's mode patchified and normalized, as
    the pipelines encode their reference images."""
    from diffusers import Flux2Pipeline

    @torch.no_grad()
    def encode(images):
        z = vae.encode(images.to(vae.device, vae.dtype)).latent_dist.mode()                    # [N, C, H, W]
        mean, std = bn_stats(vae)
        return (Flux2Pipeline._patchify_latents(z).float() - mean.to(z.device)) / std.to(z.device)

    return encode


def flux2_model(pipe, options: LoadOptions, guidance: float | None, guide=None) -> FlowModel:
    """The FlowModel of a loaded Flux2Pipeline / Flux2KleinPipeline (their encode_prompt take the same arguments)."""
    length = options.text_max_length or pipe.tokenizer_max_length

    @torch.no_grad()
    def encode(texts):  # (enc [B, L, 3 D] the stacked hidden states, padded to L; pooled [B, 0])
        enc, _ = pipe.encode_prompt(list(texts), device=pipe.device, max_sequence_length=length)
        return enc, enc.new_zeros(len(texts), 0)

    tr, size = pipe.transformer, options.sample_size or pipe.default_sample_size   # size: VAE latent side (x8)
    return FlowModel(tr, encode, flux2_decoder(pipe.vae), (tr.config.in_channels, size // 2, size // 2),
                     (pipe.text_encoder, pipe.vae), call=flux2_call(guidance), guide=guide,
                     schedule=flux2_schedule(pipe.scheduler, (size // 2) ** 2), encode_latents=flux2_encoder(pipe.vae),
                     image_scale=2 * pipe.vae_scale_factor)


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    return flux2_model(from_pretrained(folder, index, options), options, options.guidance)


def plan_inputs(config: dict, folder: str | None, options: LoadOptions) -> PlanInputs:
    """1024 px by default; the prompt padded to 512 tokens; no pooled embedding. plan feeds its latent shape to the
    VAE's decode too, so it gets the VAE's layout [32, 128, 128] (as many elements as x [128, 64, 64], so the same
    bytes), patchified to x's layout around the call (a permutation)."""
    from diffusers import Flux2Pipeline

    size, call = options.sample_size or 128, flux2_call(options.guidance)

    def vae_layout_call(transformer, z, sigma, enc, pooled):  # z [N, 32, H, W] <-> x [N, 128, H/2, W/2]
        return Flux2Pipeline._unpatchify_latents(call(transformer, Flux2Pipeline._patchify_latents(z), sigma, enc,
                                                      pooled))

    return PlanInputs(vae_layout_call, (config["in_channels"] // 4, size, size), options.text_max_length or 512,
                      config["joint_attention_dim"], 0)


# ------------------------------------------------------------------------------------------------ tiny parts
def tiny_transformer(joint_attention_dim: int, guidance_embeds: bool):
    """2 heads of 16, one double- and one single-stream block, 16 channels (a 4-channel VAE patchified 2x2)."""
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2,
                                   joint_attention_dim=joint_attention_dim, timestep_guidance_channels=32,
                                   axes_dims_rope=(4, 4, 4, 4), guidance_embeds=guidance_embeds)


def tiny_vae():
    """AutoencoderKLFlux2 with 4 latent channels, x2 spatial, random batch-norm statistics (so the normalization
    matters)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                             latent_channels=4, norm_num_groups=8, sample_size=16, use_quant_conv=False,
                             use_post_quant_conv=False)
    vae.bn.running_mean.normal_(0, 0.3)
    vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def tiny_scheduler():
    """FLUX.2's scheduler config (FLUX.1's dynamic-shift settings; the pipeline passes its own mu)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                           base_image_seq_len=256, max_image_seq_len=4096)


MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]",
                    "[IMG_BREAK]", "[IMG_END]", "<pad>"]
# Mistral Small 3.1's chat template, condensed: list-of-parts content, the system prompt in its own tags
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{% else %}[INST]{% endif %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% else %}[IMG]{% endif %}{% endfor %}"
    "{% if m['role'] == 'system' %}[/SYSTEM_PROMPT]{% else %}[/INST]{% endif %}{% endfor %}")


def tiny_processor():
    """A PixtralProcessor over a byte-level BPE trained on the tiny corpus and FLUX.2's system message."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    from mmrl.models.tiny_pipelines import CORPUS

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS + [SYSTEM_MESSAGE] * 5, trainers.BpeTrainer(
        vocab_size=400, special_tokens=MISTRAL_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", chat_template=MISTRAL_TEMPLATE, model_max_length=512)
    return PixtralProcessor(image_processor=PixtralImageProcessor(patch_size=4, size={"longest_edge": 32}),
                            tokenizer=fast, patch_size=4, chat_template=MISTRAL_TEMPLATE)


def tiny(seed: int = 0):
    """FLUX.2-dev layout: a 30-layer Mistral3 of width 16 (the pipeline stacks layers 10, 20, 30: enc dim 48) with a
    Pixtral vision tower, the guidance-embedding transformer, the batch-norm VAE."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    torch.manual_seed(seed)
    proc = tiny_processor()
    ids = proc.tokenizer.convert_tokens_to_ids
    text = dict(model_type="mistral", vocab_size=len(proc.tokenizer), hidden_size=16, intermediate_size=32,
                num_hidden_layers=30, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                max_position_embeddings=1024, pad_token_id=ids("<pad>"), bos_token_id=ids("<s>"),
                eos_token_id=ids("</s>"))
    vision = dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, image_size=32, patch_size=4)
    encoder = Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=ids("[IMG]"), spatial_merge_size=1,
        multimodal_projector_bias=False))
    return Flux2Pipeline(scheduler=tiny_scheduler(), vae=tiny_vae(), text_encoder=encoder, tokenizer=proc,
                         transformer=tiny_transformer(48, guidance_embeds=True))


# ------------------------------------------------------------------------------------------------ published sizes
# the VAE of every FLUX.2 (black-forest-labs/FLUX.2-dev, vae/config.json): the diffusers defaults of
# AutoencoderKLFlux2 (32 latent channels, blocks 128-256-512-512, batch-norm statistics over the 128 patch channels)
VAE_FLUX2: dict = {}
# FLUX.2-dev's text_encoder: mistralai/Mistral-Small-3.2-24B-Instruct-2506 (BFL's flux2 text_encoder.py; the 3.1
# architecture, config.json), 24.0 B with its Pixtral vision tower
MISTRAL_SMALL_24B = dict(
    text_config=dict(model_type="mistral", vocab_size=131072, hidden_size=5120, intermediate_size=32768,
                     num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=131072),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14),
    image_token_index=10, spatial_merge_size=2, multimodal_projector_bias=False, projector_hidden_act="gelu",
    vision_feature_layer=-1, tie_word_embeddings=False)

FAMILY = Family(
    name="flux2", pipelines=("Flux2Pipeline",), transformer="Flux2Transformer2DModel", load=load,
    lora_targets=flux2_lora_targets(48), plan_inputs=plan_inputs, lora_pipeline="Flux2Pipeline", tiny=tiny,
    # black-forest-labs/FLUX.2-dev, transformer/config.json: the diffusers defaults of Flux2Transformer2DModel
    # (8 double + 48 single blocks, 48 heads of 128, Mistral features of 3 x 5120); plan counts 32.2 B
    architectures={"flux2-dev": {"config": dict(
        patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
        num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=[32, 32, 32, 32], rope_theta=2000, guidance_embeds=True)}},
    frozen_parts=([("Mistral3ForConditionalGeneration", "Mistral3Config", MISTRAL_SMALL_24B)],
                  ("AutoencoderKLFlux2", VAE_FLUX2)))
