"""Per-action weights multiplying the per-action loss. Registry: WEIGHTINGS.

`fn(rollout_minibatch, out: PolicyOutput) -> weights [n, A]` (or [A]); "none" returns 1.
"""

from __future__ import annotations

import torch

from mmrl.registry import Registry

WEIGHTINGS = Registry("action weighting")


@WEIGHTINGS.register("none")
def none(rollout, out):
    return torch.ones_like(out.log_prob)
