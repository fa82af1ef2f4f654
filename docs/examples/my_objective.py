"""Your own objective, in one file: a plain policy-gradient loss (REINFORCE with the group-relative advantage, no
ratio clip) with one knob of its own, named in YAML without touching mmrl:

    algo:
      objective: {name: my_objective:reinforce, kwargs: {scale: 0.5}}

A policy loss is `fn(log_prob [n, A], old_log_prob [n, A], advantages [n] or [n, A], knobs) -> (loss [n, A], stats)`;
its knobs are a small dataclass declared beside it (`fn.knobs`): the config's kwargs must be its fields (checked, with
their types, when the config loads; unset ones keep their defaults) and `knobs` is an instance of it. A field named
like an algo.* key that several components read (clip_range, clip_range_high, clip_ratio_c, adv_clip) is filled from
that key instead. stats are [n, A] tensors logged as train/<key> (a "ratio" and a "clipped" entry feed the ratio and
clip statistics). It is the first term of the run's objective (mmrl/algorithms/objective.py); a KL penalty,
weightings and the supervised anchor compose after it from their own keys. Declare what it needs:
`fn.needs_output = True` gives a fifth argument, a LossContext with the policy's outputs (velocities, step means in
`.out.stats`), the reference's (`.ref`, with `fn.needs_reference = True`) and the rows' group ids;
`fn.reads = ("velocity", ...)` names the `.out.stats` it reads, so a training pass builds only those (the flow
policy's full-size velocity and mean tensors cost a copy of the rollout's latents; without `reads`, all are built);
`fn.needs_whole_groups = True` keeps each group in one pass; `fn.objective = "forward"` trains on the forward process
of the final samples instead of the sampling steps (docs/algorithms.md §10, §14).
"""

from dataclasses import dataclass

import torch


@dataclass
class ReinforceKnobs:
    scale: float = 1.0            # the loss's scale (a knob of this loss only)


def reinforce(log_prob, old_log_prob, advantages, knobs: ReinforceKnobs):
    adv = advantages.unsqueeze(-1).expand_as(log_prob) if advantages.dim() == 1 else advantages
    ratio = torch.exp(log_prob - old_log_prob)
    return -knobs.scale * adv * log_prob, {"ratio": ratio.detach(), "clipped": torch.zeros_like(log_prob)}


reinforce.knobs = ReinforceKnobs
