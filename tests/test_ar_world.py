"""The embedded autoregressive shapes world (issue 47): the committed Janus-class base (tasks/assets/shapes-ar-base)
loads through the janus policy, its VQ model keeps what the detector checks, it samples 36 x 36 images the shapes
reward scores, one GRPO iteration of configs/t2i/shapes_ar_grpo.yaml runs on it, and scripts/pretrain_ar_world.py
--quick writes a folder the policy loads."""

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "tasks", "assets", "shapes-ar-base")
CONFIG = os.path.join(ROOT, "configs", "t2i", "shapes_ar_grpo.yaml")
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_ar_world.py")


def examples(split: str, n: int) -> list[dict]:
    from tasks import shapes

    return [{"prompt": p.text, "category": p.spec.category} for p in shapes.balanced_prompts(split, n, seed=1234)]


@pytest.fixture(scope="module")
def script():
    """scripts/pretrain_ar_world.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("pretrain_ar_world", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def policy():
    from mmrl.compose import build_policy, load_config

    return build_policy(load_config(CONFIG, ["model.device=cpu"]))


def test_committed_base_loads_and_its_vq_keeps_the_shapes(policy, script):
    """The folder is small, loads as transformers' Janus through model.policy=janus, its VQ model's own encode gives
    each 4 x 4 patch its code in the world's patch vocabulary, and encode then decode of rendered TRAIN images keeps
    what the detector checks (originals: strict 1)."""
    from rewards.shapes import ShapesReward
    from tasks import shapes

    size = sum(os.path.getsize(os.path.join(BASE, f)) for f in os.listdir(BASE))
    info = json.load(open(os.path.join(BASE, "pretrain_info.json")))
    assert size < 8 * 2**20 and info["cfg_scale"] == policy.cfg_scale == policy.eval_cfg_scale
    assert type(policy.janus).__name__ == "JanusForConditionalGeneration" and policy.num_tokens == 81
    rng = random.Random(3)
    ps = [rng.choice(shapes.prompts("train")) for _ in range(24)]
    x = torch.stack([shapes.to_tensor(shapes.render(p.spec, 36, rng)) for p in ps])    # [24, 3, 36, 36]
    with torch.no_grad():
        codes = policy.janus.model.vqmodel.encode(x).image_tokens.view(24, -1)          # [24, 81]
    patch = torch.cdist(script.patches(x).flatten(0, 1), script.patch_vocabulary()).argmin(1).view(24, 81)
    assert torch.equal(codes, patch)
    rec = policy.decode(codes)
    assert ShapesReward()(x, [p.text for p in ps])["strict"].mean() == 1.0
    assert ShapesReward()(rec, [p.text for p in ps])["strict"].mean() >= 0.9


def test_committed_base_samples_images_the_reward_scores(policy):
    """A rollout (CFG sampling) is 36 x 36 images of 81 tokens each, with the sampler's own log-probs; the held-out
    evaluation scores well above a random-init model (strict 0, partial ~0.3) and does not depend on the batch."""
    from rewards.shapes import ShapesReward

    ro = policy.sample(examples("train", 3), 2, torch.Generator().manual_seed(0))
    assert ro.outputs.shape == (6, 3, 36, 36) and ro.extras["image_ids"].shape == (6, 81)
    assert ro.outputs.min() >= -1 and ro.outputs.max() <= 1
    r = ShapesReward()(ro.outputs, ro.examples)
    assert set(r) == {"overall", "strict", "partial"} and r["overall"].shape == (6,)
    torch.testing.assert_close(ro.extras["rollout_log_prob"], ro.old_log_prob, rtol=0, atol=1e-4)
    held = examples("heldout", 24)
    images = policy.evaluate(held, 10_000)
    # example i from seed + i: the same image in a batch of 4 as in a batch of 24 (decoding rounds differently)
    torch.testing.assert_close(images[:4], policy.evaluate(held[:4], 10_000), rtol=0, atol=1e-5)
    scores = ShapesReward()(images, held)
    assert scores["strict"].mean() > 0.1 and scores["partial"].mean() > 0.5, scores


def test_one_grpo_iteration(tmp_path):
    """configs/t2i/shapes_ar_grpo.yaml on the committed base: one iteration (2 prompts x 4 images, the partial reward
    so a group's images differ) moves the weights, with the on-policy ratio 1, then the held-out evaluation."""
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    cfg = load_config(CONFIG, [
        "model.device=cpu", f"log.out_dir={tmp_path / 'run'}", "train.iterations=1", "train.prompts_per_iter=2",
        "train.group_size=4", "train.threads=1", "task.eval_prompts=6", "reward.kwargs.strict_weight=0.0",
        "log.eval_at_start=false", "log.tensorboard=false", "log.progress=false", "log.save_every=1"])
    tr = Trainer(cfg)
    before = [p.detach().clone() for p in tr.policy.trainable_parameters()]
    res = tr.fit()
    line = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if "train/loss" in x][0]
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(tr.policy.trainable_parameters(), before))
    assert res["iterations"] == 1 and res["eval_end"]["n"] == 6 and line["train/grad_norm"] > 0 and moved > 0
    assert line["train/first_ratio_dev"] < 1e-4


