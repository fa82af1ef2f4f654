"""The embedded motion text-to-video world: grammar and split, the clip renderer, the centroid tracker reward
(exact on rendered ground truth, hand cases), the pixel-space Wan video model through the flow policy and
the trainer (video strips in TensorBoard)."""

import random

import numpy as np
import pytest
import torch

from mmrl.compose import load_config
from mmrl.policy import POLICIES
from rewards.motion import MotionReward, score
from tasks import motion as M
from mmrl.testing.contract import check_policy


def test_grammar_split_and_render():
    ps = M.all_prompts()
    assert len(ps) == 2 * 4 * 4 * len(M.TEMPLATES)
    train, held = {p.text for p in M.prompts("train")}, {p.text for p in M.prompts("heldout")}
    assert train and held and not train & held and train | held == {p.text for p in ps}
    assert M.parse("a video of a red circle moving left") == M.MotionSpec("circle", "red", "left")
    with pytest.raises(ValueError, match="not a motion prompt"):
        M.parse("a red circle")
    bal = M.balanced_prompts("heldout", 8, seed=0)
    assert [p.spec.direction for p in bal] == list(M.DIRECTIONS) * 2 and all(p.text in held for p in bal)
    clip = M.render(M.MotionSpec("square", "blue", "down"), rng=random.Random(0))
    assert clip.shape == (3, M.FRAMES, M.SIZE, M.SIZE) and clip.min() >= -1 and clip.max() <= 1


def test_reward_exact_on_rendered_clips():
    rng = random.Random(0)
    ps = M.all_prompts()[::3]
    clips = torch.stack([M.render(p.spec, rng=rng) for p in ps])
    texts = [p.text for p in ps]
    out = MotionReward()(clips, texts)
    assert out["correct"].tolist() == [1.0] * len(ps)
    assert out["along"].mean().item() == pytest.approx(M.TRAVEL, abs=0.02)  # the tracked path is the drawn one
    for flip in (clips.flip(2), clips[:, :, :1].expand_as(clips)):  # reversed, static
        assert MotionReward()(flip, texts)["correct"].sum() == 0
    wrong = [t.replace(p.spec.direction, {"left": "up", "right": "down", "up": "right", "down": "left"}[p.spec.direction])
             for t, p in zip(texts, ps)]
    assert MotionReward()(clips, wrong)["correct"].sum() == 0


def test_score_by_hand():
    # found in 4 of 4 frames, moving right by 1, 1, 3 px: net +5 px on a 16-px frame, 1 px sideways
    c = np.array([[2, 5], [3, 5], [4, 5], [7, 6]], dtype=np.float32)
    s = score(c, "right", 16)
    assert s == {"correct": 1.0, "found": 1.0, "progress": pytest.approx(5 / 6.4), "smooth": 1.0, "along": 5 / 16}
    c[2] = [1, 5]  # a step back: smooth 2/3; still net +5
    assert score(c, "right", 16)["smooth"] == pytest.approx(2 / 3)
    c[1:3] = np.nan  # found in half the frames: not correct
    s = score(c, "right", 16)
    assert s["found"] == 0.5 and s["correct"] == 0.0
    assert score(c, "left", 16)["progress"] == 0.0 and score(c, "left", 16)["along"] == -5 / 16
    r = MotionReward(correct_weight=0.5)
    out = r(torch.zeros(1, 3, 4, 8, 8), ["a red circle moving up"])  # gray: nothing found
    assert out["overall"].item() == 0.0 and out["found"].item() == 0.0
    with pytest.raises(ValueError, match="videos"):
        r(torch.zeros(1, 3, 8, 8), ["a red circle moving up"])


def test_video_policy_contract(tiny_motion_model):
    cfg = load_config("configs/t2v/motion_grpo.yaml", [f"model.path={tiny_motion_model}", "sampler.num_steps=4"])
    pol = POLICIES["flow"](cfg)
    ex = [{"prompt": "a red circle moving left"}, {"prompt": "a blue square moving up"}]
    ro = pol.sample(ex, 3, torch.Generator().manual_seed(0))
    assert check_policy(pol, ex, 3)["max_ratio_error"] < 1e-5  # the shared contract
    assert ro.outputs.shape == (6, 3, M.FRAMES, 16, 16) and ro.extras["latents"].shape[2:] == (3, M.FRAMES, 16, 16)
    assert torch.equal(pol.sample(ex, 3, torch.Generator().manual_seed(0)).outputs, ro.outputs)
    assert (pol.log_prob(ro, torch.arange(6)).log_prob - ro.old_log_prob).abs().max() < 1e-5
    assert MotionReward()(ro.outputs, ex * 3)["overall"].shape == (6,)


