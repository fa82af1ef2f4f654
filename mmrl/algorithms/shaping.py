"""Reward shaping applied to the overall reward before advantages. Registry: REWARD_SHAPINGS.

`fn(rewards [N], cfg) -> rewards' [N]`.
"""

from __future__ import annotations

import math

import torch

from mmrl.registry import Registry

REWARD_SHAPINGS = Registry("reward shaping")


@REWARD_SHAPINGS.register("none")
def none(rewards, cfg):
    return rewards


@REWARD_SHAPINGS.register("tempsamp")
def tempsamp(rewards, cfg):
    """TempSamp-R1 soft shaping (tau = cfg.shaping_tau, alpha = cfg.shaping_alpha): rewards above tau are
    compressed, f(r) = tau + 0.01 ln(r - tau + 1); rewards below are spread, f(r) = tau - (exp(alpha (tau - r))
    - 1) / (exp(alpha) - 1). Keeps the near-perfect injected answer from dominating its group."""
    tau, alpha = cfg.shaping_tau, cfg.shaping_alpha
    r = rewards.double()
    high = tau + 0.01 * torch.log((r - tau).clamp(min=0) + 1)
    low = tau - (torch.exp(alpha * (tau - r).clamp(min=0)) - 1) / (math.exp(alpha) - 1)
    return torch.where(r >= tau, high, low).to(rewards.dtype)
