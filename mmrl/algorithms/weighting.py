"""Per-action weights multiplying the per-action loss. Registry: WEIGHTINGS.

`fn(rollout_minibatch, out: PolicyOutput) -> weights [n, A]` (or [A]); "none" returns 1. A weighting with knobs
(`fn.knobs`, a dataclass whose fields are algo.* keys) is called `fn(rollout, out, knobs)`.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class TempFlowKnobs:
    tempflow_constant: float | None  # algo.tempflow_constant: None = the schedule's mean std, else c in w_t = c std_t


@WEIGHTINGS.register("tempflow")
def tempflow(rollout, out, knobs: TempFlowKnobs):
    """TempFlow-GRPO noise-aware weights (arXiv 2508.04324; docs/algorithms.md §4), std_t = s_t * sqrt(-dt_t):
    w_t = std_t / mean_t'(std_t') with the mean over the schedule's trainable steps (from the flow policy, so a
    one-step window or a branch point is weighted too), or, with algo.tempflow_constant = c, the official code's
    w_t = c * std_t (c = 2.25 for SD3 at 10 steps, 1.73 for FLUX: 1 / that mean at those schedules). The per-step
    gradient scale goes as 1 / std_t, so unweighted GRPO is dominated by late low-noise steps. Flow policies."""
    std = out.stats["std"].float()                                                       # [n, A]
    if knobs.tempflow_constant is not None:
        return knobs.tempflow_constant * std
    return std / out.stats["schedule_std_mean"].to(std.device).clamp(min=1e-12)


tempflow.reads = ("std", "schedule_std_mean")
tempflow.knobs = TempFlowKnobs
