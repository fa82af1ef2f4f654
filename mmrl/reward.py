"""Rewards: the interface, the registry, and the runner that isolates failing samples.

A reward is a callable `(outputs, examples) -> dict[str, Tensor[N]]` with an "overall" key; other keys are
components, logged as `reward/<key>`. Registry: REWARDS maps a name to a factory `(**kwargs) -> reward`.
"""

from __future__ import annotations

import logging
from typing import Callable, Protocol

import torch

from mmrl.registry import Registry

log = logging.getLogger(__name__)
REWARDS = Registry("reward")


class Reward(Protocol):
    def __call__(self, outputs, examples: list[dict]) -> dict[str, torch.Tensor]: ...


@REWARDS.register("shapes")
def _shapes(**kwargs):
    from rewards.shapes import ShapesReward

    return ShapesReward(**kwargs)


@REWARDS.register("motion")
def _motion(**kwargs):
    from rewards.motion import MotionReward

    return MotionReward(**kwargs)


@REWARDS.register("grounding")
def _grounding(**kwargs):
    from rewards.grounding import GroundingReward

    return GroundingReward(**kwargs)


@REWARDS.register("arithmetic")
def _arithmetic(**kwargs):
    from rewards.arithmetic import ArithmeticReward

    return ArithmeticReward(**kwargs)


def _rows(outputs, i: int):
    return outputs[i:i + 1]


class RewardRunner:
    """Calls a reward on a batch; a sample whose reward raises or is NaN/inf is counted and marked invalid.

    on_error="skip": the batch call is retried per sample to find the failing ones; they get valid=False
    (excluded from their group's statistics and from the loss) and are logged. on_error="raise": re-raise.
    """

    def __init__(self, fn: Callable, on_error: str = "skip"):
        self.fn, self.on_error = fn, on_error

    def __call__(self, outputs, examples: list[dict]) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """-> (rewards {key: [N]} with invalid entries set to 0, valid [N] bool, number of failures)."""
        n = len(examples)
        try:
            out = self._check(self.fn(outputs, examples), n)
        except Exception as e:  # noqa: BLE001 - isolate the failing samples below
            if self.on_error == "raise":
                raise
            log.warning("reward raised on the batch (%s: %s); scoring samples one by one", type(e).__name__, e)
            out = self._per_sample(outputs, examples)
        valid = torch.isfinite(out["overall"])
        for k in out:
            valid &= torch.isfinite(out[k])
        failures = int((~valid).sum())
        if failures and self.on_error == "raise":
            raise ValueError(f"reward returned NaN/inf for {failures} of {n} samples (reward.on_error=raise)")
        if failures:
            log.warning("%d of %d samples have no valid reward; excluded from their groups", failures, n)
        return {k: torch.where(valid, v, torch.zeros_like(v)) for k, v in out.items()}, valid, failures

    @staticmethod
    def _check(out, n):
        if not isinstance(out, dict) or "overall" not in out:
            raise TypeError("a reward must return a dict of [N] tensors with an 'overall' key")
        out = {k: torch.as_tensor(v, dtype=torch.float32).reshape(-1) for k, v in out.items()}
        for k, v in out.items():
            if v.shape[0] != n:
                raise ValueError(f"reward key {k!r} has {v.shape[0]} values for {n} samples")
        return out

    def _per_sample(self, outputs, examples):
        rows = []
        for i in range(len(examples)):
            try:
                rows.append(self._check(self.fn(_rows(outputs, i), examples[i:i + 1]), 1))
            except Exception as e:  # noqa: BLE001
                log.warning("reward raised for sample %d (%s: %s)", i, type(e).__name__, e)
                rows.append(None)
        keys = sorted({k for r in rows if r for k in r}) or ["overall"]
        return {k: torch.tensor([float(r[k][0]) if r and k in r else float("nan") for r in rows]) for k in keys}
