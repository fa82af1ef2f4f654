"""train.sampling_ema: rollouts sample with a soft-updated old policy (DiffusionNFT's theta_old), by hand numbers,
inside the trainer, and across a resume."""

import shutil

import pytest
import torch

from mmrl.compose import load_config
from mmrl.optim import EMA, soft_update_decay
from mmrl.trainer import Trainer


def test_soft_update_schedule_by_hand():
    assert soft_update_decay(0, 0.001, 0.5) == 0.0  # the first rollout samples with the weights themselves
    assert soft_update_decay(100, 0.001, 0.5) == pytest.approx(0.1)
    assert soft_update_decay(499, 0.001, 0.5) == pytest.approx(0.499)
    assert soft_update_decay(5000, 0.001, 0.5) == 0.5  # capped


def test_ema_update_with_this_steps_decay_by_hand():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = EMA([p], decay=0.9)
    with torch.no_grad():
        p.copy_(torch.tensor([3.0, -2.0]))
    ema.update(0.25)  # 0.25 x [1, 2] + 0.75 x [3, -2]
    assert torch.allclose(ema.shadow[0], torch.tensor([2.5, -1.0]))
    ema.update()  # the constant decay: 0.9 x [2.5, -1] + 0.1 x [3, -2]
    assert torch.allclose(ema.shadow[0], torch.tensor([2.55, -1.1]))


def cfg(model, out, *items):
    return load_config("configs/tiny/flow_smoke.yaml", [
        f"model.path={model}", f"log.out_dir={out}", "log.tensorboard=false", "log.eval_at_start=false",
        "algo.objective.name=nft", "sampler.cfg_scale=1.0", "sampler.kind=ode", "sampler.cfg_scale=1.0", "train.minibatches=1",
        "train.sampling_ema=[0.5,0.5]", *items])


def test_rollouts_sample_with_the_soft_updated_copy_and_resume_exactly(tiny_pixel_model, tmp_path):
    tr = Trainer(cfg(tiny_pixel_model, tmp_path / "a", "train.iterations=3", "log.save_every=2"))
    assert not tr.policy.defer_old_log_prob  # the rollout's old log-probs are the sampling copy's, not the trainer's
    tr.fit()
    theta = [p.detach().clone() for p in tr.params]
    old = [s.clone() for s in tr.sampling.shadow]
    assert max((t - o).abs().max().item() for t, o in zip(theta, old)) > 0  # the copy lags the weights
    with torch.no_grad():  # the update by hand: eta = min(0.5 x 3, 0.5) at iteration 3
        expect = [0.5 * o + 0.5 * t for o, t in zip(old, theta)]
        with tr.sampling_weights(3):  # inside: the copy is in the policy
            assert all(torch.allclose(p, e, atol=1e-7) for p, e in zip(tr.params, expect))
        assert all(torch.equal(p, t) for p, t in zip(tr.params, theta))  # the weights are back after

    shutil.copytree(tmp_path / "a" / "checkpoints" / "iter-000002", tmp_path / "b" / "checkpoints" / "iter-000002")
    resumed = Trainer(cfg(tiny_pixel_model, tmp_path / "b", "train.iterations=3", "log.save_every=2"))
    assert resumed.resume() and resumed.iteration == 2
    resumed.fit()
    for a, b in zip(theta, resumed.params):
        assert torch.equal(a, b.detach())
    for a, b in zip(old, resumed.sampling.shadow):
        assert torch.equal(a, b)
