"""The shapes-world benchmark metric: ODE samples scored by the detector, overall and per category."""

from __future__ import annotations

from mmrl.evaluation import evaluate_generator
from rewards.shapes import ShapesReward
from tasks.shapes import Prompt


# The benchmark protocol: 16 ODE steps without guidance (the small bases score best at CFG 1-2; see the docs).
EVAL_STEPS, EVAL_CFG = 16, 1.0


def evaluate(model, prompts: list[Prompt], seed: int = 0, num_steps: int = EVAL_STEPS, cfg_scale: float = EVAL_CFG,
             batch_size: int = 64, progress: bool = True) -> dict:
    """Strict and partial accuracy of `model` (a FlowModel) on `prompts`; sample i uses noise seed seed + i."""
    examples = [{"prompt": p.text, "category": p.spec.category} for p in prompts]
    return evaluate_generator(model, examples, ShapesReward(), seed, num_steps, cfg_scale, batch_size, progress)
