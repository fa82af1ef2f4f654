"""Contrast rollouts: G more samples per prompt under a perturbed input, scored but never trained.

T-GRPO (Video-R1; docs/algorithms.md §7) compares how often a group answers correctly on the ordered video with
how often it does on the same video with its frames shuffled. `contrast_rollout` samples one such group per
prompt of a rollout (every example gets `"shuffle_frames": seed + group id`, which token policies apply to their
video frames with a fixed permutation per seed) and scores it with the training reward.

Several processes: the contrast batch is every rank's prompts (gathered, in group-id order), sampled like a rollout
by `Distributed.sample`: each rank samples its share with equal-work padding (under FSDP every forward is a
collective, so every rank runs as many sampling forwards), and each group draws from the seed it has in one process.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def contrast_rollout(sample, reward, rollout, group_size: int, seed: int, gather_list=lambda items: items):
    """sample(examples, group_size) -> this rank's share of one group per example, group ids = the examples'
    indices (-1: a padding row); reward(outputs, examples, group_id) -> (scores, valid, failures); gather_list:
    every rank's list of items (Distributed.gather_list; one process: the identity). Padding rows of `rollout`
    (group id < 0) are skipped. Returns ((contrast overall [M], contrast group_id [M] in the rollout's group ids),
    stats as (sum, count) pairs); M: this rank's contrast rows; failed samples score as 0."""
    first: dict[int, int] = {}
    for i, g in enumerate(rollout.group_id.tolist()):                      # this rank's groups -> their first row
        if g >= 0:
            first.setdefault(g, i)
    # the permutation seed follows the group id, so a group shuffles alike on whichever rank samples it
    mine = [(g, {**rollout.examples[i], "shuffle_frames": seed + g}) for g, i in first.items()]
    everyone = sorted(gather_list(mine), key=lambda item: item[0])        # [B] every rank's groups, in order
    groups = torch.tensor([g for g, _ in everyone], dtype=torch.long)     # [B]
    contrast = sample([ex for _, ex in everyone], group_size)
    real = (contrast.group_id >= 0).nonzero().squeeze(-1)                 # [M] (padding rows left out)
    contrast = contrast.select(real)
    scores, valid, _ = reward(contrast.outputs, contrast.examples, contrast.group_id)
    overall = torch.where(valid, scores["overall"], torch.zeros_like(scores["overall"]))  # [M]
    return (overall, groups[contrast.group_id]), {"contrast/reward_mean": [(overall.sum().item(), len(overall))]}
