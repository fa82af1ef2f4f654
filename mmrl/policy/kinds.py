"""The built-in policy kinds, each declared once: the kind-specific config keys it reads, what it reports per action,
and what it can do. Code outside mmrl/policy asks a kind's declaration (`kind_of(cfg.model.policy).denoises`), never
its name; mmrl.compose checks a config against the declaration of its kind at load and writes the errors from it.
A user's own policy (model.policy=package.module:build) has no declaration (kind_of gives None): it reads what it
reads, and nothing is checked for it. Adding a kind: a builder in POLICIES and a PolicyKind here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyKind:
    name: str                                  # model.policy
    reads: dict[str, tuple[str, ...]]          # {section: keys} of the kind-specific keys it reads (another kind's
                                               # keys, set away from their defaults, are refused at load)
    provides: dict[str, tuple[str, ...]]       # per-action statistics (PolicyOutput.stats, rollout extras) by the
                                               # objective's actions: "transitions" (steps, tokens) | "forward"
    denoises: bool = False                     # actions are a flow transformer's denoising steps: SDE samplers, trees,
                                               # per-step branching, context parallelism, train.micro_batch=auto, and a
                                               # sample's actions split across micro-batches
    decodes: bool = False                      # samples tokens with a rollout engine (sampler.engine): lockstep
                                               # decoding under FSDP needs prefix_cache; tis_cap corrects its log-probs
    adv_std: str = "population"                # the group std algo.adv_std=auto resolves to (population: flow_grpo;
                                               # sample: verl, TRL)
    model_folder: str = "config.json (a transformers model)"  # what model.path must hold (in errors)
    export: str = "mmrl.export:export_transformers"  # `mmrl export`'s writer (checkpoint, meta, out), import path
    shards_reference: bool = False             # parallelize shards a full-fine-tuning reference copy with the model
    plan_parts: str | None = None              # `mmrl plan`'s parts builder (cfg, arch, rows, cp=, prompt_tokens=,
                                               # needs_reference=) -> Parts, import path; None: not plannable
    plan_prompt_tokens: int = 0                # `mmrl plan`'s default prompt length (0: the prompt is not tokens)


FLOW_KEYS = {"sampler": ("kind", "num_steps", "noise_level", "cfg_scale", "shift", "sde_window_size",
                         "sde_window_range", "logprob_reduce", "shared_noise", "eval_steps", "eval_cfg_scale", "cfg_grad",
                         "window_schedule", "window_shift_every", "ode_solver", "ode_stride", "forward_timesteps",
                         "forward_t_range", "branch_children"),
             "model": ("sample_size", "num_frames", "guidance", "text_cache", "offload", "text_max_length")}

KINDS = {k.name: k for k in (
    PolicyKind("flow", FLOW_KEYS, denoises=True, model_folder="model_index.json (a diffusers pipeline)",
               export="mmrl.export:export_diffusers", shards_reference=True, plan_parts="mmrl.plan:flow_parts",
               provides={"transitions": ("mean", "std", "velocity", "ratio_bias", "schedule_std_mean", "sigma_next"),
                         "forward": ("velocity", "old_velocity", "target", "sigma")}),
    PolicyKind("token", {"sampler": ("temperature", "top_p", "max_new_tokens", "engine", "vllm"),
                         "model": ("shared_prefix", "freeze_vision")},
               provides={"transitions": ("entropy",)}, decodes=True, adv_std="sample", plan_parts="mmrl.plan:token_parts",
               plan_prompt_tokens=512),
    # Janus-Pro: image tokens as actions, sampled by its own CFG loop (docs/token-policies.md); an image has the
    # model's token count, so it reads no length or engine keys
    PolicyKind("janus", {"sampler": ("cfg_scale", "eval_cfg_scale", "cfg_grad", "temperature")},
               provides={"transitions": ("entropy",)}, shards_reference=True, plan_parts="mmrl.plan:janus_parts",
               plan_prompt_tokens=48),
)}


def kind_of(policy: str) -> PolicyKind | None:
    """The declaration of model.policy=`policy`; None for a user's own policy."""
    return KINDS.get(policy)


def kind_keys() -> dict[str, dict[str, tuple[str, ...]]]:
    """{section: {key: the kinds that read it}} over every declared kind's kind-specific keys."""
    out: dict = {}
    for k in KINDS.values():
        for section, keys in k.reads.items():
            for key in keys:
                out.setdefault(section, {}).setdefault(key, []).append(k.name)
    return {s: {key: tuple(v) for key, v in keys.items()} for s, keys in out.items()}
