"""Offline Diffusion-DPO from a preference file (tasks/preference.py): pairs in both layouts, the given outputs
encoded as final samples instead of sampled, the labels as rewards, and DPO training on them."""

import json
import random

import pytest
import torch

from mmrl.compose import load_config
from mmrl.policy import POLICIES
from tasks import shapes
from tasks.preference import read_pairs


def write_pairs(folder, n: int = 6, pick_a_pic: bool = False, size: int = 24) -> str:
    """The shapes world's renders of each prompt (chosen) against renders of another prompt (rejected)."""
    prompts = [p.text for p in shapes.prompts("train")][:n]
    (folder / "img").mkdir(exist_ok=True)
    rows = []
    for i, text in enumerate(prompts):
        good, bad = f"img/{i}_good.png", f"img/{i}_bad.png"
        shapes.render(shapes.parse(text), size, random.Random(i)).save(folder / good)
        shapes.render(shapes.parse(prompts[(i + 1) % n]), size, random.Random(i)).save(folder / bad)
        rows.append({"caption": text, "jpg_0": bad, "jpg_1": good, "label_0": 0} if pick_a_pic
                    else {"prompt": text, "chosen": good, "rejected": bad})
    if pick_a_pic:
        rows.append({"caption": prompts[0], "jpg_0": rows[0]["jpg_0"], "jpg_1": rows[0]["jpg_1"], "label_0": 0.5})
    path = folder / ("pap.jsonl" if pick_a_pic else "pairs.jsonl")
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_both_layouts_read_to_chosen_then_rejected(tmp_path):
    plain, pap = read_pairs(write_pairs(tmp_path)), read_pairs(write_pairs(tmp_path, pick_a_pic=True))
    assert len(plain) == 6 and len(pap) == 6  # Pick-a-Pic's tie is skipped
    for a, b in zip(plain, pap):
        assert a["prompt"] == b["prompt"] and a["outputs"] == b["outputs"] and a["labels"] == [1.0, 0.0]
        assert a["outputs"][0].endswith("_good.png")  # label_0 = 0 means jpg_1 won
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "chosen": "nope.png", "rejected": "no.png"}))
    with pytest.raises(FileNotFoundError, match="bad.jsonl:1: image"):
        read_pairs(str(tmp_path / "bad.jsonl"))


def config(model, pairs, *items):
    return load_config(None, [f"model.path={model}", "task.name=preference_pairs", f"task.prompt_file={pairs}",
                              "reward.name=preference_label", "reward.eval_name=shapes", "algo.objective.name=dpo", "sampler.cfg_scale=1.0",
                              "algo.advantage=grpo", "sampler.kind=ode", "sampler.shared_noise=false",
                              "sampler.num_steps=4", "sampler.cfg_scale=1.0", "sampler.eval_cfg_scale=1.0",
                              "sampler.eval_steps=4", "train.group_size=2", "train.prompts_per_iter=2",
                              "train.minibatches=1", "algo.kl=flow_velocity", *items])


def test_given_outputs_are_the_final_samples(tiny_pixel_model, tmp_path):
    """The rollout's final samples are the pair's images (pixel model: x0 = the image in [-1, 1]); each row gets its
    label; forward-process actions are drawn around them; sampled (not given) rows are refused by the label reward."""
    from mmrl.compose import build_task
    from tasks.preference import PreferenceLabel

    cfg = config(tiny_pixel_model, write_pairs(tmp_path))
    pol, task = POLICIES["flow"](cfg), build_task(cfg.task)
    examples = task.sample(2, random.Random(0))
    ro = pol.sample(examples, 2, torch.Generator().manual_seed(0))
    assert ro.outputs.shape == (4, 3, 24, 24)
    assert [ex["label"] for ex in ro.examples] == [1.0, 0.0, 1.0, 0.0]
    assert PreferenceLabel()(ro.outputs, ro.examples)["overall"].tolist() == [1.0, 0.0, 1.0, 0.0]
    x0 = ro.extras["latents"] - ro.extras["sigma"][..., None, None, None] * (ro.extras["target"])  # x_t - t(eps - x0)
    torch.testing.assert_close(x0[:, 0], ro.outputs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="group_size=3 must equal"):
        pol.sample(examples, 3, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="preference_pairs"):
        PreferenceLabel()(ro.outputs, [{"prompt": "a"}] * 4)


def test_offline_dpo_trains_on_the_pairs(tiny_pixel_model, tmp_path):
    """Two iterations of offline DPO: every group is a pair, the DPO margin is logged, the weights move."""
    from mmrl.trainer import Trainer

    cfg = config(tiny_pixel_model, write_pairs(tmp_path), "train.iterations=2", f"log.out_dir={tmp_path / 'run'}",
                 "log.tensorboard=false", "log.progress=false", "log.eval_at_start=false", "task.eval_prompts=2")
    tr = Trainer(cfg)
    before = [p.detach().clone() for p in tr.params]
    m = tr.step(0)
    assert m["train/dpo_paired"] == 1.0 and m["reward/overall_mean"] == 0.5
    assert torch.isfinite(torch.tensor(m["train/loss"]))
    assert any((p - q).abs().max() > 0 for p, q in zip(tr.params, before))


def test_latent_families_encode_the_images(tmp_path):
    """SD3 (a VAE): the pair's images are VAE-encoded to x0 [16, 8, 8] at the output size (16 px for the tiny VAE)."""
    from mmrl.models.tiny_pipelines import build_tiny

    path = str(tmp_path / "sd3")
    build_tiny("sd3").save_pretrained(path)
    pol = POLICIES["flow"](config(path, write_pairs(tmp_path, size=40), "model.sample_size=8"))
    ro = pol.sample(read_pairs(str(tmp_path / "pairs.jsonl"))[:1], 2, torch.Generator().manual_seed(0))
    assert ro.outputs.shape == (2, 3, 16, 16) and ro.extras["latents"].shape[-3:] == (16, 8, 8)
