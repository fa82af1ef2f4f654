"""Bad input: rewards that raise or return NaN, missing or empty prompt files."""

import random
from types import SimpleNamespace

import pytest
import torch

from mmrl.reward import RewardRunner
from mmrl.task import PromptFileTask


def flaky(outputs, examples):
    vals = []
    for ex in examples:
        if ex["prompt"] == "boom":
            raise RuntimeError("reward model crashed")
        vals.append(float("nan") if ex["prompt"] == "nan" else len(ex["prompt"]))
    return {"overall": torch.tensor(vals)}


def test_raising_and_nan_samples_are_counted_and_excluded():
    ex = [{"prompt": p} for p in ["ab", "boom", "abc", "nan"]]
    rewards, valid, failures = RewardRunner(flaky)(torch.zeros(4, 1), ex)
    assert valid.tolist() == [True, False, True, False] and failures == 2
    assert rewards["overall"].tolist() == [2.0, 0.0, 3.0, 0.0]
    with pytest.raises(RuntimeError, match="crashed"):
        RewardRunner(flaky, "raise")(torch.zeros(4, 1), ex)
    with pytest.raises(ValueError, match="NaN/inf for 1 of 2"):
        RewardRunner(flaky, "raise")(torch.zeros(2, 1), ex[2:])


def test_bad_reward_return_type():
    _, valid, failures = RewardRunner(lambda o, e: [1.0] * len(e))(torch.zeros(2, 1), [{"prompt": "a"}] * 2)
    assert failures == 2 and not valid.any()


def test_prompt_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptFileTask(SimpleNamespace(prompt_file=str(tmp_path / "missing.txt")))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n# only a comment\n   \n")
    with pytest.raises(ValueError, match="has no prompts"):
        PromptFileTask(SimpleNamespace(prompt_file=str(empty)))
    good = tmp_path / "p.txt"
    good.write_text("a red circle\n\n# c\ntwo squares\n")
    task = PromptFileTask(SimpleNamespace(prompt_file=str(good)))
    assert task.eval_examples() == [{"prompt": "a red circle"}, {"prompt": "two squares"}]
    assert len(task.sample(5, random.Random(0))) == 5


def test_shapes_task_balances_categories_and_keeps_heldout_out():
    from collections import Counter

    from mmrl.config import TaskConfig
    from tasks.shapes import ShapesTask

    task = ShapesTask(TaskConfig(eval_prompts=60))
    drawn = task.sample(3000, random.Random(0))
    counts = Counter(ex["category"] for ex in drawn)
    assert len(counts) == 6 and all(400 <= c <= 600 for c in counts.values()), counts
    assert not {ex["prompt"] for ex in drawn} & {ex["prompt"] for ex in task.eval_examples()}
    raw = Counter(ex["category"] for ex in ShapesTask(TaskConfig(), balanced=False).sample(3000, random.Random(0)))
    assert raw["color_attr"] > 1500  # the texts themselves are mostly color attribution


def test_reward_runner_scores_in_micro_batches():
    calls = []

    def reward(outputs, examples):
        calls.append(len(examples))
        return {"overall": outputs.sum(-1), "first": outputs[:, 0]}

    x = torch.arange(14.0).view(7, 2)
    whole, _, _ = RewardRunner(reward)(x, [{}] * 7)
    parts, valid, _ = RewardRunner(reward, micro_batch=3)(x, [{}] * 7)
    assert calls == [7, 3, 3, 1] and valid.all()
    assert all(torch.equal(whole[k], parts[k]) for k in whole)
