"""Reward shaping applied to the overall reward before advantages. Registry: REWARD_SHAPINGS; the config names one
with its knobs, `algo.shaping: {name: tempsamp, kwargs: {tau: 0.8}}`, and `build_shaping` makes it a callable.

`fn(rewards [N], knobs) -> rewards' [N]`, knobs an instance of the dataclass declared beside it (`fn.knobs`;
mmrl/algorithms/knobs.py) or None. A shaping with `needs_contrast = True` is also given a contrast rollout's scores,
`fn(rewards, knobs, contrast)` with contrast = (group_id [N], contrast rewards [M], their group_id [M]): G more samples
per prompt under a perturbed input (`mmrl/rollout/contrast.py`; T-GRPO: the video's frames shuffled), scored and never
trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mmrl.algorithms.knobs import build_knobs
from mmrl.errors import ConfigError
from mmrl.registry import Registry

REWARD_SHAPINGS = Registry("reward shaping")


@dataclass
class Shaping:
    """REWARD_SHAPINGS[name] with its knobs: shaping(rewards [N], *contrast) -> rewards' [N]."""
    fn: Callable
    knobs: Any

    @property
    def needs_contrast(self) -> bool:
        return getattr(self.fn, "needs_contrast", False)

    def __call__(self, rewards: torch.Tensor, *contrast) -> torch.Tensor:
        return self.fn(rewards, self.knobs, *contrast)


def build_shaping(algo) -> Shaping:
    """The reward shaping of config section `algo` (algo.shaping: {name, kwargs}); ConfigError for bad kwargs."""
    fn = REWARD_SHAPINGS[algo.shaping.name]
    return Shaping(fn, build_knobs(fn, algo.shaping.name, algo.shaping.kwargs, "algo.shaping", algo))


@REWARD_SHAPINGS.register("none")
def none(rewards, knobs):
    return rewards


@dataclass
class TempSampKnobs:
    """TempSamp-R1's soft shaping (its reference settings: tau 0.8, alpha 1)."""
    tau: float = 0.8              # the pivot: rewards above are compressed, below spread
    alpha: float = 1.0            # the spread's curvature; != 0

    def __post_init__(self):
        if self.alpha == 0:
            raise ConfigError("algo.shaping.kwargs.alpha must be != 0 (it divides by exp(alpha) - 1)")


@REWARD_SHAPINGS.register("tempsamp")
def tempsamp(rewards, knobs: TempSampKnobs):
    """TempSamp-R1 soft shaping (tau = knobs.tau, alpha = knobs.alpha): rewards above tau are
    compressed, f(r) = tau + 0.01 ln(r - tau + 1); rewards below are spread, f(r) = tau - (exp(alpha (tau - r))
    - 1) / (exp(alpha) - 1). Keeps the near-perfect injected answer from dominating its group."""
    tau, alpha = knobs.tau, knobs.alpha
    r = rewards.double()
    high = tau + 0.01 * torch.log((r - tau).clamp(min=0) + 1)
    low = tau - (torch.exp(alpha * (tau - r).clamp(min=0)) - 1) / (math.exp(alpha) - 1)
    return torch.where(r >= tau, high, low).to(rewards.dtype)


def temporal_contrast(rewards: torch.Tensor, group_id: torch.Tensor, contrast: torch.Tensor,
                      contrast_group_id: torch.Tensor, alpha: float, mu: float, threshold: float):
    """T-GRPO (Video-R1) temporal reward. Per group: p = share of correct samples (reward >= threshold) on the
    ordered video, p~ = the same share on shuffled frames; when p >= mu * p~ every correct ordered sample gets
    + alpha (the model did better because the order mattered), else nothing. -> (rewards' [N], stats)."""
    correct = (rewards >= threshold).double()
    out = rewards.clone().double()
    bonus_groups = 0
    groups = torch.unique(group_id)
    for g in groups:
        rows, crows = group_id == g, contrast_group_id == g
        p = correct[rows].mean()
        p_shuffled = (contrast[crows] >= threshold).double().mean() if crows.any() else torch.tensor(0.0)
        if p >= mu * p_shuffled and p > 0:
            out[rows] += alpha * correct[rows]
            bonus_groups += 1
    return out.to(rewards.dtype), {"tgrpo/bonus_group_frac": bonus_groups / max(len(groups), 1),
                                   "tgrpo/correct_ordered": float(correct.mean()),
                                   "tgrpo/correct_shuffled": float((contrast >= threshold).double().mean())}


@dataclass
class TGRPOKnobs:
    """T-GRPO's temporal bonus (Video-R1's settings)."""
    alpha: float = 0.3            # bonus for the correct samples of a group whose ordered-frame accuracy p ...
    mu: float = 0.8               # ... is >= mu x its shuffled-frame accuracy
    threshold: float = 0.5        # a sample is correct when its overall reward >= this


@REWARD_SHAPINGS.register("tgrpo")
def tgrpo(rewards, knobs: TGRPOKnobs, contrast):
    """T-GRPO: `temporal_contrast` with knobs.alpha, knobs.mu and knobs.threshold."""
    shaped, _ = temporal_contrast(rewards, *contrast, knobs.alpha, knobs.mu, knobs.threshold)
    return shaped


tempsamp.knobs = TempSampKnobs
tgrpo.knobs = TGRPOKnobs
tgrpo.needs_contrast = True
