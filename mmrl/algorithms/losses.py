"""Per-action policy losses and loss aggregation (docs/algorithms.md §2). Registries: POLICY_LOSSES, LOSS_AGG.

Policy loss: `fn(log_prob [n, A], old_log_prob [n, A], advantages [n] | [n, A], cfg) -> (loss [n, A], stats)`.
Aggregation: `fn(loss [n, A], mask [n, A], num_samples, num_actions) -> scalar`, where num_samples /
num_actions are the sizes the loss is normalized by (explicit, so data-parallel layouts cannot change it).
"""

from __future__ import annotations

import torch

from mmrl.registry import Registry

POLICY_LOSSES = Registry("policy loss")
LOSS_AGG = Registry("loss aggregation")


def _per_action(adv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return adv.unsqueeze(-1).expand_as(like) if adv.dim() == 1 else adv


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(log_prob, old_log_prob, advantages, cfg):
    """L = -min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A), r = exp(logp - logp_old) per action.
    eps_hi = cfg.clip_range_high (DAPO clip-higher) or cfg.clip_range."""
    adv = _per_action(advantages, log_prob)
    eps_lo = cfg.clip_range
    eps_hi = cfg.clip_range_high if cfg.clip_range_high is not None else cfg.clip_range
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_lo, 1 + eps_hi) * adv
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        clip_frac = (clipped < unclipped).float()
    return loss, {"ratio": ratio.detach(), "clipped": clip_frac}


@LOSS_AGG.register("seq_mean_token_mean")
def seq_mean_token_mean(loss, mask, num_samples, num_actions):
    """GRPO: mean over each sample's actions, then sum over samples / num_samples."""
    m = mask.to(loss.dtype)
    per_seq = (loss * m).sum(-1) / m.sum(-1).clamp(min=1)
    return per_seq.sum() / num_samples


@LOSS_AGG.register("token_mean")
def token_mean(loss, mask, num_samples, num_actions):
    """DAPO: sum over all actions / num_actions (the total action count of the batch)."""
    return (loss * mask.to(loss.dtype)).sum() / num_actions


@LOSS_AGG.register("seq_sum_norm")
def seq_sum_norm(loss, mask, num_samples, num_actions):
    """Dr.GRPO: sum over all actions / (num_samples * A), A = the padded action length."""
    return (loss * mask.to(loss.dtype)).sum() / (num_samples * loss.shape[-1])
