"""DGPO, Direct Group Preference Optimization (Luo, Hu, Tang; arXiv 2510.08425, ICLR 2026; docs/algorithms.md §14):
a group-level DPO on the forward process of deterministic (ODE) samples. Registered as POLICY_LOSSES["dgpo"].

A sample's "log-prob" at a noise level t is -l, l = mean_d (v_theta(x_t, t) - (eps - x0))^2 (as for AWM / NFT),
and l_ref is the same error under the reference policy (the frozen base, model.reference=auto). The group's
implicit reward difference between its positive and negative samples, weighted by their advantages A_i, is

    D_g = sum_{i in g} A_i (l_theta,i - l_ref,i),       L_g = -log sigmoid(-(beta / G) D_g)

(good samples' error relative to the reference goes down, bad ones' up). Its gradient is
sigmoid((beta / G) D_g) (beta / G) sum_i A_i grad l_theta,i, so the per-sample loss trained here is

    L_i = w_g A_i l_theta,i,      w_g = sg(sigmoid((beta / G) D_g))

(the constant beta / G folded into the learning rate, as the reference implementation does). A sample whose
ratio exp(l_old - l_theta) left [1 - c, 1 + c] in its advantage's direction gives no gradient (c = algo.clip_range),
as the reference's clipped variant. beta = knobs.dgpo_beta (the reference's GenEval / OCR recipes: 100). D_g sums
over the group's samples in one training pass, so a pass must hold whole groups (train.minibatches=1, no
micro-batches; checked at load); action j of every sample is summed together (its j-th noise level).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.algorithms.losses import POLICY_LOSSES, _per_action


@dataclass
class DGPOKnobs:
    clip_range: float             # algo.clip_range (shared): c, the ratio clip of the clipped variant
    dgpo_beta: float = 100.0      # the group preference's inverse temperature (the reference's GenEval / OCR recipes)


def dgpo(log_prob, old_log_prob, advantages, knobs: DGPOKnobs, ctx):
    """(loss [n, A], stats). log_prob = -l_theta [n, A]; ctx.ref.log_prob = -l_ref; ctx.group_id [n]."""
    adv = _per_action(advantages, log_prob)
    l_theta, l_ref = -log_prob, -ctx.ref.log_prob.to(log_prob)
    gid = torch.unique(ctx.group_id, return_inverse=True)[1].to(log_prob.device)      # [n] -> 0 .. g-1
    n_groups = int(gid.max()) + 1
    with torch.no_grad():
        d = torch.zeros(n_groups, log_prob.shape[1], device=log_prob.device, dtype=log_prob.dtype)
        d.index_add_(0, gid, adv * (l_theta - l_ref))                                  # D_g per action [g, A]
        size = torch.bincount(gid, minlength=n_groups).to(d)[:, None]                  # G per group
        w = torch.sigmoid(knobs.dgpo_beta / size * d)[gid]                               # [n, A]
        ratio = torch.exp(log_prob - old_log_prob)
        clipped = ((adv > 0) & (ratio > 1 + knobs.clip_range)) | ((adv <= 0) & (ratio < 1 - knobs.clip_range))
    l_trained = torch.where(clipped, l_theta.detach(), l_theta)
    return w * adv * l_trained, {"ratio": ratio, "clipped": clipped.float(), "dgpo_weight": w,
                                 "dgpo_error_gap": (l_theta - l_ref).detach()}


dgpo.objective = "forward"
dgpo.guidance = "none"  # DGPO's loss compares conditional flow-matching errors
dgpo.knobs = DGPOKnobs
dgpo.needs_output = True
dgpo.reads = ()  # the log-probs of the policy and the reference only
dgpo.needs_reference = True
dgpo.needs_whole_groups = True
POLICY_LOSSES.register("dgpo")(dgpo)