def test_patches_and_their_vocabulary(script):
    """The 4 x 4 patches of an image in the VQ model's row-major token order; the world's 85 patches (background
    first) hold every patch of rendered images; H(code | patch) on hand numbers."""
    from tasks import shapes

    x = torch.arange(2 * 3 * 36 * 36, dtype=torch.float32).view(2, 3, 36, 36)
    p = script.patches(x)                                                                # [2, 81, 48]
    assert p.shape == (2, 81, 48) and torch.equal(p[1, 9 + 2], x[1, :, 4:8, 8:12].flatten())  # token row 1, column 2
    vocab = script.patch_vocabulary()
    assert vocab.shape == (85, 48) and torch.unique(vocab, dim=0).shape[0] == 85
    blank = shapes.to_tensor(shapes.render(shapes.Spec("counting", ()), 36))[None]     # no objects: the background
    assert torch.equal(vocab[0], script.patches(blank)[0, 40])
    rng = random.Random(0)
    imgs = torch.stack([shapes.to_tensor(shapes.render(rng.choice(shapes.prompts("all")).spec, 36, rng))
                        for _ in range(64)])
    assert torch.cdist(script.patches(imgs).flatten(0, 1), vocab).min(1).values.max() < 1e-2
    h = script.conditional_entropy
    assert h(torch.tensor([0, 1, 0, 1]), torch.tensor([0, 0, 0, 0])) == pytest.approx(0.693147, abs=1e-6)  # log 2
    assert h(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.346574, abs=1e-6)  # log 2 / 2
    assert h(torch.tensor([3, 5, 3]), torch.tensor([0, 1, 0])) == 0.0


def test_pretraining_loss_is_the_policys_log_prob(script, policy):
    """Without CFG the pretraining cross-entropy is minus the mean log-prob the janus policy gives the same codes
    (one scoring path for pretraining and RL); a dropped prompt is the policy's unconditional one."""
    from mmrl.data import Rollout

    texts, x = script.Data(random.Random(1)).batch(3)
    codes = script.tokenize(policy.janus.model.vqmodel, x)                              # [3, 81]
    no_drop = torch.zeros(3, dtype=torch.bool)
    ro = Rollout(group_id=torch.arange(3), old_log_prob=torch.zeros(3, 81),
                 action_mask=torch.ones(3, 81, dtype=torch.bool), examples=[{"prompt": t} for t in texts],
                 outputs=x, extras={"image_ids": codes})
    scale = policy.cfg_scale
    try:
        policy.cfg_scale = 1.0
        with torch.no_grad():
            want = -policy.log_prob(ro, torch.arange(3)).log_prob.mean()
            got = script.lm_loss(policy, policy.janus.model.vqmodel, texts, x, no_drop)
            dropped = script.lm_loss(policy, policy.janus.model.vqmodel, texts, x, torch.ones(3, dtype=torch.bool))
    finally:
        policy.cfg_scale = scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert dropped > got  # the prompt tells the model what to draw


def test_pretrain_script_quick(script, tmp_path):
    """--quick (a tiny model, 3 VQ and 3 language-model steps) writes a folder with its log that the janus policy
    loads and samples from; --help works as a user runs it."""
    from mmrl.compose import build_policy, load_config

    out = str(tmp_path / "ar-base")
    info = script.main(["--quick", "--out", out])
    assert info["vq_steps"] == 3 and info["lm_steps"] == 3 and info["cfg_scale"] in (1.0, 2.0)
    log = [json.loads(x) for x in open(out + ".log.jsonl")]
    assert [r["phase"] for r in log] == ["vq", "vq", "vq", "lm", "lm", "eval"]
    pol = build_policy(load_config(CONFIG, ["model.device=cpu", f"model.path={out}"]))
    ro = pol.sample(examples("train", 1), 2, torch.Generator().manual_seed(0))
    assert ro.outputs.shape == (2, 3, 36, 36)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, SCRIPT, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "usage" in r.stdout
