"""KL-to-reference estimators (docs/algorithms.md §2). Registry: KL_ESTIMATORS.

`fn(cur: PolicyOutput, ref: PolicyOutput) -> kl [n, A]`. An estimator that reads policy statistics declares them
(`fn.reads`: names in PolicyOutput.stats); the config is checked against what the policy provides (its kind's
`provides`, mmrl/policy/kinds.py) at load, and a training pass builds only what the run's components read (one that
declares nothing gets every statistic). The log-prob estimators read none.
"""

from __future__ import annotations

import torch

from mmrl.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def k1(cur, ref):
    """k1 = logp - logp_ref (unbiased, high variance)."""
    return cur.log_prob - ref.log_prob


@KL_ESTIMATORS.register("k2")
def k2(cur, ref):
    """k2 = 0.5 (logp - logp_ref)^2 (Schulman's "Approximating KL divergence"; verl's kl_penalty "mse" / "k2"):
    non-negative, biased, low variance; its gradient is (logp - logp_ref) grad logp, the k1 loss's in expectation."""
    return 0.5 * (cur.log_prob - ref.log_prob).pow(2)


@KL_ESTIMATORS.register("k3")
def k3(cur, ref):
    """k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1 (Schulman's low-variance, non-negative estimator)."""
    d = ref.log_prob - cur.log_prob
    return (torch.expm1(d) - d).clamp(min=0)  # expm1: no cancellation for small d; >= 0 up to rounding


k1.reads = k2.reads = k3.reads = ()  # the log-probs only


@KL_ESTIMATORS.register("flow_mean")
def flow_mean(cur, ref):
    """Closed-form KL between the two Gaussian steps with a shared std: mean_dims((mu - mu_ref)^2) / (2 std^2).

    std is the full step std s*sqrt(-dt) (the exact KL); Flow-GRPO's SD3 code divides by s^2 only (dt dropped),
    which only rescales beta per step. Needs stats "mean" [n, A, *D] and "std" [n, A]."""
    d2 = (cur.stats["mean"] - ref.stats["mean"]).pow(2).flatten(2).mean(-1)  # [n, A]
    return d2 / (2 * cur.stats["std"].pow(2).clamp(min=1e-12))


flow_mean.reads = ("mean", "std")


@KL_ESTIMATORS.register("flow_velocity")
def flow_velocity(cur, ref):
    """KL in velocity space (MixGRPO-Flash, AWM, DiffusionNFT's v-based regularizer): mean_dims((v - v_ref)^2) / 2.
    For two Euler-like steps x + v dt + std z it is the step KL up to the factor dt^2 / std^2, so it does not need
    an SDE step (forward-process objectives, ODE samplers). Needs stats "velocity" [n, A, *D]."""
    return 0.5 * (cur.stats["velocity"].float() - ref.stats["velocity"].float()).pow(2).flatten(2).mean(-1)


flow_velocity.reads = ("velocity",)
