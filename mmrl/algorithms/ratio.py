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
