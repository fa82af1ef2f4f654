"""Per-action policy losses and loss aggregation (docs/algorithms.md §2). Registries: POLICY_LOSSES, LOSS_AGG.

Policy loss: `fn(log_prob [n, A], old_log_prob [n, A], advantages [n] | [n, A], knobs) -> (loss [n, A], stats)`, with
`knobs` an instance of the dataclass declared beside it (`fn.knobs`; mmrl/algorithms/knobs.py), built from
algo.objective.kwargs and the algo.* keys it shares with other components.
Aggregation: `fn(loss [n, A], mask [n, A], num_samples, num_actions) -> scalar`, where num_samples /
num_actions are the sizes the loss is normalized by (explicit, so data-parallel layouts cannot change it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmrl.errors import ConfigError
from mmrl.registry import Registry

POLICY_LOSSES = Registry("policy loss")


@dataclass
class LossContext:
    """What a policy loss with `needs_output = True` gets as its fifth argument: the policy's outputs of this pass
    (PolicyOutput: log-probs and statistics such as velocities), the reference policy's on the same actions (when
    the loss sets `needs_reference = True`, or a KL is on; else None), and the rows' group ids [n]; `anchor`: the
    EMA of the trained weights' outputs on the same actions when the loss's knobs ask for them (`anchor = "ema"`,
    beside a KL whose reference is the frozen base), else None."""
    out: Any
    ref: Any
    group_id: torch.Tensor
    anchor: Any = None
LOSS_AGG = Registry("loss aggregation")


def _per_action(adv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return adv.unsqueeze(-1).expand_as(like) if adv.dim() == 1 else adv


@dataclass
class PPOKnobs:
    """PPO's trust region, shared by the ratio-clipped losses: each is an algo.* key (AlgoConfig documents them)."""
    clip_range: float             # algo.clip_range: eps
    clip_range_high: float | None  # algo.clip_range_high: DAPO clip-higher; None = clip_range
    clip_ratio_c: float           # algo.clip_ratio_c: dual-clip bound; 0 = off


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(log_prob, old_log_prob, advantages, knobs: PPOKnobs):
    """L = -min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A), r = exp(logp - logp_old) per action.
    eps_hi = knobs.clip_range_high (DAPO clip-higher) or knobs.clip_range. Dual-clip (Ye et al. 2020, arXiv 1912.09729;
    verl's core_algos.compute_policy_loss, clip_ratio_c): for A < 0 the loss is min(L, -c A), c = knobs.clip_ratio_c
    (0 = off), so a far-off-policy action with r > c and a negative advantage stops pulling (its gradient is 0)."""
    adv = _per_action(advantages, log_prob)
    eps_lo = knobs.clip_range
    eps_hi = knobs.clip_range_high if knobs.clip_range_high is not None else knobs.clip_range
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps_lo, 1 + eps_hi) * adv
    loss = -torch.minimum(unclipped, clipped)                                      # [n, A]
    c = knobs.clip_ratio_c
    if c:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * c), loss)
    with torch.no_grad():
        clip_frac = (clipped < unclipped).float()
    stats = {"ratio": ratio.detach(), "clipped": clip_frac}
    if c:
        stats["dual_clipped"] = ((adv < 0) & (ratio > c)).float()
    return loss, stats


ppo_clip.knobs = PPOKnobs


@LOSS_AGG.register("seq_mean_token_mean")
def seq_mean_token_mean(loss, mask, num_samples, num_actions):
    """GRPO: mean over each sample's actions, then sum over samples / num_samples."""
    m = mask.to(loss.dtype)
    per_seq = (loss * m).sum(-1) / m.sum(-1).clamp(min=1)
    return per_seq.sum() / num_samples


@LOSS_AGG.register("seq_mean_token_sum")
def seq_mean_token_sum(loss, mask, num_samples, num_actions):
    """verl's agg_loss "seq-mean-token-sum": each sample's summed action losses, mean over samples (a long
    completion weighs by its length; no length normalization inside a sample)."""
    return (loss * mask.to(loss.dtype)).sum() / num_samples


@LOSS_AGG.register("token_mean")
def token_mean(loss, mask, num_samples, num_actions):
    """DAPO: sum over all actions / num_actions (the total action count of the batch)."""
    return (loss * mask.to(loss.dtype)).sum() / num_actions


@LOSS_AGG.register("seq_sum_norm")
def seq_sum_norm(loss, mask, num_samples, num_actions):
    """Dr.GRPO: sum over all actions / (num_samples * A), A = the padded action length."""
    return (loss * mask.to(loss.dtype)).sum() / (num_samples * loss.shape[-1])


