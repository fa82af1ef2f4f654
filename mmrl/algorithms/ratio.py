"""Transforms of the log-ratio before the policy loss. Registry: RATIO_TRANSFORMS.

`fn(log_prob [n, A], old_log_prob [n, A], rollout_minibatch, out: PolicyOutput) -> log_prob' [n, A]`: the
returned tensor replaces log_prob in the loss (ratio = exp(log_prob' - old_log_prob)).
"""

from __future__ import annotations

from mmrl.registry import Registry

RATIO_TRANSFORMS = Registry("ratio transform")


@RATIO_TRANSFORMS.register("none")
def none(log_prob, old_log_prob, rollout, out):
    return log_prob


@RATIO_TRANSFORMS.register("gspo")
def gspo(log_prob, old_log_prob, rollout, out):
    """GSPO (arXiv 2507.18071), token form: every action of a sample gets the sequence-level log-ratio
    mean_t(logp - logp_old) as its value (so ratio = s_i and clipping acts per sequence), while the gradient
    of action t stays s_i * grad logp_t:  logp'_t = logp_old_t + sg(mean log-ratio) + logp_t - sg(logp_t)."""
    m = rollout.action_mask.to(log_prob.dtype)
    seq = ((log_prob - old_log_prob) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)  # [n, 1]
    return old_log_prob + seq.detach() + log_prob - log_prob.detach()
