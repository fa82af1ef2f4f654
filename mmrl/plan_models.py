"""The pieces `mmrl plan` builds at real size without weights: the trained transformer (or a token policy's language
model, or Janus-Pro's image-token path) and the frozen parts on the meta device, prepared as the policy prepares them
(dtype, LoRA, trainable flags); a meta forward measured by the tensors autograd saves (`measure_forward`); the
live-tensor peak of a VAE (or VQ) decode (`decode_peak`). mmrl/plan.py composes them per GPU; mmrl/plan_measure.py
runs them on fake tensors under a fake process group."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmrl.devices import torch_dtype
from mmrl.models.decode_batch import LivePeak, decode_peak  # noqa: F401 - measured here, used by mmrl.plan
from mmrl.parallel.shards import transformer_blocks
from mmrl.errors import ConfigError


@dataclass
class Shapes:
    """Transformer rows: of one training forward, of one iteration's sampling and of its training."""
    rows: int                      # rows of one training forward (CFG doubles flow rows)
    rows_sampled: int              # transformer rows of one iteration's rollout (no grad)
    rows_trained: int              # transformer rows trained per iteration (each a forward and a backward)
    rows_forward_only: int = 0     # training rows run without gradient (Janus's unconditional rows, cfg_grad=cond)


class _FusedAttention(torch.autograd.Function):
    """SDPA as a fused (flash / memory-efficient) kernel keeps it for backward: q, k, v, out and the fp32
    log-sum-exp; shapes only (meta)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        ctx.save_for_backward(q, k, v, out, q.new_empty(q.shape[:-1], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - planning never runs backward
        raise RuntimeError("planning only")


class _Measure(torch.overrides.TorchFunctionMode):
    """Replaces SDPA by _FusedAttention and counts its FLOPs (4 B H Lq Lk D, forward). A branch on a meta tensor's
    value takes its True side: transformers asks whether an attention mask is all ones (`fast_all`), and then runs
    the fused causal kernel without building the [B, 1, L, L] mask."""

    def __init__(self):
        super().__init__()
        self.attention_flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            return True
        if func is F.scaled_dot_product_attention:
            kwargs = dict(kwargs or {})
            q, k, v = (*args, *(kwargs.pop(n) for n in ("query", "key", "value") if n in kwargs))[:3]
            if k.shape[-3] != q.shape[-3]:  # grouped-query attention: keys shared by head groups
                rep = q.shape[-3] // k.shape[-3]
                k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
            self.attention_flops += 4 * q.shape[:-1].numel() * k.shape[-2] * q.shape[-1]
            return _FusedAttention.apply(q, k, v)
        return func(*args, **(kwargs or {}))


def measure_forward(model: torch.nn.Module, run) -> dict:
    """Run `run()` (one forward of `model` on meta tensors, with grad) and measure: bytes saved for backward
    (not the parameters), per block and outside blocks, the blocks' input bytes, and forward FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, tuple[int, int]] = {}  # storage -> (bytes, block index or -1)
    current = [-1]
    block_inputs = [0]

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key not in saved:
            saved[key] = (t.untyped_storage().nbytes(), current[0])
        return t

    hooks = []
    for i, b in enumerate(transformer_blocks(model)):
        def pre(mod, args, kwargs, i=i):
            current[0] = i
            block_inputs[0] += sum(a.untyped_storage().nbytes() for a in (*args, *kwargs.values())
                                   if isinstance(a, torch.Tensor) and a.is_floating_point())

        hooks += [b.register_forward_pre_hook(pre, with_kwargs=True),
                  b.register_forward_hook(lambda *a: current.__setitem__(0, -1))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Measure() as attn, \
                FlopCounterMode(display=False) as flops:
            run()
    finally:
        for h in hooks:
            h.remove()
    per_block: dict[int, int] = {}
    for nbytes, block in saved.values():
        per_block[block] = per_block.get(block, 0) + nbytes
    outside = per_block.pop(-1, 0)
    return {"saved": sum(b for b, _ in saved.values()), "outside_blocks": outside,
            "largest_block": max(per_block.values(), default=0), "block_inputs": block_inputs[0],
            "flops": flops.get_total_flops() + attn.attention_flops}


# ------------------------------------------------------------------------------------------------ builders
def flow_model(cfg, arch: dict | None):
    """(transformer on meta, its family, the family's PlanInputs) from model.path's configs (the family the loader
    would pick) or a published architecture."""
    import diffusers

    from mmrl.models.families import LoadOptions, family_of

    m = cfg.model
    options = LoadOptions(sample_size=m.sample_size, num_frames=m.num_frames, guidance=m.guidance,
                          text_max_length=m.text_max_length)
    if arch is None:
        tcfg = json.load(open(os.path.join(m.path, "transformer", "config.json")))
        pipe = json.load(open(os.path.join(m.path, "model_index.json")))
        family = family_of(pipe, m.family, where=os.path.join(m.path, "model_index.json"))
        cls, config, folder = tcfg["_class_name"], {k: v for k, v in tcfg.items() if not k.startswith("_")}, m.path
        experts = 2 if (pipe.get("transformer_2") or [None])[0] and pipe.get("boundary_ratio") else 1
        boundary = pipe.get("boundary_ratio")
    else:
        family, cls, config, folder = arch["family"], arch["family"].transformer, arch["config"], None
        experts, boundary = arch.get("experts", 1), arch.get("boundary")
    with torch.device("meta"):
        tr = getattr(diffusers, cls).from_config(config)
    tr.experts, tr.boundary = experts, boundary  # Wan2.2 A14B: two transformers of this architecture, the second
                                                 # below sigma `boundary`
    return tr, family, family.plan_inputs(dict(tr.config), folder, options)


def token_model(cfg, arch: dict | None):
    import transformers

    if arch is None:
        config = transformers.AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    else:
        config = getattr(transformers, arch["class"].replace("ForConditionalGeneration", "Config"))(**arch["config"])
    auto = (transformers.AutoModelForImageTextToText if hasattr(config, "vision_config")
            else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        return auto.from_config(config)


def janus_model(cfg, arch: dict | None):
    """JanusForConditionalGeneration on the meta device at real size: model.path's config.json (a transformers Janus
    folder, as mmrl.policy.janus.load_janus reads it) or a published architecture's JanusConfig sub-configs."""
    import transformers

    if arch is None:
        config = transformers.AutoConfig.from_pretrained(cfg.model.path)
        if config.model_type != "janus":
            raise ConfigError(f"model.path={cfg.model.path!r} holds model_type={config.model_type!r}, not 'janus': "
                              f"point it at a transformers Janus folder (deepseek-community/Janus-Pro-1B or -7B), or "
                              f"plan --arch janus-pro-1b / janus-pro-7b")
    else:
        config = getattr(transformers, arch["class"].replace("ForConditionalGeneration", "Config"))(**arch["config"])
    with torch.device("meta"):
        return transformers.JanusForConditionalGeneration(config)


def prepare_janus(janus: torch.nn.Module, cfg) -> torch.nn.Module:
    """The trained module of `janus` (on meta) as JanusPolicy builds it: its ImageTokenLM (the language model, the
    generation embeddings, aligner and head), with LoRA on the policy's targets (its DEFAULT_LORA_TARGETS: the
    language model's attention and MLP projections, or model.lora.target_modules) or fully trained; the SigLIP tower,
    its aligner, the text head and the VQ model frozen at model.dtype."""
    from mmrl.policy.janus import DEFAULT_LORA_TARGETS, ImageTokenLM

    prepare(janus, cfg, list(cfg.model.lora.target_modules) or DEFAULT_LORA_TARGETS)
    lm = ImageTokenLM(janus)
    if not cfg.model.lora.enabled:  # full fine-tuning trains the image-token path only
        janus.requires_grad_(False)
        lm.requires_grad_(True)
    return lm


def janus_frozen(janus: torch.nn.Module, lm: torch.nn.Module) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """(the understanding path JanusPolicy holds but never runs: SigLIP tower, its aligner and the text head, unless
    the head is tied into `lm`'s embeddings; the VQ model), every one on the GPU whole beside the trained `lm`."""
    m, trained = janus.model, {p.untyped_storage()._cdata for p in lm.parameters()}
    parts = [m.vision_model, m.aligner, janus.lm_head]
    return [x for x in parts if not any(p.untyped_storage()._cdata in trained for p in x.parameters())], m.vqmodel


def janus_scorer(janus: torch.nn.Module, lm: torch.nn.Module, sampler, device: str):
    """A JanusPolicy holding only what its training forward (`_scores`: both CFG rows, sampler.cfg_grad, the guidance
    and temperature) and its gradient checkpointing read, so that the plan runs the policy's own code on `lm`.
    Prompts are token ids [1, P] of any value (the ids of BOS, pad and <begin_of_image> only move values)."""
    from mmrl.policy.janus import JanusPolicy

    pol = JanusPolicy.__new__(JanusPolicy)
    pol.janus, pol.lm, pol.device = janus, lm, torch.device(device)
    pol.cfg_grad, pol.temperature = sampler.cfg_grad, sampler.temperature
    pol.bos_id, pol.pad_id, pol.boi_id = 0, 1, 2
    return pol


def kv_cache_bytes(lm_config, rows: int, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a transformers language model's KV cache: rows x tokens x layers x (K, V) x kv heads x head dim."""
    heads = lm_config.num_key_value_heads or lm_config.num_attention_heads
    head_dim = getattr(lm_config, "head_dim", None) or lm_config.hidden_size // lm_config.num_attention_heads
    return rows * tokens * lm_config.num_hidden_layers * 2 * heads * head_dim * dtype.itemsize


def prepare(module: torch.nn.Module, cfg, targets: list[str] | str) -> None:
    """dtype, LoRA on `targets` (what the policy adapts: peft suffixes, or a regex) and trainable flags as the policy
    sets them. A LoRA adapter computes in fp32 (as in the policy); a fully fine-tuned model computes at model.dtype
    (bf16 autocast over its fp32 master weights, which the plan counts separately)."""
    from mmrl.policy.base import upcast_trainable

    module.to(torch_dtype(cfg.model.dtype))
    if cfg.model.lora.enabled:
        from peft import LoraConfig, inject_adapter_in_model

        module.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=cfg.model.lora.rank, lora_alpha=cfg.model.lora.alpha,
                                           target_modules=targets), module)
        upcast_trainable(module)
    else:
        module.requires_grad_(True)


def frozen_parts(cfg, arch: dict | None, family) -> tuple[list[torch.nn.Module], torch.nn.Module | None]:
    """(text encoders, VAE or None) of a model of `family` on the meta device at the dtype the pipeline loads them
    with: a published architecture's (its entry's, else its family's), else those model.path's folders name."""
    import diffusers
    import transformers

    dtype = torch_dtype(cfg.model.dtype)
    with torch.device("meta"):
        if arch is not None:
            encoders, (vae_cls, vae_cfg) = arch.get("frozen_parts") or family.frozen_parts
            text = [getattr(transformers, c)(getattr(transformers, k)(**conf)) for c, k, conf in encoders]
            vae = getattr(diffusers, vae_cls).from_config(vae_cfg)
        else:
            path = cfg.model.path
            pipe = json.load(open(os.path.join(path, "model_index.json")))
            if not family.diffusers:  # mmrl's pixel models: CLIP in fp32
                conf = transformers.AutoConfig.from_pretrained(os.path.join(path, "text_encoder"))
                return [transformers.CLIPTextModelWithProjection(conf)], None
            text = [getattr(transformers, pipe[n][1])(transformers.AutoConfig.from_pretrained(os.path.join(path, n)))
                    for n in sorted(pipe) if (n.startswith("text_encoder") or n == "image_encoder") and (pipe[n] or [None])[0]]
            vae = getattr(diffusers, pipe["vae"][1]).from_config(json.load(open(os.path.join(path, "vae", "config.json"))))
    return [m.to(dtype) for m in text], vae.to(dtype)


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())

