"""AWM with an anchored negative branch (issue 35's pre-registered AWM fix; registered as
POLICY_LOSSES["awm_anchored"]). Chosen and written before any run of it.

The fix. AWM (`losses.awm`, docs/algorithms.md §10) trains each final sample x0 at noise levels t with the matching
loss l(v) = mean_d (v - (eps - x0))^2 of the velocity v = v_theta(x_t, t), weighted by the advantage A, with PPO's
clip on exp(l_old - l). Its negative half, -|A| l(v_theta), is a concave quadratic in v_theta: it pushes the policy
away from a bad sample's target with a force that grows with the distance already travelled, without bound (the
clip limits one step, not the drift; on the shapes world AWM peaked at ~8 minutes and then fell, down to 6.9 %
strict on one seed, docs/results.md). The positive half is kept as it is; the negative half is replaced by
DiffusionNFT's implicit negative policy around an anchor velocity v_a, fitted to the bad sample:

    A > 0:   L = -min(r A, clip(r, 1 - eps, 1 + eps) A),   r = exp(l_old - l(v_theta))       (AWM, unchanged)
    A <= 0:  L = |A| l(v-) / beta,   v- = (1 + beta) v_a - beta v_theta                      (the anchored negative)

with v_a = sg(v_ref(x_t, t)), the reference policy's velocity at the same x_t (`needs_reference`; with
algo.kl_reference=ema and train.ema_decay > 0 the reference is the EMA of the trained weights, with
model.reference=auto the frozen base; kwargs.anchor=ema takes the EMA as the anchor whatever the KL's reference, so
a KL to the frozen base and an EMA anchor go together, as in the shipped config, configs/t2i/shapes_awm_anchored.yaml:
EMA decay 0.97 per optimizer step, velocity KL 0.25 to the base), beta = knobs.nft_beta (algo.objective.kwargs.nft_beta;
1, NFT's setting).

Why this form. d l(v-)/d v_theta = -beta (2/D) (v- - target), so the negative term's gradient is

    |A| (2/D) [ -(v_a - target) + beta (v_theta - v_a) ],

against AWM's |A| (2/D) [ -(v_a - target) - (v_theta - v_a) ]: the same push away from the bad target as AWM's when
v_theta = v_a (there the two gradients are equal, tested), but the displacement from the anchor now has a restoring
sign (+beta, a convex bowl whose minimum v_theta = v_a + (v_a - target) / beta is finite) instead of AWM's
self-reinforcing one (-1). The anchor is a lagging copy and not the sampling weights, as in DiffusionNFT's loss
(`losses.nft`, v_old): here every row is trained once, right after it is sampled (train.inner_epochs=1, one
optimizer step per minibatch), so v_theta = v_old on every first pass and an anchor at v_old would give AWM's
gradient exactly on half the rows and within one optimizer step of it on the rest, i.e. change nothing. DiffusionNFT's
own reference code, too, anchors (and samples) with a soft-updated copy of the policy. NFT's x0-space adaptive
weight is not taken over: its gradient is t / mean_d |v - target| times AWM's matching-loss gradient, 5-53x (mean 23)
on a probe of 16 samples of the shapes base (residuals 0.01-0.19), so a negative branch in NFT's units would outweigh
AWM's positive branch ~20x.

Needs ctx.out.stats "velocity" and "target" [n, A, *D] (the flow policy's forward-process outputs) and ctx.ref
(the reference's outputs on the same actions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmrl.algorithms.losses import POLICY_LOSSES, PPOKnobs, _per_action, ppo_clip
from mmrl.errors import ConfigError


@dataclass
class AWMAnchoredKnobs(PPOKnobs):
    """AWM's trust region (algo.clip_range ..., shared), the anchored negative branch's beta (NFT's, default 1) and
    its anchor: "reference" (the KL's reference, algo.kl_reference) or "ema" (the EMA of the trained weights, while
    the KL's reference stays algo.kl_reference; beside a KL to the frozen base, one more forward without gradients a
    pass; without a KL, no reference is loaded)."""
    nft_beta: float = 1.0
    anchor: str = "reference"

    def __post_init__(self):
        if self.nft_beta <= 0:
            raise ConfigError(f"algo.objective.kwargs.nft_beta must be > 0, got {self.nft_beta}")
        if self.anchor not in ("reference", "ema"):
            raise ConfigError(f"algo.objective.kwargs.anchor must be reference or ema, got {self.anchor!r}")


def awm_anchored(log_prob, old_log_prob, advantages, knobs: AWMAnchoredKnobs, ctx):
    """(loss [n, A], stats). log_prob = -l(v_theta) [n, A]; ctx.out.stats velocity / target [n, A, *D];
    ctx.ref.stats (or ctx.anchor.stats when knobs.anchor = "ema") velocity [n, A, *D]: the anchor."""
    anchor_out = ctx.anchor if knobs.anchor == "ema" else ctx.ref
    if anchor_out is None:
        raise ConfigError("awm_anchored anchors its negative branch at the reference's velocity: set model.reference="
                          "auto (the frozen base), or train.ema_decay > 0 with algo.kl_reference=ema or "
                          "kwargs.anchor=ema")
    adv = _per_action(advantages, log_prob)
    positive, stats = ppo_clip(log_prob, old_log_prob, adv.clamp(min=0), knobs)  # AWM's term; 0 where A <= 0
    s, beta = ctx.out.stats, knobs.nft_beta
    v, target = s["velocity"].float(), s["target"].float()
    anchor = anchor_out.stats["velocity"].detach().float().to(v.device)
    v_neg = (1 + beta) * anchor - beta * v
    l_neg = (v_neg - target.to(v.device)).pow(2).flatten(2).mean(-1)                # [n, A]
    negative = (-adv).clamp(min=0) * l_neg.to(log_prob.dtype) / beta
    loss = torch.where(adv > 0, positive, negative)
    with torch.no_grad():
        neg = adv <= 0
        gap = (v - anchor).pow(2).flatten(2).mean(-1)                                # mean_d (v_theta - v_a)^2
        stats = {"ratio": stats["ratio"], "clipped": (stats["clipped"].bool() & ~neg).float(),
                 "awm_anchor_gap": gap.to(log_prob.dtype), "awm_negative_loss": (l_neg.detach().to(log_prob.dtype), neg)}
    return loss, stats


awm_anchored.objective = "forward"
awm_anchored.guidance = "none"  # AWM's loss is pretraining's conditional flow matching, weighted
awm_anchored.knobs = AWMAnchoredKnobs
awm_anchored.needs_output = True
awm_anchored.reads = ("velocity", "target")
awm_anchored.needs_reference = True
POLICY_LOSSES.register("awm_anchored")(awm_anchored)
