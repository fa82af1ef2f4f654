"""Rewards: the interface, the registry, and the runner that isolates failing samples.

A reward is a callable `(outputs, examples) -> dict[str, Tensor[N]]` with an "overall" key; other keys are
components, logged as `reward/<key>`. Registry: REWARDS maps a name to a factory `(**kwargs) -> reward`;
built-ins (rewards/) are imported on first use, and `reward.name: my_rewards:MyReward` uses a class from the
user's own file. A reward that wraps another takes it built (mmrl/compose.py builds it from the config).
A reward with `needs_groups = True` (pairwise win rates, mmrl/rollout/pairwise.py) is called with the rollout's
`group_id` as a third argument. MultiReward sums several rewards with (scheduled) weights; the trainer's
`algo.reward_aggregation` decides whether advantages come from that sum, per component within groups (GDPO), or
from components normalized over the batch first (batch).
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Protocol, runtime_checkable

import torch

from mmrl.errors import ConfigError
from mmrl.registry import Registry

log = logging.getLogger(__name__)
# name -> factory `(**reward.kwargs) -> reward`; built-ins are imported on first use
REWARDS = Registry("reward", {
    "shapes": "rewards.shapes:ShapesReward",
    "motion": "rewards.motion:MotionReward",
    "grounding": "rewards.grounding:GroundingReward",
    "arithmetic": "rewards.arithmetic:ArithmeticReward",
    "clip_score": "rewards.clip_models:CLIPScore",
    "pickscore": "rewards.clip_models:PickScore",
    "hpsv2": "rewards.clip_models:HPSv2",
    "aesthetic": "rewards.clip_models:Aesthetic",
    "image_reward": "rewards.image_reward:ImageReward",
    "ocr": "rewards.ocr:OCRReward",
    "video_frames": "rewards.video:FrameReward",
    "temporal_consistency": "rewards.video:TemporalConsistency",
    "geneval": "rewards.geneval:GenEvalReward",
    "unified_reward": "rewards.judges:UnifiedRewardScore",
    "hpsv3": "rewards.vlm_reward_models:HPSv3",
    "video_align": "rewards.vlm_reward_models:VideoAlign",
    "pairwise": "mmrl.rollout.pairwise:PairwiseReward",
    "preference_label": "tasks.preference:PreferenceLabel",
    "multi": "mmrl.reward:MultiReward",
    "remote": "mmrl.reward_server:RemoteReward",
})


@runtime_checkable
class Reward(Protocol):
    """What the trainer calls. Optional attributes: `needs_groups` (called with group_id as a third argument),
    `per_sample_retry = False` (never re-scored sample by sample). Several rewards with weights are a MultiReward,
    whose weights the aggregations of several rewards read."""

    def __call__(self, outputs, examples: list[dict]) -> dict[str, torch.Tensor]: ...


def weight_schedule(value, where: str = "weight") -> Callable[[int], float]:
    """A component's weight as a function of the training iteration: a number (constant), or a list of
    [iteration, weight] points, piecewise linear between them and constant before the first and after the last
    (`[[0, 1.0], [50, 0.0]]`: from 1 at iteration 0 down to 0 at iteration 50, then 0)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        w = float(value)
        if not math.isfinite(w):
            raise ConfigError(f"{where}={value}: a weight must be finite")
        return lambda it: w
    try:
        points = [(int(i), float(w)) for i, w in value]
        if any(float(i) != int(i) for i, _ in value):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={value!r}: give a number or a list of [iteration, weight] points, e.g. "
                          f"[[0, 1.0], [50, 0.0]]") from None
    its = [i for i, _ in points]
    if not points or its != sorted(its) or its[0] < 0 or not all(math.isfinite(w) for _, w in points):
        raise ConfigError(f"{where}={value!r}: the points need iterations >= 0 in increasing order and finite weights")

    def at(it: int) -> float:
        if it <= its[0]:
            return points[0][1]
        for (i0, w0), (i1, w1) in zip(points, points[1:]):
            if it <= i1:
                return w0 + (w1 - w0) * (it - i0) / max(i1 - i0, 1)
        return points[-1][1]
    return at


class MultiReward:
    """Several rewards at once. In the config: reward.kwargs.components = {label: {"name": REWARDS key (default:
    the label), "weight": w, "kwargs": {...}}}; mmrl.compose builds each and passes {label: {"reward": object,
    "weight": w}} here. Returns "overall" = sum_k w_k * r_k, each component's overall as "<label>" and its own
    components as "<label>/<key>". `weights` ({label: w}) is what the aggregations of several rewards
    (algo.reward_aggregation gdpo / batch) read. A weight may be scheduled (`weight_schedule`): the trainer calls
    `set_iteration(it)` before each iteration's rollout (and logs every weight), so a resumed run has the same
    weights. A component that needs groups makes the whole reward need them."""

    def __init__(self, components: dict):
        if not components:
            raise ConfigError("reward.name=multi needs reward.kwargs.components: {label: {name:, weight:, kwargs:}}")
        for label in components:
            if "/" in label:
                raise ConfigError(f"reward component label {label!r} must not contain '/'")
        self.rewards = {label: c["reward"] for label, c in components.items()}
        self.schedules = {label: weight_schedule(c.get("weight", 1.0), f"reward.kwargs.components.{label}.weight")
                          for label, c in components.items()}
        self.iteration = 0
        self.needs_groups = any(getattr(r, "needs_groups", False) for r in self.rewards.values())

    @property
    def weights(self) -> dict[str, float]:
        return {label: at(self.iteration) for label, at in self.schedules.items()}

    def set_iteration(self, it: int) -> None:
        self.iteration = it

    def __call__(self, outputs, examples, group_id=None) -> dict[str, torch.Tensor]:
        out, total, weights = {}, 0.0, self.weights
        for label, fn in self.rewards.items():
            r = fn(outputs, examples, group_id) if getattr(fn, "needs_groups", False) else fn(outputs, examples)
            r = RewardRunner._check(r, len(examples))
            out[label] = r["overall"]
            out.update({f"{label}/{k}": v for k, v in r.items() if k != "overall"})
            total = total + weights[label] * r["overall"]
        return {"overall": total, **out}


