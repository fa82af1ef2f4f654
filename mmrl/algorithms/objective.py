"""The objective: what a training pass minimizes, composed of terms; the trainer runs it without knowing any by name.

    loss [n, A] = terms applied in order to the pass's `Batch`:
        policy loss (POLICY_LOSSES: ppo_clip, awm, nft, dgpo, dpo, flow_dppo, or a user's own)
      + kl_coef KL(pi || pi_ref)                       (algo.kl_coef > 0; KL_ESTIMATORS)
      x weights                                        (algo.weighting: tempflow, guard_dt, ...; WEIGHTINGS)
      x min(pi_old / pi_engine, C)                     (algo.tis_cap > 0; truncated importance sampling)
      - sft_coef log pi(injected rows' actions)        (algo.sft_coef > 0; the supervised anchor)
    scalar = LOSS_AGG[algo.loss_agg](loss, mask, num_samples, num_actions)

Each term declares what it needs (`needs_reference`: the reference policy's outputs on the same actions;
`needs_whole_groups`: a pass holds whole groups; `actions`: which actions it trains on, "transitions" (sampling
steps, tokens) or "forward" (noise levels of the final samples; the flow policy then records those)) and returns
its per-action loss and named statistics ([n, A] tensors averaged over the pass's actions, or (values, mask) pairs
averaged over mask). The policy loss is chosen by `algo.policy_loss`, or with its own knobs by the sub-config

    algo:
      objective: {name: dgpo, kwargs: {dgpo_beta: 50.0, clip_range: 0.01}}

whose kwargs are the knobs the loss declares (`fn.knobs`, validated at load like a reward's kwargs; the ones not
given keep their algo.* values). docs/algorithms.md gives each term's formula; docs/extending.md a user's own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import torch

from mmrl.algorithms.kl import KL_ESTIMATORS
from mmrl.algorithms.losses import LOSS_AGG, POLICY_LOSSES, LossContext
from mmrl.algorithms.ratio import RATIO_TRANSFORMS
from mmrl.algorithms.weighting import WEIGHTINGS, truncated_is
from mmrl.errors import ConfigError


@dataclass
class Batch:
    """The typed inputs of one training pass (n rows, A actions each), on the policy's device."""
    log_prob: torch.Tensor       # [n, A] the current policy's, after the ratio transform (GSPO: sequence-level)
    old_log_prob: torch.Tensor   # [n, A] the sampling weights'
    advantages: torch.Tensor     # [n] or [n, A]
    group_id: torch.Tensor       # [n]
    part: torch.Tensor           # [n, A] bool: the actions this pass trains
    rows: Any                    # the Rollout of these rows (extras, is_offpolicy, action_mask)
    out: Any                     # PolicyOutput of this pass (log-probs with gradients, stats: velocities ...)
    ref: Any = None              # PolicyOutput of the reference on the same actions (when a term needs it)


@dataclass
class PolicyLoss:
    """The main term: fn(log_prob, old_log_prob, advantages, knobs[, LossContext]) -> (loss [n, A], stats)."""
    fn: Callable
    knobs: Any  # a namespace of the loss's parameters (clip_range, nft_beta, ...)

    @property
    def needs_reference(self) -> bool:
        return getattr(self.fn, "needs_reference", False)

    @property
    def needs_whole_groups(self) -> bool:
        return getattr(self.fn, "needs_whole_groups", False)

    @property
    def actions(self) -> str:
        return getattr(self.fn, "objective", "transitions")

    def __call__(self, loss, b: Batch):
        ctx = (LossContext(b.out, b.ref, b.group_id),) if getattr(self.fn, "needs_output", False) else ()
        return self.fn(b.log_prob, b.old_log_prob, b.advantages, self.knobs, *ctx)


@dataclass
class KLPenalty:
    """+ coef KL(pi || pi_ref) per action (KL_ESTIMATORS[estimator](out, ref) -> [n, A])."""
    estimator: str
    coef: float
    needs_reference = True

    def __call__(self, loss, b: Batch):
        kl = KL_ESTIMATORS[self.estimator](b.out, b.ref)
        return loss + self.coef * kl, {"kl": kl.detach()}


@dataclass
class Weighting:
    """x WEIGHTINGS[name](rows, out) per action (TempFlow-GRPO's noise-level weights, GRPO-Guard's dt, ...)."""
    name: str

    def __call__(self, loss, b: Batch):
        return loss * WEIGHTINGS[self.name](b.rows, b.out), {}


