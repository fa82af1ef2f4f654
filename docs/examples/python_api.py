"""mmrl from Python: a config built in code, your own reward as a plain function, a short run, an evaluation.

    .venv/bin/python docs/examples/python_api.py            # ~3 minutes on 2 CPU cores
    .venv/bin/python docs/examples/python_api.py --smoke    # 2 iterations on 12 prompts (the test; 1-5 minutes)
"""

import sys

import torch

from mmrl import REWARDS, evaluate_checkpoints, load_config, train


def centered(outputs: torch.Tensor, examples: list[dict]) -> torch.Tensor:
    """A reward is any function (outputs, examples) -> one score per sample. Images come as [N, 3, H, W] in [-1, 1]:
    here, how much of the ink sits in the middle third of the image."""
    ink = (1 - (outputs.float().mean(1) + 1) / 2)                        # [N, H, W], 1 = dark
    h, w = ink.shape[1:]
    middle = ink[:, h // 3: 2 * h // 3, w // 3: 2 * w // 3].sum((1, 2))
    return middle / ink.sum((1, 2)).clamp(min=1e-6)                      # [N] in [0, 1]


REWARDS.register("centered")(centered)  # now any config can say reward.name=centered

smoke = "--smoke" in sys.argv
cfg = load_config("configs/quickstart.yaml", [
    "reward.name=centered", "reward.kwargs={}",     # the function above (its shapes-world kwargs do not apply)
    "log.out_dir=runs/python_api", "log.tensorboard=false",
    *(["train.iterations=2", "train.prompts_per_iter=4", "task.eval_prompts=12", "log.eval_at_start=false"]
      if smoke else []),
])
results = train(cfg, overwrite=True)                 # the same loop as `mmrl train`
print("trained:", results["eval_end"]["overall"], "after", results["iterations"], "iterations")

# the held-out benchmark of the base model and the run's newest checkpoint, as `mmrl eval` prints it
scores = evaluate_checkpoints(cfg, ["runs/python_api"], progress=False)
for model, r in scores.items():
    print(f"{model}: centered {r['overall']:.4f} on {r['n']} prompts")
