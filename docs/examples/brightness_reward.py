"""Your reward, in one file: how close each image's mean brightness is to a target.

Use it from any config without touching mmrl (the file's folder on PYTHONPATH):

    reward:
      name: brightness_reward:BrightnessReward
      kwargs: {target: 0.2}

A reward is a callable `(outputs, examples) -> {"overall": [N], other keys: [N]}`. Images come as [N, 3, H, W]
in [-1, 1] (videos [N, 3, F, H, W], token policies give N strings); `examples[i]` is the task's example dict
of sample i ("prompt", "category", ...). Every key is logged as reward/<key>_mean; "overall" is trained on.
Return NaN for a sample you cannot score: it is counted and left out of its group, never a silent 0.
"""

import torch


class BrightnessReward:
    def __init__(self, target: float = 0.0):
        if not -1.0 <= target <= 1.0:
            raise ValueError(f"target must be in [-1, 1] (pixel values), got {target}")
        self.target = target

    @torch.no_grad()
    def __call__(self, outputs: torch.Tensor, examples: list[dict]) -> dict[str, torch.Tensor]:
        brightness = outputs.float().flatten(1).mean(1)                 # [N]
        return {"overall": -(brightness - self.target).abs(), "brightness": brightness}
