"""Flow-DPPO (arXiv 2606.11025; docs/algorithms.md §13): a trust region from the exact KL between the old and the
new Gaussian SDE step instead of PPO's ratio clip. Registered as POLICY_LOSSES["flow_dppo"] (flow transitions).

Per trained step k of a sample with advantage A and ratio rho = exp(logp - logp_old):

    KL_k  = mean_d (mu_theta - mu_old)^2 / (2 s_k^2)             (the step's exact Gaussian KL, dims averaged)
    drop  = KL_k >= tau  and  ((rho > 1 and A > 0) or (rho < 1 and A < 0))
    L_k   = -A rho (1 - drop)

A step that moved further than tau from the sampling policy in the advantage's direction gives no gradient (the
analogue of PPO's clip, decided by the divergence, not the ratio); a step inside the region, or one moving back,
always trains. tau = knobs.dppo_kl_threshold (the reference recipe: 1e-5). The KL is the flow policy's
`ratio_bias` statistic, mean-reduced over dimensions with sampler.logprob_reduce=mean as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.algorithms.losses import POLICY_LOSSES, _per_action


@dataclass
class FlowDPPOKnobs:
    dppo_kl_threshold: float = 1e-5  # tau, the step-KL trust region (the reference recipe)


def flow_dppo(log_prob, old_log_prob, advantages, knobs: FlowDPPOKnobs, ctx):
    """(loss [n, A], stats): see the module docstring. ctx.out.stats["ratio_bias"] [n, A] is the step KL."""
    adv = _per_action(advantages, log_prob)
    ratio = torch.exp(log_prob - old_log_prob)
    kl = ctx.out.stats["ratio_bias"].to(log_prob)
    with torch.no_grad():
        drop = (kl >= knobs.dppo_kl_threshold) & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
    loss = -adv * ratio * (~drop).to(ratio.dtype)
    return loss, {"ratio": ratio.detach(), "clipped": drop.float(), "step_kl": kl.detach()}


flow_dppo.needs_output = True
flow_dppo.reads = ("ratio_bias",)
flow_dppo.knobs = FlowDPPOKnobs
flow_dppo.flow_steps_only = True  # the exact Gaussian KL of flow SDE steps, with the raw ratio
POLICY_LOSSES.register("flow_dppo")(flow_dppo)
