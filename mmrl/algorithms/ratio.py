"""Transforms of the log-ratio before the policy loss. Registry: RATIO_TRANSFORMS.

`fn(log_prob [n, A], old_log_prob [n, A], rollout_minibatch, out: PolicyOutput) -> log_prob' [n, A]`: the
returned tensor replaces log_prob in the loss (ratio = exp(log_prob' - old_log_prob)).
"""

from __future__ import annotations

from mmrl.errors import ConfigError
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


none.reads = gspo.reads = ()  # the log-probs only


@RATIO_TRANSFORMS.register("guard")
def guard(log_prob, old_log_prob, rollout, out):
    """GRPO-Guard RatioNorm (arXiv 2510.22319; docs/algorithms.md §5) for flow policies. For a Gaussian step with
    std s and mean shift dmu, log r = reduce_d[eps*dmu/s - dmu^2/(2 s^2)] sits below 0 by b = reduce_d(dmu^2)/(2 s^2),
    most at low-noise steps, so clipping stops constraining positive-advantage updates. Per sample and step:
    log r' = (log r + b) * s (= reduce_d(eps * dmu), mean zero). b comes from the policy ("ratio_bias", computed
    per sample; the reference code reduces it over the batch) and s is the step's std."""
    if "ratio_bias" not in out.stats:
        raise ConfigError("algo.ratio=guard needs a flow policy (its log_prob reports the ratio bias); "
                          "use algo.ratio=none or gspo for token policies")
    std = out.stats["std"].to(log_prob.dtype)
    return old_log_prob + (log_prob - old_log_prob + out.stats["ratio_bias"]) * std


guard.reads = ("std", "ratio_bias")
