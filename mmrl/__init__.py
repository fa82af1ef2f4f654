"""mmrl: group-relative RL for flow / diffusion generators, VLMs and video LLMs, behind one Policy interface.

The public API (docs/python-api.md), imported on first use so that `import mmrl` (and the command line) stays fast:

    from mmrl import load_config, train, evaluate_checkpoints
    cfg = load_config("configs/t2i/shapes_grpo.yaml", ["train.iterations=5"])
    results = train(cfg)                        # the run's results.json, as a dict
    table = evaluate_checkpoints(cfg, ["runs/shapes_grpo"])

Registries (one per axis; a name, or `package.module:attr` for your own): POLICIES, TASKS, REWARDS, ADVANTAGES,
POLICY_LOSSES, WEIGHTINGS, KL_ESTIMATORS, RATIO_TRANSFORMS, REWARD_SHAPINGS, CREDIT_ASSIGNMENTS. Protocols: Policy,
Task, Reward. Policy kinds: KINDS, kind_of (mmrl/policy/kinds.py). The architecture: docs/architecture.md.
"""

import importlib

_API = {
    "load_config": "mmrl.compose", "train": "mmrl.runs", "evaluate_checkpoints": "mmrl.eval",
    "Trainer": "mmrl.trainer", "Config": "mmrl.config",
    "Policy": "mmrl.policy.base", "Task": "mmrl.task", "Reward": "mmrl.reward",
    "POLICIES": "mmrl.policy", "TASKS": "mmrl.task", "REWARDS": "mmrl.reward",
    "ADVANTAGES": "mmrl.algorithms", "POLICY_LOSSES": "mmrl.algorithms", "WEIGHTINGS": "mmrl.algorithms",
    "KL_ESTIMATORS": "mmrl.algorithms", "RATIO_TRANSFORMS": "mmrl.algorithms", "REWARD_SHAPINGS": "mmrl.algorithms",
    "CREDIT_ASSIGNMENTS": "mmrl.algorithms",
    "KINDS": "mmrl.policy.kinds", "kind_of": "mmrl.policy.kinds",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'mmrl' has no attribute {name!r}; the public API: {', '.join(__all__)}")
    return getattr(importlib.import_module(_API[name]), name)


def __dir__():
    return __all__