class FunctionReward:
    """A plain function as a reward, TRL's habit: `fn(outputs, examples, **kwargs)` (or `fn(outputs, **kwargs)`)
    returning scores [N] (list, array or tensor) or a dict of them with an "overall" key. reward.kwargs go to it
    at every call."""

    def __init__(self, fn: Callable, **kwargs):
        self.fn, self.kwargs = fn, kwargs
        self.positional = len(plain_function_args(fn))

    def __call__(self, outputs, examples) -> dict[str, torch.Tensor]:
        out = self.fn(outputs, examples, **self.kwargs) if self.positional >= 2 else self.fn(outputs, **self.kwargs)
        if not isinstance(out, dict):
            out = {"overall": out}
        return {k: torch.as_tensor(v, dtype=torch.float32).reshape(-1) for k, v in out.items()}


def plain_function_args(fn) -> list[str]:
    """The required positional parameters of a plain function (not a class): a reward function takes the outputs
    (and the examples) this way, while reward factories take keyword options only."""
    import inspect

    if not inspect.isfunction(fn):
        return []
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]


def _rows(outputs, i: int):
    return outputs[i:i + 1]


class RewardRunner:
    """Calls a reward on a batch; a sample whose reward raises or is NaN/inf is counted and marked invalid.

    on_error="skip": the batch call is retried per sample to find the failing ones; they get valid=False
    (excluded from their group's statistics and from the loss) and are logged. on_error="raise": re-raise.
    """

    def __init__(self, fn: Callable, on_error: str = "skip", micro_batch: int = 0):
        self.fn, self.on_error = fn, on_error
        self.micro_batch = micro_batch  # > 0: a pointwise reward scores this many samples per call
        self.last_error: str | None = None  # the most recent exception, "Type: message", for error reports

    def at_iteration(self, it: int) -> dict[str, float] | None:
        """A reward with scheduled weights (MultiReward) moved to iteration `it`; returns its weights ({label: w}),
        None for a reward without them."""
        if not hasattr(self.fn, "set_iteration"):
            return None
        self.fn.set_iteration(it)
        return self.fn.weights

    def __call__(self, outputs, examples: list[dict], group_id: torch.Tensor | None = None
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """-> (rewards {key: [N]} with invalid entries set to 0, valid [N] bool, number of failures).

        A reward that needs groups (or a remote one, `per_sample_retry = False`) is never re-scored sample by
        sample: if it raises, the whole batch is invalid and counted."""
        n = len(examples)
        groups = getattr(self.fn, "needs_groups", False)
        if groups and group_id is None:
            raise ValueError("this reward compares the samples of a group (pairwise); it needs group_id")
        try:
            out = self._check(self.fn(outputs, examples, group_id) if groups else self._score(outputs, examples), n)
        except Exception as e:  # noqa: BLE001 - isolate the failing samples below
            if self.on_error == "raise":
                raise
            self.last_error = f"{type(e).__name__}: {e}"
            if groups or not getattr(self.fn, "per_sample_retry", True):
                log.warning("reward raised on the batch (%s: %s); all %d samples are invalid", type(e).__name__, e, n)
                out = {"overall": torch.full((n,), float("nan"))}
            else:
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

    def _score(self, outputs, examples) -> dict:
        """A pointwise reward on micro_batch samples at a time (all at once when 0), joined per key."""
        k, n = self.micro_batch, len(examples)
        if not k or k >= n:
            return self.fn(outputs, examples)
        parts = [self._check(self.fn(outputs[i:i + k], examples[i:i + k]), len(examples[i:i + k]))
                 for i in range(0, n, k)]
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    @staticmethod
    def _check(out, n):
        if not isinstance(out, dict) or "overall" not in out:
            raise TypeError("a reward must return a dict of [N] tensors with an 'overall' key")
        # rewards are bookkeeping: on CPU, whatever device the reward model scored on
        out = {k: torch.as_tensor(v).detach().to("cpu", torch.float32).reshape(-1) for k, v in out.items()}
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
                self.last_error = f"{type(e).__name__}: {e}"
                rows.append(None)
        keys = sorted({k for r in rows if r for k in r}) or ["overall"]
        return {k: torch.tensor([float(r[k][0]) if r and k in r else float("nan") for r in rows]) for k in keys}