@dataclass
class TruncatedIS:
    """x min(pi_old / pi_engine, cap): the sampling engine drew from its own distribution (vLLM, bf16 decoding)."""
    cap: float

    def __call__(self, loss, b: Batch):
        if "rollout_log_prob" not in b.rows.extras:
            raise ConfigError(f"algo.tis_cap={self.cap}: this policy's sampling engine records no log-probs of its "
                              f"own (rollout.extras['rollout_log_prob']); use sampler.engine=prefix_cache or vllm, "
                              f"or set algo.tis_cap=0")
        w, truncated = truncated_is(b.old_log_prob, b.rows.extras["rollout_log_prob"].to(loss.device), self.cap)
        return loss * w, {"tis_weight": w, "tis_truncated": truncated}


@dataclass
class SupervisedAnchor:
    """- coef log pi of the injected (off-policy, e.g. ground-truth) rows' actions: their NLL, logged as sft_nll."""
    coef: float

    def __call__(self, loss, b: Batch):
        inj = b.rows.is_offpolicy[:, None] & b.part  # [n, A]
        return loss - self.coef * b.out.log_prob * inj, {"sft_nll": (-b.out.log_prob.detach(), inj)}


@dataclass
class Objective:
    terms: list                  # applied in order, the first one to None
    ratio: str = "none"          # RATIO_TRANSFORMS key applied to the log-probs first
    loss_agg: str = "seq_mean_token_mean"

    @property
    def needs_reference(self) -> bool:
        return any(getattr(t, "needs_reference", False) for t in self.terms)

    @property
    def needs_whole_groups(self) -> bool:
        return any(getattr(t, "needs_whole_groups", False) for t in self.terms)

    @property
    def actions(self) -> str:
        return self.terms[0].actions

    def per_action(self, b: Batch) -> tuple[torch.Tensor, dict]:
        """(loss [n, A], statistics) of the pass."""
        b.log_prob = RATIO_TRANSFORMS[self.ratio](b.out.log_prob, b.old_log_prob, b.rows, b.out)
        loss, stats = None, {}
        for term in self.terms:
            loss, s = term(loss, b)
            stats.update(s)
        return loss, stats

    def aggregate(self, loss: torch.Tensor, mask: torch.Tensor, num_samples: int, num_actions: int) -> torch.Tensor:
        return LOSS_AGG[self.loss_agg](loss, mask, num_samples, num_actions)


def loss_name(algo) -> str:
    """The policy loss a config trains with: algo.objective.name, else algo.policy_loss."""
    return algo.objective.name or algo.policy_loss


def build_objective(algo) -> Objective:
    """The objective of config section `algo` (mmrl.config.AlgoConfig)."""
    fn = POLICY_LOSSES[loss_name(algo)]
    knobs = SimpleNamespace(**{f.name: getattr(algo, f.name) for f in dataclasses.fields(algo)})
    for key, value in (algo.objective.kwargs or {}).items():  # the sub-config's knobs (checked by check_knobs)
        setattr(knobs, key, value)
    terms = [PolicyLoss(fn, knobs)]
    if algo.kl_coef > 0:
        terms.append(KLPenalty(algo.kl, algo.kl_coef))
    terms += [Weighting(name) for name in algo.weighting.split("+") if name != "none"]
    if algo.tis_cap:
        terms.append(TruncatedIS(algo.tis_cap))
    if algo.sft_coef > 0:
        terms.append(SupervisedAnchor(algo.sft_coef))
    return Objective(terms, algo.ratio, algo.loss_agg)


def check_knobs(algo) -> None:
    """algo.objective.kwargs must be knobs its loss declares (`fn.knobs`); ValueError naming the valid ones."""
    kwargs = algo.objective.kwargs or {}
    if algo.objective.name and algo.policy_loss not in ("ppo_clip", algo.objective.name):
        raise ConfigError(f"algo.objective.name={algo.objective.name} and algo.policy_loss={algo.policy_loss} name "
                          f"two losses: set one (a base config may set the other)")
    if kwargs and not algo.objective.name:
        raise ConfigError("algo.objective.kwargs without algo.objective.name: name the objective they belong to")
    if not kwargs:
        return
    knobs = getattr(POLICY_LOSSES[algo.objective.name], "knobs", ())
    unknown = sorted(set(kwargs) - set(knobs))
    if unknown:
        raise ConfigError(f"algo.objective.kwargs: {unknown} are not knobs of objective {algo.objective.name!r}; "
                          f"its knobs: {sorted(knobs) or 'none'}")
    default = type(algo)()
    twice = [k for k in kwargs if hasattr(algo, k) and getattr(algo, k) != getattr(default, k)
             and getattr(algo, k) != kwargs[k]]
    if twice:  # e.g. a base config's objective kwargs and an algo.<knob>=... override
        raise ConfigError(f"{', '.join(f'algo.{k}={getattr(algo, k)!r}' for k in twice)} and algo.objective.kwargs "
                          f"{ {k: kwargs[k] for k in twice} } set the same knob twice: set it in algo.objective.kwargs")
