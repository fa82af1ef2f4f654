"""Group-relative advantage estimators (ALGORITHMS.md section 2). Registry: ADVANTAGES.

Every estimator: `fn(rewards [N], group_id [N], valid [N] bool, cfg) -> (advantages [N], stats dict)`.
Invalid samples (a reward that raised or returned NaN) take no part in their group's statistics and get
advantage 0 (the trainer also masks them out of the loss).
"""

from __future__ import annotations

import torch

from mmrl.registry import Registry

ADVANTAGES = Registry("advantage estimator")


def group_stats(rewards: torch.Tensor, group_id: torch.Tensor, valid: torch.Tensor):
    """Per-sample group mean, std (population, ddof=0) and valid count, each [N], over valid members only."""
    ids = torch.unique(group_id, return_inverse=True)[1]  # [N] dense 0..K-1
    k = int(ids.max()) + 1 if ids.numel() else 0
    w = valid.to(rewards.dtype)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    cnt = torch.zeros(k, dtype=rewards.dtype).index_add_(0, ids, w)
    mean = torch.zeros(k, dtype=rewards.dtype).index_add_(0, ids, r) / cnt.clamp(min=1)
    var = torch.zeros(k, dtype=rewards.dtype).index_add_(0, ids, w * (r - mean[ids]) ** 2) / cnt.clamp(min=1)
    return mean[ids], var.sqrt()[ids], cnt[ids]


def _normalized(rewards, group_id, valid, cfg, scale: bool):
    rewards = rewards.double()
    mean, std, cnt = group_stats(rewards, group_id, valid)
    adv = rewards - mean
    if scale:
        denom = rewards[valid].std(unbiased=False) if cfg.global_std else std
        adv = adv / (denom + cfg.adv_eps)
    adv = torch.where(valid & (cnt > 1), adv, torch.zeros_like(adv)).clamp(-cfg.adv_clip, cfg.adv_clip)
    ids = torch.unique(group_id, return_inverse=True)[1]
    zero_std = (std < 1e-8) & valid
    per_group_zero = torch.zeros(int(ids.max()) + 1, dtype=torch.bool).index_put_((ids[zero_std],), torch.tensor(True))
    stats = {"adv/zero_std_group_frac": per_group_zero.float().mean().item(),
             "adv/abs_mean": adv[valid].abs().mean().item() if valid.any() else 0.0}
    return adv.float(), stats


@ADVANTAGES.register("grpo")
def grpo(rewards, group_id, valid, cfg):
    """A_i = (r_i - mean_g) / (std_g + eps); std over the whole batch when cfg.global_std; |A| <= cfg.adv_clip."""
    return _normalized(rewards, group_id, valid, cfg, scale=True)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards, group_id, valid, cfg):
    """Dr.GRPO (arXiv 2503.20783): A_i = r_i - mean_g, no std scaling."""
    return _normalized(rewards, group_id, valid, cfg, scale=False)
