"""Your own objective, in one file: a plain policy-gradient loss (REINFORCE with the group-relative advantage, no
ratio clip) with one knob of its own, named in YAML without touching mmrl:

    algo:
      objective: {name: my_objective:reinforce, kwargs: {scale: 0.5}}

(or `algo.policy_loss: my_objective:reinforce`, which keeps every knob at its default). A policy loss is
`fn(log_prob [n, A], old_log_prob [n, A], advantages [n] or [n, A], knobs) -> (loss [n, A], stats)`; `knobs` holds
the algo.* values and the sub-config's kwargs, which must be names the loss declares in `fn.knobs` (checked when the
config loads). stats are [n, A] tensors logged as train/<key> (a "ratio" and a "clipped" entry feed the ratio and clip
statistics). It is the first term of the run's objective (mmrl/algorithms/objective.py); a KL penalty, weightings and
the supervised anchor compose after it from their own keys. Declare what it needs: `fn.needs_output = True` gives a
fifth argument, a LossContext with the policy's outputs (velocities, step means in `.out.stats`), the reference's
(`.ref`, with `fn.needs_reference = True`) and the rows' group ids; `fn.needs_whole_groups = True` keeps each group
in one pass; `fn.objective = "forward"` trains on the forward process of the final samples instead of the sampling
steps (docs/algorithms.md §10, §14).
"""

import torch


def reinforce(log_prob, old_log_prob, advantages, knobs):
    adv = advantages.unsqueeze(-1).expand_as(log_prob) if advantages.dim() == 1 else advantages
    ratio = torch.exp(log_prob - old_log_prob)
    scale = getattr(knobs, "scale", 1.0)
    return -scale * adv * log_prob, {"ratio": ratio.detach(), "clipped": torch.zeros_like(log_prob)}


reinforce.knobs = ("scale",)
