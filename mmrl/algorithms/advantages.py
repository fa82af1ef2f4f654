"""Group-relative advantage estimators (docs/algorithms.md §2). Registry: ADVANTAGES.

Every estimator: `fn(rewards [N], group_id [N], valid [N] bool, cfg) -> (advantages [N], stats dict)`.
Invalid samples (a reward that raised or returned NaN) take no part in their group's statistics and get
advantage 0 (the trainer also masks them out of the loss).
"""

from __future__ import annotations

import torch

from mmrl.errors import ConfigError
from mmrl.registry import Registry

ADVANTAGES = Registry("advantage estimator")


# The group std and the epsilon added to it, as each reference computes them (docs/algorithms.md §2):
#   population: ddof 0, + 1e-4 -- flow_grpo's PerPromptStatTracker.update (np.std(...) + 1e-4)
#   sample:     ddof 1, + 1e-6 -- verl's core_algos.compute_grpo_outcome_advantage (torch.std, epsilon=1e-6)
# At G = 4 the two differ by sqrt(G / (G - 1)) = 1.155. algo.adv_std=auto is resolved at load from model.policy
# (flow: population, token: sample; Config.validate); an AlgoConfig used on its own keeps "auto" = population.
STD_KINDS = {"population": (0, 1e-4), "sample": (1, 1e-6)}  # name -> (ddof, reference epsilon)


def std_kind(a) -> tuple[int, float]:
    """(ddof, eps) of algo.adv_std and algo.adv_eps (None = the chosen std's reference epsilon)."""
    kind = "population" if a.adv_std == "auto" else a.adv_std
    if kind not in STD_KINDS:
        raise ConfigError(f"algo.adv_std={a.adv_std!r}: use population (flow_grpo), sample (verl, TRL) or auto")
    ddof, eps = STD_KINDS[kind]
    return ddof, eps if a.adv_eps is None else a.adv_eps


def group_stats(rewards: torch.Tensor, group_id: torch.Tensor, valid: torch.Tensor, ddof: int = 0):
    """Per-sample group mean, std (ddof 0: population, 1: sample) and valid count, each [N], over valid members."""
    ids = torch.unique(group_id, return_inverse=True)[1]  # [N] dense 0..K-1
    k = int(ids.max()) + 1 if ids.numel() else 0
    w = valid.to(rewards.dtype)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    cnt = torch.zeros(k, dtype=rewards.dtype).index_add_(0, ids, w)
    mean = torch.zeros(k, dtype=rewards.dtype).index_add_(0, ids, r) / cnt.clamp(min=1)
    sq = torch.zeros(k, dtype=rewards.dtype).index_add_(0, ids, w * (r - mean[ids]) ** 2)  # [K] sums of squares
    var = sq / (cnt - ddof).clamp(min=1)  # a group of one has sum 0 (and gets advantage 0 below)
    return mean[ids], var.sqrt()[ids], cnt[ids]


def _normalized(rewards, group_id, valid, cfg, scale: bool):
    rewards = rewards.double()
    ddof, eps = std_kind(cfg)
    mean, std, cnt = group_stats(rewards, group_id, valid, ddof)
    adv = rewards - mean
    if scale:
        denom = rewards[valid].std(correction=ddof) if cfg.global_std else std
        adv = adv / (denom + eps)
    adv = torch.where(valid & (cnt > 1), adv, torch.zeros_like(adv)).clamp(-cfg.adv_clip, cfg.adv_clip)
    ids = torch.unique(group_id, return_inverse=True)[1]
    zero_std = (std < 1e-8) & valid
    per_group_zero = torch.zeros(int(ids.max()) + 1, dtype=torch.bool).index_put_((ids[zero_std],), torch.tensor(True))
    stats = {"adv/zero_std_group_frac": per_group_zero.float().mean().item(),
             "adv/abs_mean": adv[valid].abs().mean().item() if valid.any() else 0.0}
    return adv.float(), stats


@ADVANTAGES.register("grpo")
def grpo(rewards, group_id, valid, cfg):
    """A_i = (r_i - mean_g) / (std_g + eps), std_g population or sample (algo.adv_std, STD_KINDS); std over the whole
    batch when cfg.global_std; |A| <= cfg.adv_clip."""
    return _normalized(rewards, group_id, valid, cfg, scale=True)


@ADVANTAGES.register("dr_grpo")
def dr_grpo(rewards, group_id, valid, cfg):
    """Dr.GRPO (arXiv 2503.20783): A_i = r_i - mean_g, no std scaling."""
    return _normalized(rewards, group_id, valid, cfg, scale=False)


# ------------------------------------------------------------------ several rewards (docs/algorithms.md §2)
REWARD_AGGREGATIONS = Registry("reward aggregation")


def component(rewards: dict, key: str) -> torch.Tensor:
    """A weighted component's rewards [N]. The joins of chunks, rounds and ranks keep every key any part has
    (mmrl.rollout.collect.join_rewards, Distributed.gather_rows), so a key is absent only when every sample's
    reward failed (all rows invalid): zeros then."""
    return rewards[key] if key in rewards else torch.zeros_like(rewards["overall"])


@REWARD_AGGREGATIONS.register("sum")
def weighted_sum(rewards: dict, weights: dict | None, group_id, valid, cfg, estimator):
    """Reward-level aggregation: the weighted sum rewards["overall"] goes through the estimator once."""
    return estimator(rewards["overall"], group_id, valid, cfg)


