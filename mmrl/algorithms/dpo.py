"""Online Diffusion-DPO on a group's best and worst sample (Wallace et al., "Diffusion Model Alignment Using Direct
Preference Optimization", arXiv 2311.12908; docs/algorithms.md §15). Registered as POLICY_LOSSES["dpo"].

On the forward process of final samples (as DGPO, §14): l(x) = mean_d (v(x_t, t) - (eps - x0))^2 under the policy
(l_theta) and the frozen reference (l_ref). In each group the sample with the highest advantage is the winner w and
the one with the lowest the loser l; per noise level j

    L = -log sigmoid(-(beta / 2) [(l_theta(w) - l_ref(w)) - (l_theta(l) - l_ref(l))])

(the reference code's form, T folded into beta; beta = knobs.dpo_beta, 2000-5000 in the SD recipes). The other rows
of the group carry no loss; a group whose rewards are all equal has no pair. The loss is put on the winner's row
(so the trainer's aggregation, which averages over rows, sees it once per group) and the statistics on both. A pass
must hold whole groups (as DGPO). Offline, on pairs from a preference file (Pick-a-Pic style), the same loss trains
on groups of the two given images (task.name=preference_pairs, tasks/preference.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.algorithms.losses import POLICY_LOSSES


@dataclass
class DPOKnobs:
    dpo_beta: float = 2000.0      # beta (T folded in); Diffusion-DPO's SD recipes: 2000-5000


def dpo(log_prob, old_log_prob, advantages, knobs: DPOKnobs, ctx):
    """(loss [n, A], stats). log_prob = -l_theta [n, A]; ctx.ref.log_prob = -l_ref; ctx.group_id [n]."""
    gap = (ctx.ref.log_prob.to(log_prob) - log_prob)              # l_theta - l_ref  [n, A]
    adv = advantages if advantages.dim() == 1 else advantages.mean(-1)
    loss = torch.zeros_like(log_prob)
    pair = torch.zeros(log_prob.shape[0], dtype=torch.bool, device=log_prob.device)
    margin = torch.zeros_like(log_prob)
    for g in torch.unique(ctx.group_id).tolist():
        rows = (ctx.group_id == g).nonzero().squeeze(-1).to(log_prob.device)
        a = adv[rows]
        if len(rows) < 2 or a.max() <= a.min():
            continue
        w, lo = rows[a.argmax()], rows[a.argmin()]
        z = -(knobs.dpo_beta / 2) * (gap[w] - gap[lo])              # [A]
        loss = loss.index_put((w,), -torch.nn.functional.logsigmoid(z))
        margin = margin.index_put((w,), z.detach()).index_put((lo,), z.detach())
        pair[w] = pair[lo] = True
    return loss, {"ratio": torch.exp(log_prob - old_log_prob).detach(), "dpo_margin": margin,
                  "dpo_paired": pair[:, None].expand_as(log_prob).float()}


dpo.objective = "forward"
dpo.guidance = "none"  # Diffusion-DPO's loss compares conditional denoising errors
dpo.knobs = DPOKnobs
dpo.needs_output = True
dpo.reads = ()  # the log-probs of the policy and the reference only
dpo.needs_reference = True
dpo.needs_whole_groups = True
POLICY_LOSSES.register("dpo")(dpo)