# ---------------------------------------------------------------------------------- forward-process losses
# These train on the forward (noising) process of a rollout's final samples instead of its sampling steps; the
# flow policy then scores "actions" that are noise levels t of a final sample x0 (docs/algorithms.md §10). Their
# `objective` attribute tells the flow policy which rollout to record; `needs_output` that the loss reads a
# LossContext (the policy's velocities in PolicyOutput.stats, the reference's outputs, group ids) besides the log-probs,
# and `reads` which PolicyOutput.stats it reads (the policy builds only those; a loss that needs the output and
# declares nothing gets them all);
# `needs_reference` that the run keeps a reference; `needs_whole_groups` that a pass must hold whole groups;
# `guidance = "none"` that the loss trains the model's own (unguided) velocity, so sampling and training run without
# classifier-free guidance (sampler.cfg_scale=1, checked at load; evaluation keeps sampler.eval_cfg_scale).


def awm(log_prob, old_log_prob, advantages, knobs: PPOKnobs):
    """Advantage Weighted Matching (AWM, arXiv 2509.25050): the flow-matching loss of each sample weighted by its
    advantage. The forward-process "log-prob" is -l, l = mean_d (v_theta(x_t, t) - (eps - x0))^2, so the policy
    gradient of -A * logp is A * grad l (good samples' matching loss goes down, bad ones' up); the ratio
    exp(l_old - l) is clipped as in PPO (algo.clip_range) to bound each update."""
    return ppo_clip(log_prob, old_log_prob, advantages, knobs)


awm.objective = "forward"
awm.guidance = "none"  # AWM's loss is pretraining's conditional flow matching, weighted
awm.knobs = PPOKnobs
POLICY_LOSSES.register("awm")(awm)


def nft_optimality(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r = clip(A, -c, c) / c / 2 + 1/2 in [0, 1] (c = algo.adv_clip)."""
    return advantages.clamp(-adv_clip, adv_clip) / adv_clip / 2 + 0.5


def _x0_error(d: torch.Tensor) -> torch.Tensor:
    """Adaptive-weighted x0 error of the x0 prediction errors d [n, A, *D]: mean_d d^2 / sg(mean_d |d|) -> [n, A]."""
    d = d.flatten(2)
    return d.pow(2).mean(-1) / d.detach().abs().mean(-1).clamp(min=1e-5)


@dataclass
class NFTKnobs:
    """DiffusionNFT's knobs (arXiv 2509.16117; the reference's default beta = 1)."""
    adv_clip: float               # algo.adv_clip (shared with the advantage estimators): c, A's normalization
    nft_beta: float = 1.0         # how far the implicit policies v+ / v- sit from v_old; > 0

    def __post_init__(self):
        if self.nft_beta <= 0:
            raise ConfigError(f"algo.objective.kwargs.nft_beta must be > 0, got {self.nft_beta}")


def nft(log_prob, old_log_prob, advantages, knobs: NFTKnobs, ctx):
    """DiffusionNFT (arXiv 2509.16117): implicit positive / negative policies around the old (sampling) velocity,

        v+ = (1 - beta) v_old + beta v_theta,   v- = (1 + beta) v_old - beta v_theta,

    each trained to predict x0 from x_t = (1 - t) x0 + t eps (x0_hat = x_t - t v, so x0_hat - x0 = t (eps - x0 - v)):

        L = c [ r l(v+) + (1 - r) l(v-) ] / beta,   l(v) = mean_d (x0_hat - x0)^2 / sg(mean_d |x0_hat - x0|),

    r = nft_optimality(A, c). Good samples (r > 1/2) pull v_theta towards their x0, bad ones push it away. Needs
    ctx.out.stats "velocity", "old_velocity", "target" (eps - x0) [n, A, *D] and "sigma" (t) [n, A]."""
    s, beta, c = ctx.out.stats, knobs.nft_beta, knobs.adv_clip
    r = nft_optimality(_per_action(advantages, log_prob), c)                                 # [n, A]
    v, v_old = s["velocity"].float(), s["old_velocity"].float()
    t = s["sigma"].float().reshape(*s["sigma"].shape, *([1] * (v.dim() - 2)))                 # [n, A, 1...]
    pos = _x0_error(t * (s["target"] - ((1 - beta) * v_old + beta * v)))
    neg = _x0_error(t * (s["target"] - ((1 + beta) * v_old - beta * v)))
    loss = c * (r * pos + (1 - r) * neg) / beta
    return loss, {"ratio": torch.exp(log_prob - old_log_prob).detach(), "nft_r": r.detach(),
                  "nft_positive": pos.detach(), "nft_negative": neg.detach()}


nft.objective = "forward"
nft.guidance = "none"  # DiffusionNFT is CFG-free: it trains, and samples from, the unguided velocity
nft.knobs = NFTKnobs
nft.needs_output = True
nft.reads = ("velocity", "old_velocity", "target", "sigma")
POLICY_LOSSES.register("nft")(nft)