def _component_advantages(name: str, rewards: dict, weights: dict | None, group_id, valid, cfg, estimator):
    """(S = sum_k w_k A_k [N] float64, stats): each weighted component r_k through the estimator within its groups
    (z-scores for grpo), with each component's zero-std fraction."""
    if not weights:
        raise ConfigError(f"algo.reward_aggregation={name} needs several weighted rewards: set reward.name=multi")
    total = torch.zeros_like(rewards["overall"], dtype=torch.float64)
    stats = {}
    for k, w in weights.items():
        a_k, s_k = estimator(component(rewards, k), group_id, valid, cfg)
        total += w * a_k.double()
        stats[f"adv/{k}/zero_std_group_frac"] = s_k["adv/zero_std_group_frac"]
    return total, stats


def _clipped(adv, stats: dict, rewards: dict, group_id, valid, cfg, estimator):
    """adv [N] with invalid samples at 0 and |A| <= cfg.adv_clip, and the stats every aggregation logs."""
    adv = torch.where(valid, adv, torch.zeros_like(adv)).clamp(-cfg.adv_clip, cfg.adv_clip)
    stats["adv/abs_mean"] = adv[valid].abs().mean().item() if valid.any() else 0.0
    stats["adv/zero_std_group_frac"] = estimator(rewards["overall"], group_id, valid, cfg)[1]["adv/zero_std_group_frac"]
    return adv.float(), stats


@REWARD_AGGREGATIONS.register("gdpo")
def gdpo(rewards: dict, weights: dict | None, group_id, valid, cfg, estimator):
    """GDPO decoupled normalization: each component r_k through the estimator within its groups (z-scores for
    grpo), S = sum_k w_k * A_k, then S z-scored over the valid samples of the batch; |A| <= cfg.adv_clip."""
    total, stats = _component_advantages("gdpo", rewards, weights, group_id, valid, cfg, estimator)
    v = total[valid]
    mean, std = (v.mean(), v.std(unbiased=False)) if v.numel() else (0.0, 1.0)
    return _clipped((total - mean) / (std + std_kind(cfg)[1]), stats, rewards, group_id, valid, cfg, estimator)


@REWARD_AGGREGATIONS.register("per_reward")
def per_reward(rewards: dict, weights: dict | None, group_id, valid, cfg, estimator):
    """Pref-GRPO's multi-reward advantage (CodeGoat24/Pref-GRPO, fastvideo/rewards/dispatcher.py,
    compute_weighted_advantages with use_group and without apply_gdpo): each component r_k through the estimator
    within its groups (z-scores for grpo), A = sum_k w_k A_k, no further normalization; |A| <= cfg.adv_clip. The
    reference's z-scores use the sample std + 1e-8 (algo.adv_std=sample, algo.adv_eps=1e-8)."""
    total, stats = _component_advantages("per_reward", rewards, weights, group_id, valid, cfg, estimator)
    return _clipped(total, stats, rewards, group_id, valid, cfg, estimator)


@REWARD_AGGREGATIONS.register("batch")
def batch_normalized(rewards: dict, weights: dict | None, group_id, valid, cfg, estimator):
    """Each component z-scored over the valid samples of the batch (every group, every rank: the trainer
    gathers the rows first), S = sum_k w_k * z_k, then S through the estimator within its groups. The
    components' scales no longer decide their share (a reward in [0, 100] does not drown one in [0, 1]) while
    the groups still compare their own samples."""
    if not weights:
        raise ConfigError("algo.reward_aggregation=batch needs several weighted rewards: set reward.name=multi")
    total = torch.zeros_like(rewards["overall"], dtype=torch.float64)
    for k, w in weights.items():
        r = component(rewards, k).double()
        v = r[valid]
        mean, std = (v.mean(), v.std(unbiased=False)) if v.numel() else (0.0, 1.0)
        total += w * (r - mean) / (std + std_kind(cfg)[1])
    return estimator(torch.where(valid, total, torch.zeros_like(total)).float(), group_id, valid, cfg)


# ------------------------------------------------------------------ credit assignment: advantages per action
# A rule `(rewards {key: [N]} with "overall" already shaped, weights, rollout, valid [N], cfg, iteration)
# -> (advantages [N] or [N, A], stats)`. `group`: one advantage per sample from its group (every trained
# action of the sample gets it). `tree`: BranchGRPO's per-transition advantages of tree rollouts. `step_branch`:
# TempFlow-GRPO's per-step branching, a child's group is its prompt's children at its branch step. A rule that reads
# per-action rollout extras names them in `fn.reads_extras` (several processes gather them with the rewards).
CREDIT_ASSIGNMENTS = Registry("credit assignment", {"tree": "mmrl.rollout.tree:tree_credit",
                                                    "step_branch": "mmrl.rollout.step_branch:step_credit"})


@CREDIT_ASSIGNMENTS.register("group")
def group_credit(rewards: dict, weights: dict | None, rollout, valid, cfg, iteration: int):
    a = cfg.algo
    return REWARD_AGGREGATIONS[a.reward_aggregation](rewards, weights, rollout.group_id, valid, a, ADVANTAGES[a.advantage])
