"""Your own objective, in one file: a plain policy-gradient loss (REINFORCE with the group-relative advantage, no
ratio clip), named in YAML without touching mmrl:

    algo:
      policy_loss: my_objective:reinforce

A policy loss is `fn(log_prob [n, A], old_log_prob [n, A], advantages [n] or [n, A], algo_cfg) -> (loss [n, A],
stats)`; stats are [n, A] tensors logged as train/<key> (a "ratio" and a "clipped" entry feed the ratio and clip
statistics). Set `fn.needs_output = True` to get a fifth argument, a LossContext: the policy's outputs (velocities,
step means in `.out.stats`), the reference's (`.ref`, with `fn.needs_reference = True`) and the rows' group ids;
`fn.objective = "forward"` trains on the forward process of the final samples instead of the sampling steps
(docs/algorithms.md §10, §14).
"""

import torch


def reinforce(log_prob, old_log_prob, advantages, cfg):
    adv = advantages.unsqueeze(-1).expand_as(log_prob) if advantages.dim() == 1 else advantages
    ratio = torch.exp(log_prob - old_log_prob)
    return -adv * log_prob, {"ratio": ratio.detach(), "clipped": torch.zeros_like(log_prob)}
