"""Contrast rollouts: G more samples per prompt under a perturbed input, scored but never trained.

T-GRPO (Video-R1; docs/algorithms.md §7) compares how often a group answers correctly on the ordered video with
how often it does on the same video with its frames shuffled. `contrast_rollout` samples one such group per
prompt of a rollout (every example gets `"shuffle_frames": seed`, which token policies apply to their video
frames with a fixed permutation per seed) and scores it with the training reward.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def contrast_rollout(sample, reward, rollout, group_size: int, seed: int):
    """sample(examples, group_size) -> Rollout; reward(outputs, examples) -> (scores, valid, failures).
    Returns ((the rollout's group_id [N], contrast overall [M], contrast group_id [M] in the rollout's group ids),
    stats); failed samples score as 0."""
    groups = torch.unique(rollout.group_id)                                  # [B]
    first = [int((rollout.group_id == g).nonzero()[0]) for g in groups]
    # the permutation seed follows the group id, so a group shuffles alike on whichever rank holds it
    examples = [{**rollout.examples[i], "shuffle_frames": seed + int(g)} for g, i in zip(groups, first)]
    contrast = sample(examples, group_size)
    scores, valid, _ = reward(contrast.outputs, contrast.examples)
    gid = groups[contrast.group_id]                                          # [M] rollout group ids
    overall = torch.where(valid, scores["overall"], torch.zeros_like(scores["overall"]))
    return (rollout.group_id, overall, gid), {"contrast/reward_mean": overall.mean().item()}
