"""`mmrl plan CONFIG [--arch NAME] [key=value ...]`: what a run costs before any weight is loaded.

The trained model (a flow transformer, or a token policy's language model) is instantiated on the meta device at
real size (from `model.path`'s config files, or from a published architecture: mmrl/models/architectures.py), with
the run's dtype and LoRA, and one training micro-batch is run through it on meta tensors:
  - parameters, trainable parameters, and the bytes of weights (frozen at model.dtype, trained in fp32), fp32
    gradients, AdamW state (2 x fp32), EMA and the frozen KL reference copy when the run has them;
  - activations per micro-batch at their peak: the tensors autograd saves for backward (attention as a fused
    kernel saves it: q, k, v, output and the log-sum-exp, never the L x L matrix) plus the largest block's once
    more (its backward's gradients); with gradient checkpointing the blocks' inputs plus twice the largest
    block's (its recomputation and its gradients);
  - transformer FLOPs per iteration (torch's FlopCounterMode over that forward, x 3 for forward + backward, + 1
    forward to recompute under checkpointing): sampling (no grad) + training.
Text encoders, VAE and rollout storage are not counted. A micro-batch is `train.micro_batch` rows (flow:
transitions, doubled by CFG; token: sequences) or, when 0, a whole minibatch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmrl.config import policy_kind

GiB = 2**30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Shapes:
    """Transformer rows: of one training forward, of one iteration's sampling and of its training."""
    rows: int                      # rows of one training forward (CFG doubles flow rows)
    rows_sampled: int              # transformer rows of one iteration's rollout (no grad)
    rows_trained: int              # transformer rows trained per iteration (each a forward and a backward)


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
    """Replaces SDPA by _FusedAttention and counts its FLOPs (4 B H Lq Lk D, forward)."""

    def __init__(self):
        super().__init__()
        self.attention_flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            kwargs = dict(kwargs or {})
            q, k, v = (*args, *(kwargs.pop(n) for n in ("query", "key", "value") if n in kwargs))[:3]
            if k.shape[-3] != q.shape[-3]:  # grouped-query attention: keys shared by head groups
                rep = q.shape[-3] // k.shape[-3]
                k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
            self.attention_flops += 4 * q.shape[:-1].numel() * k.shape[-2] * q.shape[-1]
            return _FusedAttention.apply(q, k, v)
        return func(*args, **(kwargs or {}))


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks gradient checkpointing wraps (diffusers transformer blocks, decoder layers)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and name.split(".")[-1] in (
                "transformer_blocks", "single_transformer_blocks", "blocks", "layers"):
            out += list(m)
    return out


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
    for i, b in enumerate(_blocks(model)):
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
def _flow_model(cfg, arch: dict | None):
    """(transformer on meta, call(x, sigma, enc, pooled), latent shape, text tokens, enc dim, pooled dim)."""
    import diffusers

    from mmrl.models import pipelines as P

    if arch is None:
        tcfg = json.load(open(os.path.join(cfg.model.path, "transformer", "config.json")))
        cls, pipe = tcfg["_class_name"], json.load(open(os.path.join(cfg.model.path, "model_index.json")))
        config = {k: v for k, v in tcfg.items() if not k.startswith("_")}
        text_tokens = _text_tokens(cfg.model.path, pipe["_class_name"])
        coords = pipe.get("coordinates", False)
        experts = 2 if (pipe.get("transformer_2") or [None])[0] and pipe.get("boundary_ratio") else 1
    else:
        cls, config, text_tokens, coords = arch["class"], arch["config"], arch["text_tokens"], False
        experts = arch.get("experts", 1)
    with torch.device("meta"):
        tr = getattr(diffusers, cls).from_config(config)
    tr.experts = experts  # Wan2.2 A14B: two transformers of this architecture, one runs per forward
    c = tr.config
    if cls == "FluxTransformer2DModel":
        size = cfg.model.sample_size or 128
        return tr, P.flux_call(cfg.model.guidance), (c.in_channels // 4, size, size), text_tokens, \
            c.joint_attention_dim, c.pooled_projection_dim
    if cls == "QwenImageTransformer2DModel":  # the text mask rides in the pooled slot: [m, text_tokens]
        size = cfg.model.sample_size or 128
        return tr, P.qwen_image_call, (c.out_channels, size, size), text_tokens, c.joint_attention_dim, text_tokens
    if cls == "WanTransformer3DModel":
        size, frames = cfg.model.sample_size or 60, cfg.model.num_frames or 81
        ch = c.in_channels - (3 if coords else 0)
        return tr, P.wan_coord_call if coords else P.wan_call, (ch, (frames - 1) // 4 + 1, size, size), \
            text_tokens, c.text_dim, 0
    size = cfg.model.sample_size or c.sample_size
    return tr, P.sd3_call, (c.in_channels, size, size), text_tokens, c.joint_attention_dim, c.pooled_projection_dim


def _text_tokens(path: str, pipeline: str) -> int:
    """Prompt tokens the pipeline feeds the transformer: its defaults (SD3 77 CLIP + 256 T5, FLUX and Wan 512),
    the tokenizer's length for mmrl's pixel model."""
    from mmrl.models.pipelines import QWEN_IMAGE_TEXT_LEN

    defaults = {"StableDiffusion3Pipeline": 77 + 256, "FluxPipeline": 512, "WanPipeline": 512,
                "QwenImagePipeline": QWEN_IMAGE_TEXT_LEN}
    if pipeline in defaults:
        return defaults[pipeline]
    return json.load(open(os.path.join(path, "tokenizer", "tokenizer_config.json"))).get("model_max_length", 77)


def _token_model(cfg, arch: dict | None):
    import transformers

    if arch is None:
        config = transformers.AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    else:
        config = getattr(transformers, arch["class"].replace("ForConditionalGeneration", "Config"))(**arch["config"])
    auto = (transformers.AutoModelForImageTextToText if hasattr(config, "vision_config")
            else transformers.AutoModelForCausalLM)
    with torch.device("meta"):
        return auto.from_config(config)


def _prepare(module: torch.nn.Module, cfg, targets) -> None:
    """dtype, LoRA and trainable flags as the policy sets them. A LoRA adapter computes in fp32 (as in the
    policy); a fully fine-tuned model computes at model.dtype (bf16 autocast over its fp32 master weights, which
    the plan counts separately)."""
    from mmrl.policy.base import upcast_trainable

    module.to(_DTYPES[cfg.model.dtype])
    if cfg.model.lora.enabled:
        from peft import LoraConfig, inject_adapter_in_model

        module.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=cfg.model.lora.rank, lora_alpha=cfg.model.lora.alpha,
                                           target_modules=list(cfg.model.lora.target_modules) or targets), module)
        upcast_trainable(module)
    else:
        module.requires_grad_(True)


def plan(cfg, arch_name: str | None = None, prompt_tokens: int = 512) -> dict:
    """The cost of one iteration of config `cfg` (see the module docstring). prompt_tokens: a token policy's
    prompt length (with its video or image tokens)."""
    from mmrl.models.architectures import ARCHITECTURES

    arch = None
    if arch_name:
        if arch_name not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {arch_name!r}; known: {sorted(ARCHITECTURES)}")
        arch = ARCHITECTURES[arch_name]
        if arch["policy"] != policy_kind(cfg.model.policy):
            raise ValueError(f"--arch {arch_name} is a {arch['policy']} model but the config has "
                             f"model.policy={cfg.model.policy}")
    elif not os.path.isdir(cfg.model.path):
        raise FileNotFoundError(f"model.path={cfg.model.path!r} does not exist: point it at a model folder, or plan "
                                f"a published architecture with --arch ({', '.join(sorted(ARCHITECTURES))})")
    t, s = cfg.train, cfg.sampler
    n_rows = t.prompts_per_iter * t.group_size
    per_minibatch = n_rows // t.minibatches
    dtype = _DTYPES[cfg.model.dtype]
    if policy_kind(cfg.model.policy) is None:
        raise ValueError(f"mmrl plan knows the built-in policies (flow, token), not model.policy={cfg.model.policy}")
    if policy_kind(cfg.model.policy) == "flow":
        from mmrl.algorithms.losses import objective
        from mmrl.models.pipelines import QWEN_IMAGE_LORA_TARGETS, SD3_LORA_TARGETS, WAN_LORA_TARGETS
        from mmrl.sampling.flow_sde import strided_schedule

        model, call, latent, text_tokens, enc_dim, pooled_dim = _flow_model(cfg, arch)
        name = type(model).__name__
        targets = list(WAN_LORA_TARGETS if "Wan" in name else QWEN_IMAGE_LORA_TARGETS if "QwenImage" in name
                       else SD3_LORA_TARGETS)
        _prepare(model, cfg, targets)
        cfg_rows = 2 if s.cfg_scale != 1.0 else 1
        # trained actions per row: SDE steps, or noise levels of the final sample (forward-process losses, which
        # also pay one velocity forward per action when sampling)
        forward = objective(cfg.algo.policy_loss) == "forward"
        trained_steps = s.forward_timesteps if forward else s.sde_window_size or s.num_steps - 1
        kinds = ["sde" if i < min(s.sde_window_size or s.num_steps, s.num_steps - 1) else "ode"
                 for i in range(s.num_steps)]  # MixGRPO-Flash's strided ODE, the window at its first start
        sample_calls = len(strided_schedule(torch.zeros(s.num_steps + 1), kinds, s.ode_stride)[1])
        transitions = t.micro_batch or per_minibatch * trained_steps
        m = transitions * cfg_rows
        shapes = Shapes(m, n_rows * (sample_calls + (s.forward_timesteps if forward else 0)) * cfg_rows,
                        n_rows * trained_steps * cfg_rows * t.inner_epochs)

        def run():
            x = torch.empty(m, *latent, device="meta", dtype=dtype)
            enc = torch.empty(m, text_tokens, enc_dim, device="meta", dtype=dtype)
            call(model, x, torch.full((m,), 0.5, device="meta", dtype=dtype), enc,
                 torch.empty(m, pooled_dim, device="meta", dtype=dtype)).float().sum()
    else:
        from mmrl.policy.vlm import DEFAULT_LORA_TARGETS

        model = _token_model(cfg, arch)
        _prepare(model, cfg, DEFAULT_LORA_TARGETS)
        seq = prompt_tokens + s.max_new_tokens
        m = t.micro_batch or per_minibatch
        shapes = Shapes(m, n_rows, n_rows * t.inner_epochs)
        base = model.model if hasattr(model, "model") else model
        lm = getattr(base, "language_model", base)

        def run():
            ids = torch.zeros(m, seq, dtype=torch.long, device="meta")
            pos = torch.arange(seq, device="meta").expand(3 if lm is not base else 1, m, seq)
            h = lm(input_ids=ids, position_ids=pos if lm is not base else pos[0], use_cache=False).last_hidden_state
            model.lm_head(h[:, -s.max_new_tokens:]).float().logsumexp(-1).sum()  # the completion's log-probs

    meas = measure_forward(model, run)
    experts = getattr(model, "experts", 1)
    n_params = experts * sum(p.numel() for p in model.parameters())
    trainable = experts * sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen_bytes = experts * sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    ref = n_params * dtype.itemsize if (cfg.algo.kl_coef > 0 and cfg.model.reference == "auto"
                                        and not cfg.model.lora.enabled) else 0
    state = {"weights_frozen": frozen_bytes, "weights_trained_fp32": 4 * trainable, "gradients_fp32": 4 * trainable,
             "adamw_state_fp32": 8 * trainable, "ema_fp32": 4 * trainable if t.ema_decay > 0 else 0,
             "kl_reference_copy": ref}
    # the backward of a block allocates gradients of about its saved size while those are still held: the peak
    # is the saved tensors plus the largest block's (with checkpointing: the blocks' inputs, the largest block
    # recomputed, and its gradients)
    act = meas["saved"] + meas["largest_block"]
    act_ckpt = meas["block_inputs"] + 2 * meas["largest_block"] + meas["outside_blocks"]
    fwd_row = meas["flops"] / m
    train_factor = 4 if t.gradient_checkpointing else 3
    out = {
        "model": arch_name or cfg.model.path, "class": type(model).__name__, "policy": cfg.model.policy,
        "dtype": cfg.model.dtype, "lora": cfg.model.lora.enabled, "experts": experts,
        "params": n_params, "trainable_params": trainable,
        "micro_batch_rows": m, "rows_sampled_per_iter": shapes.rows_sampled, "rows_trained_per_iter": shapes.rows_trained,
        **{f"{k}_gib": v / GiB for k, v in state.items()},
        "activations_per_micro_batch_gib": act / GiB,
        "activations_per_micro_batch_checkpointed_gib": act_ckpt / GiB,
        "total_gib": (sum(state.values()) + (act_ckpt if t.gradient_checkpointing else act)) / GiB,
        "forward_tflop_per_row": fwd_row / 1e12,
        "tflop_per_iter_sampling": fwd_row * shapes.rows_sampled / 1e12,
        "tflop_per_iter_training": fwd_row * shapes.rows_trained * train_factor / 1e12,
    }
    return out


def format_plan(p: dict) -> str:
    g = lambda k: f"{p[k]:.2f} GiB"  # noqa: E731
    lines = [f"{p['model']} ({p['class']}, {p['dtype']}{', LoRA' if p['lora'] else ', full fine-tuning'})",
             f"  parameters            {p['params'] / 1e9:.3f} B, trainable {p['trainable_params'] / 1e6:.1f} M",
             f"  frozen weights        {g('weights_frozen_gib')}",
             f"  trained weights fp32  {g('weights_trained_fp32_gib')}   gradients {g('gradients_fp32_gib')}   "
             f"AdamW state {g('adamw_state_fp32_gib')}   EMA {g('ema_fp32_gib')}",
             f"  KL reference copy     {g('kl_reference_copy_gib')}",
             f"  activations / micro-batch of {p['micro_batch_rows']} rows: {g('activations_per_micro_batch_gib')}, "
             f"with gradient checkpointing {g('activations_per_micro_batch_checkpointed_gib')}",
             f"  total (this config)   {g('total_gib')}",
             f"  TFLOP / iteration     sampling {p['tflop_per_iter_sampling']:.1f} ({p['rows_sampled_per_iter']} rows), "
             f"training {p['tflop_per_iter_training']:.1f} ({p['rows_trained_per_iter']} rows x fwd+bwd)"]
    return "\n".join(lines)
