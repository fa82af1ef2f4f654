"""FLUX.2-klein (`Flux2KleinPipeline`, `Flux2Transformer2DModel`): the 4 B and 9 B FLUX.2 transformers.

Everything but the text encoder and the guidance is FLUX.2-dev's (mmrl/models/families/flux2.py): x [N, 128, H/2,
W/2] the batch-norm-normalized, 2x2-patchified 32-channel VAE latents (H = model.sample_size, 128 = 1024 px), flattened
to H/2 * W/2 tokens with 4-axis RoPE ids; timestep = sigma; the empirical mu of FLUX.2's schedule, a function of the
image sequence length and the number of steps; the same LoRA targets (double-stream joint attention, single-stream
fused projections).

Text: Qwen3 (Qwen3-4B for klein-4B, Qwen3-8B for klein-9B) over its chat template (user turn, generation prompt,
thinking disabled), padded to 512 tokens, the hidden states of layers 9, 18 and 27 stacked per token: enc [N, 512,
3 x hidden] (7680 / 12288); no pooled embedding ([N, 0]). Guidance: no guidance embedding. The base models
(FLUX.2-klein-base-*, model_index `is_distilled: false`) use classifier-free guidance with the empty negative prompt,
v = v_u + w (v_c - v_u) (sampler.cfg_scale, the pipeline's guidance_scale, 4.0 by default); the step-distilled
models (`is_distilled: true`, 4 steps) ignore guidance_scale, and so does mmrl (v = v_c: keep sampler.cfg_scale 1,
else the unconditional forward is computed and dropped).
"""

from __future__ import annotations

import torch

from mmrl.models.families import Family, LoadOptions
from mmrl.models.families.common import from_pretrained
from mmrl.models.families.flux2 import (VAE_FLUX2, flux2_lora_targets, flux2_model, plan_inputs, tiny_scheduler,
                                        tiny_transformer, tiny_vae)
from mmrl.models.flow_model import FlowModel


def distilled_guide(v_u: torch.Tensor, v_c: torch.Tensor, w: float) -> torch.Tensor:
    """A step-distilled klein's pipeline ignores guidance_scale: the conditional velocity."""
    return v_c


def load(folder: str, index: dict, options: LoadOptions) -> FlowModel:
    pipe = from_pretrained(folder, index, options)
    return flux2_model(pipe, options, None, distilled_guide if pipe.config.is_distilled else None)


# Qwen3's chat template, condensed: string content, the empty thinking block when enable_thinking is false
QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def tiny(seed: int = 0, distilled: bool = False):
    """FLUX.2-klein-base layout (distilled: the 4-step model, guidance ignored): a 27-layer Qwen3ForCausalLM of width
    16 (layers 9, 18, 27 stacked: enc dim 48), the transformer without guidance embedding, the batch-norm VAE."""
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mmrl.models.qwen_vl import build_tokenizer
    from mmrl.models.tiny_pipelines import CORPUS

    torch.manual_seed(seed)
    tok = build_tokenizer(CORPUS)
    tok.chat_template, tok.padding_side = QWEN3_TEMPLATE, "right"
    encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=27, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    return Flux2KleinPipeline(scheduler=tiny_scheduler(), vae=tiny_vae(), text_encoder=encoder, tokenizer=tok,
                              transformer=tiny_transformer(48, guidance_embeds=False), is_distilled=distilled)


# Qwen/Qwen3-4B and Qwen/Qwen3-8B, config.json (4.02 B with tied embeddings / 8.19 B)
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                tie_word_embeddings=True)
QWEN3_8B = dict(QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)


def klein(num_layers: int, num_single_layers: int, heads: int, text_hidden: int) -> dict:
    """The transformer/config.json of a klein checkpoint: FLUX.2's block design at another width and depth."""
    return dict(patch_size=1, in_channels=128, num_layers=num_layers, num_single_layers=num_single_layers,
                attention_head_dim=128, num_attention_heads=heads, joint_attention_dim=3 * text_hidden,
                timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=[32, 32, 32, 32], rope_theta=2000,
                guidance_embeds=False)


FAMILY = Family(
    name="flux2_klein", pipelines=("Flux2KleinPipeline",), transformer="Flux2Transformer2DModel", load=load,
    # LoRA: the single blocks of klein-9B (24; klein-4B has 20)
    lora_targets=flux2_lora_targets(24), plan_inputs=plan_inputs, lora_pipeline="Flux2KleinPipeline", tiny=tiny,
    # black-forest-labs/FLUX.2-klein-4B and -9B (and their -base-), transformer/config.json: 5 + 20 blocks of
    # 24 heads (plan counts 3.88 B) and 8 + 24 blocks of 32 heads (9.08 B); the base models share them
    architectures={
        "flux2-klein-4b": {"config": klein(5, 20, 24, QWEN3_4B["hidden_size"])},
        "flux2-klein-9b": {"config": klein(8, 24, 32, QWEN3_8B["hidden_size"]),
                           "frozen_parts": ([("Qwen3ForCausalLM", "Qwen3Config", QWEN3_8B)],
                                            ("AutoencoderKLFlux2", VAE_FLUX2))}},
    # klein-4B's Qwen3-4B (klein-9B's Qwen3-8B: its entry's frozen_parts) and the FLUX.2 VAE
    frozen_parts=([("Qwen3ForCausalLM", "Qwen3Config", QWEN3_4B)], ("AutoencoderKLFlux2", VAE_FLUX2)))
