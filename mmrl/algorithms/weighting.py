"""Per-action weights multiplying the per-action loss. Registry: WEIGHTINGS.

`fn(rollout_minibatch, out: PolicyOutput) -> weights [n, A]` (or [A]); "none" returns 1.
"""

from __future__ import annotations

import torch

from mmrl.registry import Registry

WEIGHTINGS = Registry("action weighting")


@WEIGHTINGS.register("none")
def none(rollout, out):
    return torch.ones_like(out.log_prob)


none.reads = ()


def truncated_is(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float):
    """Truncated importance sampling for a sampling engine whose log-probs differ from the trainer's (Yao et al.
    2025, "Your efficient RL framework secretly brings you off-policy RL training"; docs/algorithms.md):
    w = min(exp(old_log_prob - rollout_log_prob), cap), with old_log_prob the trainer's under the rollout's weights
    and rollout_log_prob the engine's for the token it sampled. Actions without an engine log-prob (NaN: injected
    rows, padding) get w = 1. Returns (w, truncated) [n, A], both without gradient."""
    known = torch.isfinite(rollout_log_prob)
    raw = torch.exp(old_log_prob.detach() - torch.where(known, rollout_log_prob, old_log_prob.detach()))
    return raw.clamp(max=cap), known & (raw > cap)


@WEIGHTINGS.register("guard_dt")
def guard_dt(rollout, out):
    """GRPO-Guard gradient reweighting: step t's loss times 1 / (-dt_t) (Flow-GRPO form), which evens out the
    contributions of noise levels (docs/algorithms.md §5). Flow policies."""
    minus_dt = (rollout.extras["sigma"] - rollout.extras["sigma_next"]).float()        # [n, A], > 0
    return (1.0 / minus_dt).to(out.log_prob.device)


guard_dt.reads = ("sigma_next",)  # an SDE step's interval (the flow policy's transitions)


@WEIGHTINGS.register("tempflow")
def tempflow(rollout, out):
    """TempFlow-GRPO noise-aware weights (arXiv 2508.04324; docs/algorithms.md §4): w_t = std_t / mean_t'(std_t') with
    std_t = s_t * sqrt(-dt_t) and the mean over the schedule's trainable steps (from the flow policy, so a
    one-step window or a branch point is weighted too). The per-step gradient scale goes as 1 / std_t, so
    unweighted GRPO is dominated by late low-noise steps. Flow policies."""
    std = out.stats["std"].float()                                                       # [n, A]
    return std / out.stats["schedule_std_mean"].to(std.device).clamp(min=1e-12)


tempflow.reads = ("std", "schedule_std_mean")
