"""The motion-world benchmark metric: ODE clips scored by the tracker, overall and per direction."""

from __future__ import annotations

from mmrl.evaluation import evaluate_generator
from rewards.motion import MotionReward
from tasks.motion import Prompt


def evaluate(model, prompts: list[Prompt], seed: int = 0, num_steps: int = 16, cfg_scale: float = 1.0,
             batch_size: int = 32, progress: bool = True) -> dict:
    """Motion accuracy (and the reward's components) of `model` (a FlowModel) on `prompts`, per direction;
    sample i uses noise seed seed + i."""
    examples = [{"prompt": p.text, "category": p.spec.direction} for p in prompts]
    return evaluate_generator(model, examples, MotionReward(), seed, num_steps, cfg_scale, batch_size, progress)