@pytest.mark.parametrize("config", ["motion_grpo", "motion_grpo_ema", "motion_branchgrpo"])
def test_motion_config_smoke_with_video_strips(config, tiny_motion_model, tmp_path):
    from mmrl.trainer import Trainer

    group = 8 if "branch" in config else 3
    cfg = load_config(f"configs/t2v/{config}.yaml", [
        f"model.path={tiny_motion_model}", f"log.out_dir={tmp_path}", "log.progress=false", "train.iterations=2",
        "train.time_budget_min=0", "train.prompts_per_iter=2", f"train.group_size={group}", "task.eval_prompts=8",
        "log.image_every=1", "sampler.eval_steps=4"])
    res = Trainer(cfg).fit()
    assert res["iterations"] == 2 and 0.0 <= res["eval_end"]["correct"] <= 1.0
    assert set(res["eval_end"]["per_category"]) == set(M.DIRECTIONS)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "samples" in acc.Tags()["images"]
    img = acc.Images("samples")[0]
    k = min(2 * group, 32)
    assert (img.width, img.height) == (2 + M.FRAMES * 16, 1 + k * 17)  # one strip of 8 frames per video row


def test_committed_motion_base_loads_and_generates():
    from mmrl.models.pipelines import load_flow_model

    model = load_flow_model("tasks/assets/motion-base")
    assert model.latent_shape == (3, M.FRAMES, M.SIZE, M.SIZE)
    clips = model.generate(["a red circle moving left"], [0], num_steps=2, cfg_scale=1.0)
    assert clips.shape == (1, 3, M.FRAMES, M.SIZE, M.SIZE) and torch.isfinite(clips).all()


def test_coordinate_channels(tmp_path):
    """wan_coord_call feeds fixed frame/row/column ramps as 3 extra input channels; the saved folder records it
    and loads with that call; without the key (older bases) the plain call is used, which a 6-channel model refuses."""
    import json

    from mmrl.models.families.pixel import coordinates, wan_call, wan_coord_call
    from mmrl.models.pixel_t2i import build_pipeline_parts, save_pipeline_parts
    from mmrl.models.pipelines import load_flow_model

    c = coordinates(torch.zeros(2, 3, 3, 2, 5))                                  # [N, 3, F, H, W]
    assert c.shape == (2, 3, 3, 2, 5)
    assert c[0, 0, :, 0, 0].tolist() == [-1, 0, 1] and c[1, 1, 0, :, 0].tolist() == [-1, 1]
    assert c[0, 2, 0, 0].tolist() == [-1, -0.5, 0, 0.5, 1] and (c[:, 2] == c[:, 2, :1, :1]).all()

    torch.manual_seed(0)
    words = sorted({w for p in M.all_prompts() for w in p.text.split()})
    path = str(tmp_path / "coord")
    save_pipeline_parts(build_pipeline_parts(words, "tiny", 16, patch_size=4, frames=M.FRAMES, coordinates=True), path)
    index = json.load(open(f"{path}/model_index.json"))
    assert index["coordinates"] is True and index["channels"] == 3
    model = load_flow_model(path)
    assert model.call is wan_coord_call and model.latent_shape == (3, M.FRAMES, 16, 16)
    assert model.transformer.config.in_channels == 6
    enc, pooled = model.encode_prompts(["a red circle moving left"])
    v = model.velocity(torch.zeros(1, 3, M.FRAMES, 16, 16), torch.ones(1), enc, pooled)  # [1, 3, F, H, W]
    assert v.shape == (1, 3, M.FRAMES, 16, 16)
    assert v[0, :, 0, :4, :4].sub(v[0, :, -1, -4:, -4:]).abs().max() > 1e-3  # same input, different places
    index.pop("coordinates")
    json.dump(index, open(f"{path}/model_index.json", "w"))
    plain = load_flow_model(path)
    assert plain.call is wan_call
    with pytest.raises(RuntimeError):  # a 6-channel transformer called without its coordinates
        plain.generate(["a red circle moving left"], [0], num_steps=1, cfg_scale=1.0)
    assert load_flow_model("tasks/assets/motion-base").call is wan_coord_call  # the committed base has them
