"""docs/extending.md's three files (your reward, your task, your model) train together from YAML, pass the
protocol checks, and `mmrl eval` scores the result: what the docs promise, run by the suite."""

import json
import os

import pytest
import torch

from mmrl.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "docs", "examples")


def test_the_docs_examples_train_and_evaluate_from_yaml(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(EXAMPLES)
    out = tmp_path / "run"
    cfg = tmp_path / "mine.yaml"  # docs/examples/my_config.yaml, the docs' commands' config, writing into tmp_path
    cfg.write_text(open(os.path.join(EXAMPLES, "my_config.yaml")).read().replace("runs/mine", str(out)))
    assert main(["validate", str(cfg)]) == 0
    assert main(["train", str(cfg)]) == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "reward/brightness_mean" in r]
    assert len(train) == 2 and all(r["train/grad_norm"] > 0 for r in train)
    capsys.readouterr()
    assert main(["eval", str(cfg), str(out / "checkpoints" / "iter-000002"), "--seed", "10000", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    base, trained = res["results"].values()
    assert res["n"] == 3 and set(base["per_category"]) == {"red", "green", "blue"}
    assert base["overall"] != trained["overall"]  # the checkpoint's weights were loaded, not the base's
    end = json.load(open(out / "results.json"))["eval_end"]
    assert abs(end["overall"] - trained["overall"]) < 1e-4  # mmrl eval --seed 10000 is the trainer's own eval


def test_the_examples_satisfy_the_protocols():
    import random
    import sys

    sys.path.insert(0, EXAMPLES)
    try:
        from brightness_reward import BrightnessReward
        from color_task import ColorTask
        from tiny_generator import build
    finally:
        sys.path.remove(EXAMPLES)
    from mmrl.compose import load_config
    from mmrl.config import TaskConfig
    from mmrl.reward import Reward
    from mmrl.task import Task
    from mmrl.testing.contract import check_policy

    task = ColorTask(TaskConfig())
    assert isinstance(task, Task) and isinstance(BrightnessReward(), Reward)
    assert all("prompt" in ex for ex in task.sample(5, random.Random(0)) + task.eval_examples())
    sys.path.insert(0, EXAMPLES)
    try:
        cfg = load_config(None, ["model.policy=tiny_generator:build", "model.path=", "sampler.num_steps=4",
                                 "sampler.cfg_scale=1.0", "sampler.eval_cfg_scale=1.0"])
    finally:
        sys.path.remove(EXAMPLES)
    assert check_policy(build(cfg), task.eval_examples(), 3)["max_ratio_error"] < 1e-5


def test_your_own_objective_trains_by_name(tiny_pixel_model, tmp_path, monkeypatch):
    """docs/examples/my_objective.py named in a config with its own knob (algo.objective: {name:
    my_objective:reinforce, kwargs: {scale: 0.5}}) trains."""
    monkeypatch.syspath_prepend(EXAMPLES)
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    tr = Trainer(load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"), [
        f"model.path={tiny_pixel_model}", "algo.objective.name=my_objective:reinforce",
        "algo.objective.kwargs={scale: 0.5}", f"log.out_dir={tmp_path}",
        "log.tensorboard=false"]))
    before = [p.detach().clone() for p in tr.params]
    m = tr.step(0)
    assert m["train/clip_frac"] == 0 and any((p - q).abs().max() > 0 for p, q in zip(tr.params, before))


def test_your_own_family_loads_by_import_path(tmp_path, monkeypatch):
    """docs/examples/my_family.py (SD3 without T5) named by model.family: the policy has no T5, its prompt tokens are
    CLIP's 77 plus 256 zeros where T5's go, it samples, and its LoRA adapter loads in diffusers; validate and plan read it too."""
    from diffusers import StableDiffusion3Pipeline

    from mmrl.compose import load_config
    from mmrl.models.tiny_pipelines import build_tiny
    from mmrl.plan import plan
    from mmrl.policy import POLICIES
    from mmrl.preflight import check

    monkeypatch.syspath_prepend(EXAMPLES)
    path = str(tmp_path / "sd3")
    build_tiny("sd3").save_pretrained(path)
    cfg = load_config(None, [f"model.path={path}", "model.family=my_family:FAMILY", "model.sample_size=8",
                             "sampler.num_steps=3", "model.lora.enabled=true", "model.lora.rank=4"])
    assert check(cfg) == []
    pol = POLICIES["flow"](cfg)
    assert pol.model.family.name == "sd3_no_t5"
    assert not any(type(m).__name__ == "T5EncoderModel" for m in pol.model.text_modules)
    enc, pooled = pol.model.encode(["a red circle"])
    assert enc.shape[1] == 77 + 256 and enc[0, 77:].abs().max() == 0 and enc[0, :77].abs().max() > 0
    ro = pol.sample([{"prompt": "a red circle"}], 2, torch.Generator().manual_seed(0))
    assert ro.outputs.shape == (2, 3, 16, 16)
    pol.save_pretrained(str(tmp_path / "policy"))
    pipe = StableDiffusion3Pipeline.from_pretrained(path)
    base_params = sum(p.numel() for p in pipe.transformer.parameters())
    pipe.load_lora_weights(str(tmp_path / "policy"))  # the family's lora_pipeline wrote diffusers' format
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    full = load_config(None, [f"model.path={path}", "model.family=my_family:FAMILY", "model.sample_size=8"])
    assert plan(full)["params"] == base_params
    with pytest.raises(ValueError, match="model.family"):
        load_config(None, [f"model.path={path}", "model.family=sd33"])
