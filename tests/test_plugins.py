"""A user's own reward, task and credit-assignment rule, in a file outside the package, named in YAML by
`package.module:Name`: trained end to end through `mmrl train` without touching mmrl."""

import json
import os
import textwrap

import pytest
import torch

from mmrl.checkpoint import read_trainer_state
from mmrl.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PLUGIN = '''
import torch


class Brightness:
    """Reward: how close an image's mean brightness is to `target` (0 at the target, negative elsewhere)."""

    def __init__(self, target: float = 0.0):
        self.target = target

    def __call__(self, outputs, examples):
        return {"overall": -(outputs.float().mean(dim=(1, 2, 3)) - self.target).abs(),
                "brightness": outputs.float().mean(dim=(1, 2, 3))}


class Colors:
    """Task: "a <color> circle" prompts; the color is the category."""

    def __init__(self, cfg, colors=("red", "blue")):
        self.colors = list(colors)

    def sample(self, n, rng):
        return [self._example(rng.choice(self.colors)) for _ in range(n)]

    def eval_examples(self):
        return [self._example(c) for c in self.colors]

    def _example(self, color):
        return {"prompt": f"a {color} circle", "category": color}


CALLS = []


def sign_credit(rewards, weights, rollout, valid, cfg, iteration):
    """Credit assignment: +1 above the group mean, -1 below (a sign-only GRPO)."""
    r, g = rewards["overall"], rollout.group_id
    mean = torch.zeros(int(g.max()) + 1).index_add_(0, g, r) / torch.bincount(g).float()
    CALLS.append(iteration)
    return torch.sign(r - mean[g]) * valid, {"adv/sign_calls": float(len(CALLS))}
'''


def test_a_reward_task_and_credit_rule_from_a_users_file_train_from_yaml(tiny_pixel_model, tmp_path, monkeypatch):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "my_plugins.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(plugins))  # what PYTHONPATH=plugins does for a user
    out = tmp_path / "run"
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(textwrap.dedent(f"""
        base: {ROOT}/configs/tiny/flow_smoke.yaml
        model: {{path: {tiny_pixel_model}}}
        task: {{name: "my_plugins:Colors", kwargs: {{colors: [red, green, blue]}}}}
        reward: {{name: "my_plugins:Brightness", kwargs: {{target: -0.2}}}}
        algo: {{credit: "my_plugins:sign_credit"}}
        log: {{out_dir: {out}, tensorboard: false}}
    """))
    assert main(["train", str(cfg)]) == 0
    import my_plugins

    assert my_plugins.CALLS == [0, 1]  # the user's credit rule ran once per iteration
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "reward/overall_mean" in r]
    assert len(train) == 2 and all(r["reward/overall_mean"] <= 0 for r in train)  # the user's reward, not shapes
    assert all("reward/brightness_mean" in r and r["train/optimizer_steps"] == 2 for r in train)
    assert {k.split("/")[1] for r in train for k in r if k.startswith("reward_by_category/")} <= {"red", "green", "blue"}
    results = json.load(open(out / "results.json"))
    assert results["eval_end"]["n"] == 3 and set(results["eval_end"]["per_category"]) == {"red", "green", "blue"}
    state, start = (read_trainer_state(str(out / "checkpoints" / f"iter-00000{i}")) for i in (2, 1))
    assert any(not torch.equal(a, b) for a, b in zip(state["params"], start["params"]))  # the weights moved


def test_a_plugin_that_cannot_be_imported_fails_at_load_naming_the_fix(tmp_path):
    from mmrl.compose import load_config

    with pytest.raises(ValueError, match=r"task.name: task 'nowhere:Task' could not be imported.*PYTHONPATH"):
        load_config(None, ["task.name=nowhere:Task"])
    with pytest.raises(ValueError, match=r"reward.name: .*'rewards.shapes:NoSuch' could not be imported"):
        load_config(None, ["reward.name=rewards.shapes:NoSuch"])
