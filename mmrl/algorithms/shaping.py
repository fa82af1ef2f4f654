"""Reward shaping applied to the overall reward before advantages. Registry: REWARD_SHAPINGS.

`fn(rewards [N], cfg) -> rewards' [N]`. A shaping with `needs_contrast = True` is also given a contrast rollout's
scores, `fn(rewards, cfg, contrast)` with contrast = (group_id [N], contrast rewards [M], their group_id [M]): G more
samples per prompt under a perturbed input (`mmrl/rollout/contrast.py`; T-GRPO: the video's frames shuffled),
scored and never trained.
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


def temporal_contrast(rewards: torch.Tensor, group_id: torch.Tensor, contrast: torch.Tensor,
                      contrast_group_id: torch.Tensor, alpha: float, mu: float, threshold: float):
    """T-GRPO (Video-R1) temporal reward. Per group: p = share of correct samples (reward >= threshold) on the
    ordered video, p~ = the same share on shuffled frames; when p >= mu * p~ every correct ordered sample gets
    + alpha (the model did better because the order mattered), else nothing. -> (rewards' [N], stats)."""
    correct = (rewards >= threshold).double()
    out = rewards.clone().double()
    bonus_groups = 0
    groups = torch.unique(group_id)
    for g in groups:
        rows, crows = group_id == g, contrast_group_id == g
        p = correct[rows].mean()
        p_shuffled = (contrast[crows] >= threshold).double().mean() if crows.any() else torch.tensor(0.0)
        if p >= mu * p_shuffled and p > 0:
            out[rows] += alpha * correct[rows]
            bonus_groups += 1
    return out.to(rewards.dtype), {"tgrpo/bonus_group_frac": bonus_groups / max(len(groups), 1),
                                   "tgrpo/correct_ordered": float(correct.mean()),
                                   "tgrpo/correct_shuffled": float((contrast >= threshold).double().mean())}


@REWARD_SHAPINGS.register("tgrpo")
def tgrpo(rewards, cfg, contrast):
    """T-GRPO: `temporal_contrast` with algo.tgrpo_alpha, algo.tgrpo_mu and algo.tgrpo_threshold."""
    shaped, _ = temporal_contrast(rewards, *contrast, cfg.tgrpo_alpha, cfg.tgrpo_mu, cfg.tgrpo_threshold)
    return shaped


tgrpo.needs_contrast = True
