"""Learning: a known reward rises within a few CPU iterations through the real trainer."""

from mmrl.compose import load_config
from mmrl.reward import REWARDS
from mmrl.trainer import Trainer


@REWARDS.register("test_redness")
def _redness(**kw):
    """Mean red minus mean green/blue of the image, in [-2, 2]."""
    return lambda outputs, examples: {"overall": outputs[:, 0].mean((1, 2)) - outputs[:, 1:].mean((1, 2, 3))}


def test_known_reward_rises(tiny_pixel_model, tmp_path):
    cfg = load_config("configs/tiny/flow_smoke.yaml", [
        f"model.path={tiny_pixel_model}", f"log.out_dir={tmp_path}", "log.tensorboard=false",
        "reward.name=test_redness", "sampler.cfg_scale=1.0", "train.prompts_per_iter=4", "train.group_size=4",
        "train.minibatches=1", "train.lr=3e-3", "algo.clip_range=1e-2"])
    tr = Trainer(cfg)
    rewards = []
    for it in range(12):
        rewards.append(tr.step(it)["reward/overall_mean"])
        tr.iteration = it + 1
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards
