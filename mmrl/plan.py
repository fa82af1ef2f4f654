"""`mmrl plan CONFIG [--arch NAME] [--world N] [--cp D] [key=value ...]`: what a run costs per GPU before any weight
is loaded.

Measured (`measured=True`, what the command does): one iteration at real size on fake tensors under a fake process
group of world x cp ranks, through the trainer's own FSDP2 layout, the model's forward and backward, AdamW and the
EMA, tracked by torch's MemTracker per phase: start-up, sampling, decode, training, save (mmrl/plan_measure.py).
By hand (always; the breakdown it prints beside the phases):

The trained model (a flow transformer, a token policy's language model, or Janus-Pro's image-token path) is
instantiated on the meta device at real size (from `model.path`'s config files, or from a published architecture:
mmrl/models/architectures.py), with the run's dtype and LoRA, and one training micro-batch is run through it on meta
tensors:
  - parameters, trainable parameters, and the bytes of weights (frozen at model.dtype, trained in fp32), fp32
    gradients, AdamW state (2 x fp32), EMA and the frozen reference copy (KL, DGPO, DPO) when the run has them;
  - activations per micro-batch at their peak: the tensors autograd saves for backward (attention as a fused
    kernel saves it: q, k, v, output and the log-sum-exp, never the L x L matrix) plus the largest block's once
    more (its backward's gradients); with gradient checkpointing the blocks' inputs plus twice the largest
    block's (its recomputation and its gradients);
  - transformer FLOPs per iteration (torch's FlopCounterMode over that forward, x 3 for forward + backward, + 1
    forward to recompute under checkpointing): sampling (no grad) + training.
The frozen parts are instantiated on meta too: the text encoders and the VAE (their parameters at model.dtype), and
the VAE decode of one sampling chunk (`train.sample_chunk`, else `train.micro_batch` rows, 0 = all of a rank's rows),
whose peak of live tensors (LivePeak) is the decode transient. Rollout storage is what a rank keeps from sampling to
training: per row and trained action three fp32 latents (x_t, x_t+1 and the rollout mean; forward-process losses:
x_t, the target and the old velocity), the prompt embedding, the decoded output; token policies the token ids and
old log-probs (media pixels are not counted). The whole chain (every step's latent and mean) lives while sampling.

Janus-Pro (model.policy: janus, mmrl/policy/janus.py) is planned with the policy's own pieces: its ImageTokenLM
(language model, generation embeddings, aligner and head) is what trains and what FSDP shards, with LoRA on the
policy's targets or fully trained; the training forward is the policy's `_scores` over both CFG rows of each sample
(prompt + A - 1 image tokens, A logits over the codebook; sampler.cfg_grad=cond runs the unconditional rows without
gradient). Frozen and replicated beside it (the "text encoders" slot): the SigLIP tower, its aligner and the text
head; the VQ model is the VAE slot, its decode of a sampling chunk (A tokens -> pixels) the decode transient. The
sampling chain is the KV cache of a chunk's generation (2 rows per sample, prompt + A tokens); a full fine-tuning
reference is the policy's copy of the ImageTokenLM at model.dtype, sharded under FSDP like the live one. Full
fine-tuning and LoRA under FSDP build the ImageTokenLM on meta and read each rank's shards (start-up never holds it
whole; LoRA's adapters start in their shards); DDP loads the whole model onto each GPU first: start-up then holds the
whole ImageTokenLM, the reference and the frozen parts at once (peak_loading). Prompts are `prompt_tokens` long (default 48, a bound: GenEval's longest prompt is 12
words, some 30 tokens in Janus's chat template); rollouts keep image tokens and log-probs (the decoded images go to
host memory). FLOPs: a CFG row's generation is counted as one forward of its sequence (the KV cache makes the A
steps one pass), plus one more per row for the old log-probs when the trainer cannot defer them.

Several GPUs (`world` data-parallel processes x `cp` context-parallel ranks each): a rank samples ceil(B / world)
whole groups; minibatches are chunks of one global permutation, so a rank's rows in one minibatch vary: without
`train.micro_batch` the plan sizes the training forward for the share exceeded once in 10^6 minibatches
(hypergeometric). `train.parallel=fsdp` shards weights, gradients, AdamW state and EMA over world x cp GPUs (and
all-gathers two blocks' weights at a time); hsdp shards them over a node's GPUs (train.shard_size; 0 = a node of
PLAN_NODE_GPUS = 8, or all GPUs when fewer) and replicates across nodes, so a GPU holds what it would under fsdp on
one node; ddp replicates them; a flow or Janus policy's frozen KL reference copy is sharded like them (not under
model.offload, nor a token policy's). Context parallelism (mmrl/parallel/context_parallel.py) splits one forward's video tokens
cp ways: the transformer activations per GPU divide by cp, while rollouts, text encoders, VAE and its decode stay per
rank. No wall-clock time is estimated: FLOPs and rows per GPU are given instead.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from mmrl.algorithms.objective import build_objective
from mmrl.config import SHARDED
from mmrl.policy.kinds import kind_of
from mmrl.registry import import_path
from mmrl.devices import torch_dtype
from mmrl.parallel.distributed import check_parallel_config
from mmrl.parallel.shards import transformer_blocks
from mmrl.errors import ConfigError, MissingFile
from mmrl.models.families import all_architectures, lora_targets
from mmrl.plan_models import (Shapes, decode_peak, flow_model, frozen_parts, janus_frozen, janus_model, janus_scorer,
                              kv_cache_bytes, measure_forward, param_bytes, prepare, prepare_janus, token_model)
from mmrl.plan_measure import PHASES, flow_workload, janus_workload, measure, token_workload
from mmrl.plan_rows import Rows, flow_steps, idle_expert_rows, rows_of
from mmrl.policy.base import reference_kind

log = logging.getLogger(__name__)
GiB = 2**30
NAMES = {"text": "text encoders", "vae": "VAE", "chain": "the sampling chain"}  # what each frozen slot holds
JANUS_NAMES = {"text": "understanding path", "vae": "VQ model", "chain": "generation KV cache"}
PLAN_NODE_GPUS = 8  # GPUs per node for train.parallel=hsdp with train.shard_size=0 (a launched run reads its node's)


def _kind(cfg):
    """The declaration of the config's policy kind (mmrl/policy/kinds.py); None for a user's own policy."""
    return kind_of(cfg.model.policy)



def _check_layout(cfg, world: int, cp: int, folder: bool) -> None:
    """Refuse a layout the run cannot have, naming the fix: the checks a launched run makes (world x cp processes,
    train.context_parallel = cp; the model folder's configs when there is one), and context parallelism only for
    flow transformers."""
    import dataclasses

    if world < 1 or cp < 1:
        raise ConfigError(f"--world and --cp must be >= 1, got {world} and {cp}")
    if world * cp > 1 and cfg.train.parallel == "none":
        raise ConfigError(f"train.parallel=none on {world * cp} GPUs: every process would train alone. Set "
                          f"train.parallel=ddp (replicated weights) or fsdp (sharded weights; hsdp: within a node)")
    if cp > 1 and not getattr(_kind(cfg), "denoises", False):
        raise ConfigError("--cp splits a flow transformer's video tokens (mmrl/parallel/context_parallel.py); token policies: --cp 1")
    check_parallel_config(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, context_parallel=cp)),
                          world * cp, folder=folder)
    sharded_over(cfg.train, world * cp)  # hsdp: a shard group that divides the GPUs


class _NoCastWarning(logging.Filter):
    """Drops diffusers' "There are modules in X that should be kept in float32 ... Casting directly with `to()`"
    line: the plan casts skeletons on the meta device to count bytes, so each plan printed it once per model part
    (two lines before its output) about a cast that never runs on weights."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32" not in record.getMessage()


def _without_cast_warnings(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        logger, quiet = logging.getLogger("diffusers.models.modeling_utils"), _NoCastWarning()
        logger.addFilter(quiet)
        try:
            return fn(*args, **kwargs)
        finally:
            logger.removeFilter(quiet)
    return wrapped


@dataclass
class Parts:
    """The trained model on meta (prepared as the policy prepares it) and what a rank holds around it, in bytes."""
    model: torch.nn.Module
    run: Callable[[], None]    # one training forward of `shapes.rows` rows on meta tensors
    shapes: Shapes
    stored: int                # rollout storage: what a rank keeps from sampling to training
    workload: Callable         # () -> the plan_measure.Workload of one iteration
    text: list = field(default_factory=list)  # frozen text encoders (on meta)
    vae: torch.nn.Module | None = None
    decode: int = 0            # the VAE decode transient of one chunk
    chain: int = 0             # every step's latent and mean while sampling
    cache: int = 0             # the prompt-embedding cache
    names: dict = field(default_factory=lambda: dict(NAMES))  # what the frozen slots hold (format_plan's labels)
    checkpoint: Callable[[], None] | None = None  # gradient checkpointing on as the policy does (None: the model's)
    loaded_whole: int = 0      # the trained model's bytes on a GPU before sharding (0: loaded into shards)


def _architecture(cfg, arch_name: str | None) -> dict | None:
    """The published architecture `arch_name` (None: model.path's configs, which must exist)."""
    if arch_name is None:
        if not os.path.isdir(cfg.model.path):
            raise MissingFile(f"model.path={cfg.model.path!r} does not exist: point it at a model folder, or plan "
                              f"a published architecture with --arch ({', '.join(sorted(all_architectures()))})")
        return None
    if arch_name not in all_architectures():
        raise ConfigError(f"unknown architecture {arch_name!r}; known: {sorted(all_architectures())}")
    arch = all_architectures()[arch_name]
    if arch["policy"] != cfg.model.policy:
        raise ConfigError(f"--arch {arch_name} is a {arch['policy']} model but the config has "
                          f"model.policy={cfg.model.policy}")
    return arch


def _flow_call(model, inputs, m: int, dtype: torch.dtype) -> Callable[[], None]:
    """One training forward of m rows on meta tensors through the family's call."""
    def run():
        x = torch.empty(m, *inputs.latent_shape, device="meta", dtype=dtype)
        enc = torch.empty(m, inputs.text_tokens, inputs.enc_dim, device="meta", dtype=dtype)
        inputs.call(model, x, torch.full((m,), 0.5, device="meta", dtype=dtype), enc,
                    torch.empty(m, inputs.pooled_dim, device="meta", dtype=dtype)).float().sum()
    return run


def flow_parts(cfg, arch: dict | None, rows: Rows, cp: int, prompt_tokens: int, needs_reference: bool) -> Parts:
    """A flow transformer, its frozen parts and a rank's rollout bytes, every model fact read from its family (LoRA
    targets, the shapes it is fed, how its VAE decodes)."""
    t, s, dtype = cfg.train, cfg.sampler, torch_dtype(cfg.model.dtype)
    model, family, inputs = flow_model(cfg, arch)
    if cp > 1 and not getattr(type(model), "_cp_plan", None):
        raise ConfigError(f"--cp {cp}: diffusers has no context-parallel plan for {type(model).__name__}; use --cp 1")
    prepare(model, cfg, lora_targets(family, cfg.model.lora.target_modules))
    forward = build_objective(cfg.algo).actions == "forward"  # also pays one velocity forward per action sampling
    trained_steps, sample_calls = flow_steps(s, forward, getattr(model, "experts", 1))
    cfg_rows = 2 if s.cfg_scale != 1.0 else 1
    transitions = t.micro_batch or rows.share * trained_steps
    grad_rows = cfg_rows if s.cfg_grad == "full" else 1  # cfg_grad=cond: the unconditional rows run without autograd
    trained = rows.total * trained_steps * t.inner_epochs
    idle = idle_expert_rows(cfg, model, rows, trained_steps, forward)
    sampled = round(rows.total * (sample_calls + (s.forward_timesteps if forward else 0)) * cfg_rows)
    shapes = Shapes(transitions * grad_rows, sampled,
                    trained * grad_rows + idle, trained * (cfg_rows - grad_rows))
    text, vae = frozen_parts(cfg, arch, family)
    latent_bytes = 4 * math.prod(inputs.latent_shape)  # the SDE math is fp32
    decode, out_bytes = 0, latent_bytes
    if vae is not None:
        decode, shape = decode_peak(vae, torch.empty(rows.chunk, *family.vae_latent(inputs.latent_shape),
                                                     device="meta", dtype=dtype))
        out_bytes = 4 * math.prod(shape[1:])
    prompt_bytes = (inputs.text_tokens * inputs.enc_dim + inputs.pooled_dim) * dtype.itemsize
    stored = rows.rank * (3 * trained_steps * latent_bytes + prompt_bytes + out_bytes)
    chain = round(rows.rank * (2 * sample_calls + 1)) * latent_bytes
    cache = min(cfg.model.text_cache * prompt_bytes, 2**30)  # BoundedCache(text_cache, 1 GiB) of embeddings
    passes = -(-rows.share * trained_steps // transitions) * t.grad_accum  # training forwards per optimizer step
    workload = functools.partial(
        flow_workload, cfg, model, inputs, text, vae, chunk=rows.chunk, m=transitions, cp=cp, kept=stored + cache,
        chain=chain, passes=passes, needs_reference=needs_reference, forward_objective=forward,
        vae_latent=family.vae_latent(inputs.latent_shape))
    return Parts(model, _flow_call(model, inputs, shapes.rows, dtype), shapes, stored, workload, text, vae, decode,
                 chain, cache)


def token_parts(cfg, arch: dict | None, rows: Rows, cp: int, prompt_tokens: int, needs_reference: bool) -> Parts:
    """A token policy's language model (the vision tower counted, never run: token ids stand in for the media)."""
    from mmrl.policy.token import DEFAULT_LORA_TARGETS

    t, s = cfg.train, cfg.sampler
    model = token_model(cfg, arch)
    prepare(model, cfg, list(cfg.model.lora.target_modules) or DEFAULT_LORA_TARGETS)
    seq, m = prompt_tokens + s.max_new_tokens, t.micro_batch or rows.share
    base = model.model if hasattr(model, "model") else model
    lm = getattr(base, "language_model", base)

    def run():
        ids = torch.zeros(m, seq, dtype=torch.long, device="meta")
        pos = torch.arange(seq, device="meta").expand(3 if lm is not base else 1, m, seq)
        h = lm(input_ids=ids, position_ids=pos if lm is not base else pos[0], use_cache=False).last_hidden_state
        model.lm_head(h[:, -s.max_new_tokens:]).float().logsumexp(-1).sum()  # the completion's log-probs

    stored = rows.rank * (8 * seq + 4 * s.max_new_tokens)  # int64 token ids, fp32 old log-probs
    workload = functools.partial(token_workload, cfg, model, chunk=rows.chunk, m=m, seq=seq, kept=stored,
                                 needs_reference=needs_reference)
    whole = sum(q.numel() * (4 if q.requires_grad else q.element_size()) for q in model.parameters())  # upcast, unsharded
    return Parts(model, run, Shapes(m, rows.total, rows.total * t.inner_epochs), stored, workload,
                 loaded_whole=whole)  # build_token_policy loads the whole model onto each GPU before sharding


def janus_parts(cfg, arch: dict | None, rows: Rows, cp: int, prompt_tokens: int, needs_reference: bool) -> Parts:
    """Janus-Pro's image-token path, the policy's training forward through it, its frozen parts, the VQ decode of a
    sampling chunk and the KV cache of its generation (see the module docstring)."""
    from mmrl.policy.janus import JanusPolicy, check_janus_config
    from mmrl.policy.token import selective_log_softmax

    check_janus_config(cfg)
    t, s, dtype = cfg.train, cfg.sampler, torch_dtype(cfg.model.dtype)
    janus = janus_model(cfg, arch)
    lm = prepare_janus(janus, cfg)
    frozen, vq = janus_frozen(janus, lm)
    scorer = janus_scorer(janus, lm, s, "meta")
    a, p, m = janus.config.vision_config.num_image_tokens, prompt_tokens, t.micro_batch or rows.share
    cfg_rows = 2 if s.cfg_scale != 1 else 1

    def run():  # the policy's log_prob of m rows: [m, P] prompts (both CFG rows), A image tokens scored
        ids = torch.zeros(m, a, dtype=torch.long, device="meta")                                # [m, A]
        scores = scorer._scores([torch.zeros(1, p, dtype=torch.long)] * m, ids, s.cfg_scale)    # [m, A, K] fp32
        selective_log_softmax(scores, ids)[0].sum()

    decode = decode_peak(vq, torch.zeros(rows.chunk, a, dtype=torch.long, device="meta"))[0]
    stored = rows.rank * a * (8 + 4 + 4 + 1)  # int64 image tokens, fp32 old and rollout log-probs, the action mask
    kv = kv_cache_bytes(janus.model.language_model.config, rows.chunk * cfg_rows, p + a, dtype)
    deferred = t.minibatches == t.grad_accum and not t.sampling_ema  # else one more forward per row (old log-probs)
    trained, full = rows.total * t.inner_epochs, s.cfg_grad == "full" or cfg_rows == 1
    shapes = Shapes(m * cfg_rows, rows.total * cfg_rows * (1 if deferred else 2), trained * (cfg_rows if full else 1),
                    0 if full else trained)
    passes = -(-rows.share // m) * t.grad_accum  # training forwards per optimizer step on a rank
    whole = sum(q.numel() * (4 if q.requires_grad else q.element_size()) for q in lm.parameters())  # upcast, unsharded
    if t.parallel in SHARDED:
        whole = 0  # build_janus_policy builds the trained path on meta and reads it into shards (LoRA: its base)
    workload = functools.partial(janus_workload, cfg, janus, lm, frozen, vq, scorer, chunk=rows.chunk, m=m, prompt=p,
                                 kept=stored, passes=passes, needs_reference=needs_reference, loaded_whole=whole)
    return Parts(lm, run, shapes, stored, workload, frozen, vq, decode, kv, names=dict(JANUS_NAMES),
                 checkpoint=functools.partial(JanusPolicy.enable_gradient_checkpointing, scorer),
                 loaded_whole=whole)


def sharded_over(t, gpus: int) -> int:
    """GPUs sharing one copy of the trained weights (train config `t`, `gpus` GPUs): fsdp all of them, hsdp one node's
    (train.shard_size, else PLAN_NODE_GPUS or all GPUs when fewer), ddp one."""
    size = {"fsdp": gpus, "hsdp": t.shard_size or min(PLAN_NODE_GPUS, gpus)}.get(t.parallel, 1)
    if gpus % size:
        raise ConfigError(f"train.parallel=hsdp shards over {size} GPUs (train.shard_size; 0 = a node of "
                          f"{PLAN_NODE_GPUS}), which must divide the {gpus} GPUs: set train.shard_size to one node's GPUs")
    return size


def _state(cfg, model: torch.nn.Module, shard: int) -> dict[str, float]:
    """Bytes per GPU of the weights, gradients, AdamW state, EMA and KL reference copy (`shard` GPUs share them; the
    copy at model.dtype)."""
    experts = getattr(model, "experts", 1)
    n_params = experts * sum(p.numel() for p in model.parameters())
    trainable = experts * sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = experts * sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    ref = n_params * torch_dtype(cfg.model.dtype).itemsize \
        if (reference_kind(cfg) == "auto" and not cfg.model.lora.enabled) else 0
    if _kind(cfg).shards_reference and not cfg.model.offload:  # parallelize shards it (FlowPolicy, JanusPolicy)
        ref /= shard
    return {"weights_frozen": frozen / shard, "weights_trained_fp32": 4 * trainable / shard,
            "gradients_fp32": 4 * trainable / shard, "adamw_state_fp32": 8 * trainable / shard,
            "ema_fp32": 4 * trainable / shard if cfg.train.ema_decay > 0 else 0, "kl_reference_copy": ref}


def _gathered(model: torch.nn.Module, shard: int, mixed_precision: str) -> int:
    """FSDP2 all-gathers one block's weights for its forward and prefetches the next: two blocks, unsharded."""
    if shard == 1:
        return 0
    per_param = lambda p: 2 if (p.requires_grad and mixed_precision == "bf16") else p.element_size()  # noqa: E731
    return 2 * max((sum(p.numel() * per_param(p) for p in b.parameters()) for b in transformer_blocks(model)), default=0)


def _by_hand(cfg, parts: Parts, rows: Rows, world: int, cp: int) -> dict:
    """The plan's figures by hand (sizes in GiB, counts, TFLOP; see the module docstring)."""
    t, model, shapes = cfg.train, parts.model, parts.shapes
    meas = measure_forward(model, parts.run)
    shard = sharded_over(t, world * cp)
    state, gathered = _state(cfg, model, shard), _gathered(model, shard, t.mixed_precision)
    experts = getattr(model, "experts", 1)
    # the backward of a block allocates gradients of about its saved size while those are still held: the peak
    # is the saved tensors plus the largest block's (with checkpointing: the blocks' inputs, the largest block
    # recomputed, and its gradients)
    act = meas["saved"] + meas["largest_block"]
    act_ckpt = meas["block_inputs"] + 2 * meas["largest_block"] + meas["outside_blocks"]
    text_bytes = sum(param_bytes(e) for e in parts.text)
    vae_bytes = param_bytes(parts.vae) if parts.vae is not None else 0
    resident = sum(v for k, v in state.items() if k != "gradients_fp32") + parts.cache + gathered + parts.stored
    peak_sampling = resident + text_bytes + vae_bytes + parts.chain + parts.decode
    peak_training = resident + state["gradients_fp32"] + (act_ckpt if t.gradient_checkpointing else act) / cp \
        + (0 if cfg.model.offload else text_bytes + vae_bytes)
    # a policy that loads onto the GPU before sharding (Janus) holds its whole trained model, fp32 where it trains
    peak_loading = parts.loaded_whole + state["kl_reference_copy"] + text_bytes + vae_bytes if parts.loaded_whole else 0
    fwd_row, train_factor = meas["flops"] / shapes.rows, 4 if t.gradient_checkpointing else 3
    trained_rows = shapes.rows_trained * train_factor + shapes.rows_forward_only  # forward row equivalents
    frac = rows.rank / rows.total  # of an iteration's rows, on one rank
    return {
        "class": type(model).__name__, "policy": cfg.model.policy, "dtype": cfg.model.dtype,
        "lora": cfg.model.lora.enabled, "experts": experts, "world": world, "cp": cp, "gpus": world * cp,
        "parallel": t.parallel, "sharded_over": shard,
        "params": experts * sum(p.numel() for p in model.parameters()),
        "trainable_params": experts * sum(p.numel() for p in model.parameters() if p.requires_grad),
        "text_encoder_params": sum(p.numel() for e in parts.text for p in e.parameters()),
        "vae_params": sum(p.numel() for p in parts.vae.parameters()) if parts.vae is not None else 0,
        "micro_batch_rows": shapes.rows, "rows_sampled_per_iter": shapes.rows_sampled,
        "rows_trained_per_iter": shapes.rows_trained, "rows_forward_only_per_iter": shapes.rows_forward_only,
        "rows_per_rank": rows.rank,
        "groups_per_rank": rows.rank // t.group_size, "rank_rows_per_minibatch_mean": rows.mean,
        "rank_rows_per_minibatch_planned": rows.share, "rank_rows_per_minibatch_max": rows.most,
        "rows_sampled_per_rank_per_iter": round(shapes.rows_sampled * frac),
        "rows_trained_per_rank_per_iter": round(shapes.rows_trained * frac),
        **{f"{k}_gib": v / GiB for k, v in state.items()},
        "fsdp_gathered_blocks_gib": gathered / GiB,
        "text_encoders_gib": text_bytes / GiB, "text_cache_gib": parts.cache / GiB, "vae_gib": vae_bytes / GiB,
        "rollout_storage_gib": parts.stored / GiB, "sampling_chain_gib": parts.chain / GiB,
        "vae_decode_rows": rows.chunk if parts.vae is not None else 0, "vae_decode_transient_gib": parts.decode / GiB,
        "activations_per_micro_batch_gib": act / GiB / cp,
        "activations_per_micro_batch_checkpointed_gib": act_ckpt / GiB / cp,
        "peak_sampling_gib": peak_sampling / GiB, "peak_training_gib": peak_training / GiB,
        "peak_loading_gib": peak_loading / GiB, "total_gib": max(peak_sampling, peak_training, peak_loading) / GiB,
        "forward_tflop_per_row": fwd_row / 1e12,
        "tflop_per_iter_sampling": fwd_row * shapes.rows_sampled / 1e12,
        "tflop_per_iter_training": fwd_row * trained_rows / 1e12,
        "tflop_per_gpu_per_iter": fwd_row * (shapes.rows_sampled + trained_rows) * frac / cp / 1e12,
        "names": parts.names,
    }


def _measured(cfg, parts: Parts, out: dict, device: str) -> dict:
    """`out` with the per-phase peaks of one iteration on fake tensors (mmrl/plan_measure.py), or, when that
    measurement fails, with the failure named (the by-hand figures still stand)."""
    t, model = cfg.train, parts.model
    if t.gradient_checkpointing and parts.checkpoint is not None:
        parts.checkpoint()
    elif t.gradient_checkpointing:
        model.gradient_checkpointing_enable() if hasattr(model, "gradient_checkpointing_enable") \
            else model.enable_gradient_checkpointing()
    try:
        peaks = measure(parts.workload(), out["sharded_over"], t.parallel, t.mixed_precision, foreach=device == "cuda")
    except Exception as e:  # noqa: BLE001 - the by-hand figures still stand; the failure is named, not hidden
        log.warning("the measured plan failed (%s: %s): only the by-hand figures below; please report it",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "", exc_info=log.isEnabledFor(10))
        return {**out, "measure_error": f"{type(e).__name__}: {e}"}
    return {**out, **{f"{k}_gib": peaks[k] / GiB for k in PHASES}, "peak_gib": max(peaks[k] for k in PHASES) / GiB,
            **{f"{k}_added_gib": peaks[k + "_added"] / GiB for k in PHASES},
            "total_gib": max(peaks[k] for k in PHASES) / GiB}


@_without_cast_warnings
def plan(cfg, arch_name: str | None = None, prompt_tokens: int | None = None, world: int = 1, cp: int = 1,
         measured: bool = False, device: str = "cuda") -> dict:
    """The per-GPU cost of one iteration of config `cfg` (see the module docstring).

    Args:
        arch_name: an all_architectures() key instead of model.path's config files.
        prompt_tokens: a token policy's prompt length (with its video or image tokens; None: 512), Janus's prompt
            length before its image tokens (None: 48).
        world: data-parallel processes (each samples ceil(B / world) whole groups).
        cp: context-parallel ranks per process (one forward's video tokens split cp ways); world x cp GPUs.
        measured: also run one iteration on fake tensors under a fake process group (mmrl/plan_measure.py) for the
            per-phase peaks (startup_gib ... save_gib, peak_gib; `mmrl plan` does); False: the parts by hand only
            (seconds instead of minutes at real size).
        device: what the run trains on: "cuda" (AdamW's multi-tensor step, torch's default there) or "cpu".
    Returns:
        sizes in bytes / 2**30 (keys ending in _gib), parameter and row counts, TFLOP per iteration.
    """
    _check_layout(cfg, world, cp, folder=arch_name is None)
    arch = _architecture(cfg, arch_name)
    kind = _kind(cfg)
    if kind is None or kind.plan_parts is None:
        raise ConfigError(f"mmrl plan sizes the policy kinds that declare their parts (PolicyKind.plan_parts, "
                          f"mmrl/policy/kinds.py), not model.policy={cfg.model.policy}")
    rows, needs_reference = rows_of(cfg.train, world), build_objective(cfg.algo).needs_reference
    build = import_path(kind.plan_parts)  # the kind's parts: transformer, frozen parts, rollout bytes
    parts = build(cfg, arch, rows, cp, prompt_tokens or kind.plan_prompt_tokens, needs_reference)
    out = {"model": arch_name or cfg.model.path, **_by_hand(cfg, parts, rows, world, cp)}
    return _measured(cfg, parts, out, device) if measured else out


def format_plan(p: dict) -> str:
    g = lambda k: f"{p[k]:.2f} GiB"  # noqa: E731
    n = p.get("names", NAMES)
    forward_only = f" + {p['rows_forward_only_per_iter']} rows fwd" if p.get("rows_forward_only_per_iter") else ""
    loading = f"   peak loading (whole, before sharding) {g('peak_loading_gib')}" if p.get("peak_loading_gib") else ""
    cp_note = f" (1/{p['cp']} of the tokens per GPU)" if p["cp"] > 1 else ""
    replicas = f", replicated {p['gpus'] // p['sharded_over']}x across nodes" if p["parallel"] == "hsdp" else ""
    layout = (f"{p['gpus']} GPU(s): --world {p['world']} x --cp {p['cp']}, train.parallel={p['parallel']}, "
              f"weights / gradients / AdamW / EMA sharded over {p['sharded_over']}{replicas}")
    lines = [f"{p['model']} ({p['class']}{' x 2 experts' if p['experts'] == 2 else ''}, {p['dtype']}"
             f"{', LoRA' if p['lora'] else ', full fine-tuning'}); per GPU on {layout}",
             f"  parameters            {p['params'] / 1e9:.3f} B, trainable {p['trainable_params'] / 1e6:.1f} M",
             f"  frozen weights        {g('weights_frozen_gib')}",
             f"  trained weights fp32  {g('weights_trained_fp32_gib')}   gradients {g('gradients_fp32_gib')}   "
             f"AdamW state {g('adamw_state_fp32_gib')}   EMA {g('ema_fp32_gib')}",
             f"  KL reference copy     {g('kl_reference_copy_gib')}",
             f"  FSDP gathered blocks  {g('fsdp_gathered_blocks_gib')}",
             f"  {n['text']:<22}{g('text_encoders_gib')} ({p['text_encoder_params'] / 1e9:.2f} B), "
             f"prompt-embedding cache {g('text_cache_gib')}",
             f"  {n['vae']:<22}{g('vae_gib')} ({p['vae_params'] / 1e6:.0f} M)",
             f"  rollout storage       {g('rollout_storage_gib')} ({p['rows_per_rank']} rows = {p['groups_per_rank']} "
             f"groups per rank), {n['chain']} {g('sampling_chain_gib')}",
             f"  {n['vae'] + ' decode':<22}{g('vae_decode_transient_gib')} ({p['vae_decode_rows']} rows at once)",
             f"  activations / micro-batch of {p['micro_batch_rows']} rows: {g('activations_per_micro_batch_gib')}, "
             f"with gradient checkpointing {g('activations_per_micro_batch_checkpointed_gib')}"
             f"{cp_note}",
             f"  rank rows / minibatch mean {p['rank_rows_per_minibatch_mean']:.1f}, planned "
             f"{p['rank_rows_per_minibatch_planned']} (exceeded in < 1e-6 of minibatches), most "
             f"{p['rank_rows_per_minibatch_max']}",
             f"  peak sampling         {g('peak_sampling_gib')}   peak training {g('peak_training_gib')}{loading}",
             *([f"  measured per GPU      start-up {g('startup_gib')}   sampling {g('sampling_gib')}   decode "
                f"{g('decode_gib')}   training {g('train_gib')}   save {g('save_gib')}",
                f"                        (fake tensors, world {p['sharded_over']} fake process group, torch MemTracker: "
                f"mmrl/plan_measure.py)"] if "peak_gib" in p else []),
             f"  total (this config)   {g('total_gib')}{'' if 'peak_gib' in p else ' (by hand; measured: mmrl plan)'}",
             f"  TFLOP / iteration     sampling {p['tflop_per_iter_sampling']:.1f} ({p['rows_sampled_per_iter']} rows), "
             f"training {p['tflop_per_iter_training']:.1f} ({p['rows_trained_per_iter']} rows x fwd+bwd"
             f"{forward_only}); per GPU "
             f"{p['tflop_per_gpu_per_iter']:.1f} ({p['rows_sampled_per_rank_per_iter']} rows sampled, "
             f"{p['rows_trained_per_rank_per_iter']} trained per rank)"]
    return "\n".join(lines)
