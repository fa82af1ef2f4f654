"""The objective: what a training pass minimizes, composed of terms; the trainer runs it without knowing any by name.

    loss [n, A] = terms applied in order to the pass's `Batch`:
        policy loss (algo.objective.name: ppo_clip, awm, nft, dgpo, dpo, flow_dppo, ... or a user's own)
      + kl_coef KL(pi || pi_ref)                       (algo.kl_coef > 0; KL_ESTIMATORS)
      x weights                                        (algo.weighting: tempflow, guard_dt, ...; WEIGHTINGS)
      x min(pi_old / pi_engine, C)                     (algo.objective.tis_cap > 0; truncated importance sampling)
      - sft_coef log pi(injected rows' actions)        (algo.objective.sft_coef > 0; the supervised anchor)
    scalar = LOSS_AGG[algo.loss_agg](loss, mask, num_samples, num_actions)

Each term declares what it needs (`needs_reference`: the reference policy's outputs on the same actions;
`needs_whole_groups`: a pass holds whole groups; `actions`: which actions it trains on, "transitions" (sampling
steps, tokens) or "forward" (noise levels of the final samples; the flow policy then records those); `reads`: the
PolicyOutput.stats it reads, so that a training pass builds only those) and returns
its per-action loss and named statistics ([n, A] tensors averaged over the pass's actions, or (values, mask) pairs
averaged over mask). The policy loss is named once, with its own knobs:

    algo:
      objective: {name: dgpo, kwargs: {dgpo_beta: 50.0}}

whose kwargs are fields of the dataclass the loss declares beside it (`fn.knobs = DGPOKnobs`; unset ones keep its
defaults; checked at load, mmrl/algorithms/knobs.py); the knobs several components read (clip_range,
clip_range_high, clip_ratio_c, adv_clip) are algo.* keys. docs/algorithms.md gives each term's formula;
docs/extending.md a user's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from mmrl.algorithms.kl import KL_ESTIMATORS
from mmrl.algorithms.knobs import build_knobs
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
    anchor: Any = None           # PolicyOutput of the EMA weights on the same actions (when needs_ema_anchor)


@dataclass
class PolicyLoss:
    """The main term: fn(log_prob, old_log_prob, advantages, knobs[, LossContext]) -> (loss [n, A], stats)."""
    fn: Callable
    knobs: Any  # an instance of fn.knobs (the loss's dataclass: NFTKnobs, PPOKnobs ...), or None

    @property
    def needs_reference(self) -> bool:  # a loss anchored at the EMA instead reads Batch.anchor
        return getattr(self.fn, "needs_reference", False) and not self.needs_ema_anchor

    @property
    def needs_whole_groups(self) -> bool:
        return getattr(self.fn, "needs_whole_groups", False)

    @property
    def actions(self) -> str:
        return getattr(self.fn, "objective", "transitions")

    @property
    def needs_ema_anchor(self) -> bool:  # the loss anchors at the EMA weights while the KL's reference may be the base
        return getattr(self.knobs, "anchor", "reference") == "ema"

    @property
    def reads(self) -> tuple[str, ...] | None:
        return getattr(self.fn, "reads", None if getattr(self.fn, "needs_output", False) else ())

    def __call__(self, loss, b: Batch):
        ctx = (LossContext(b.out, b.ref, b.group_id, b.anchor),) if getattr(self.fn, "needs_output", False) else ()
        return self.fn(b.log_prob, b.old_log_prob, b.advantages, self.knobs, *ctx)


@dataclass
class KLPenalty:
    """+ coef KL(pi || pi_ref) per action (KL_ESTIMATORS[estimator](out, ref) -> [n, A])."""
    estimator: str
    coef: float
    needs_reference = True

    @property
    def reads(self) -> tuple[str, ...] | None:  # an estimator that declares nothing may read anything
        return getattr(KL_ESTIMATORS[self.estimator], "reads", None)

    def __call__(self, loss, b: Batch):
        kl = KL_ESTIMATORS[self.estimator](b.out, b.ref)
        return loss + self.coef * kl, {"kl": kl.detach()}


@dataclass
class Weighting:
    """x WEIGHTINGS[name](rows, out) per action (TempFlow-GRPO's noise-level weights, GRPO-Guard's dt, ...); a
    weighting with knobs (`fn.knobs`, filled from its algo.* keys) is called fn(rows, out, knobs)."""
    name: str
    knobs: Any = None

    @property
    def reads(self) -> tuple[str, ...] | None:  # a weighting that declares nothing may read anything
        return getattr(WEIGHTINGS[self.name], "reads", None)

    def __call__(self, loss, b: Batch):
        fn = WEIGHTINGS[self.name]
        return loss * (fn(b.rows, b.out) if self.knobs is None else fn(b.rows, b.out, self.knobs)), {}


@dataclass
class TruncatedIS:
    """x min(pi_old / pi_engine, cap): the sampling engine drew from its own distribution (vLLM, bf16 decoding)."""
    cap: float
    reads = ()

    def __call__(self, loss, b: Batch):
        if "rollout_log_prob" not in b.rows.extras:
            raise ConfigError(f"algo.objective.tis_cap={self.cap}: this policy's sampling engine records no log-probs "
                              f"of its own (rollout.extras['rollout_log_prob']); use sampler.engine=prefix_cache or "
                              f"vllm, or set algo.objective.tis_cap=0")
        w, truncated = truncated_is(b.old_log_prob, b.rows.extras["rollout_log_prob"].to(loss.device), self.cap)
        return loss * w, {"tis_weight": w, "tis_truncated": truncated}


@dataclass
class SupervisedAnchor:
    """- coef log pi of the injected (off-policy, e.g. ground-truth) rows' actions: their NLL, logged as sft_nll."""
    coef: float
    reads = ()

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
    def needs_ema_anchor(self) -> bool:
        return any(getattr(t, "needs_ema_anchor", False) for t in self.terms)

    @property
    def actions(self) -> str:
        return self.terms[0].actions

    @property
    def reads(self) -> frozenset[str] | None:
        """The PolicyOutput.stats its terms and ratio transform read (their `reads`; a policy builds only these), or
        None (all) when one of them declares nothing (a loss that reads the output, a user's KL estimator,
        weighting or ratio transform)."""
        ratio = getattr(RATIO_TRANSFORMS[self.ratio], "reads", None)
        if ratio is None:
            return None
        names = set(ratio)
        for t in self.terms:
            r = t.reads
            if r is None:
                return None
            names |= set(r)
        return frozenset(names)

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


def build_objective(algo) -> Objective:
    """The objective of config section `algo` (mmrl.config.AlgoConfig); ConfigError for kwargs its loss lacks."""
    o = algo.objective
    fn = POLICY_LOSSES[o.name]
    terms = [PolicyLoss(fn, build_knobs(fn, o.name, o.kwargs, "algo.objective", algo))]
    if algo.kl_coef > 0:
        terms.append(KLPenalty(algo.kl, algo.kl_coef))
    terms += [Weighting(name, build_knobs(WEIGHTINGS[name], name, None, "algo.weighting", algo))
              for name in algo.weighting.split("+") if name != "none"]
    if o.tis_cap:
        terms.append(TruncatedIS(o.tis_cap))
    if o.sft_coef > 0:
        terms.append(SupervisedAnchor(o.sft_coef))
    return Objective(terms, algo.ratio, algo.loss_agg)
