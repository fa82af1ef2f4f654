"""DGPO (mmrl/algorithms/dgpo.py): the group weight and loss against hand-computed numbers, its gradient against
autograd of the group loss -log sigmoid(-(beta / G) D_g) itself, the clip, and a short training run."""

import math
from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms import POLICY_LOSSES
from mmrl.algorithms.dgpo import DGPOKnobs


def call(l_theta, l_ref, adv, gid, old=None, beta=2.0, clip=10.0):
    logp = (-l_theta).clone().requires_grad_()
    ctx = SimpleNamespace(ref=SimpleNamespace(log_prob=-l_ref), group_id=gid)
    old = logp.detach() if old is None else old
    loss, s = POLICY_LOSSES["dgpo"](logp, old, adv, DGPOKnobs(clip_range=clip, dgpo_beta=beta), ctx)
    return logp, loss, s


def test_group_weight_and_loss_by_hand():
    # one group of 2, one action: D = 1 * (0.5 - 0.4) + (-1) * (0.3 - 0.4) = 0.2; w = sigmoid(2 / 2 * 0.2)
    logp, loss, s = call(torch.tensor([[0.5], [0.3]]), torch.tensor([[0.4], [0.4]]), torch.tensor([1.0, -1.0]),
                         torch.tensor([7, 7]))
    w = 1 / (1 + math.exp(-0.2))                                              # 0.549834
    torch.testing.assert_close(s["dgpo_weight"], torch.full((2, 1), w))
    torch.testing.assert_close(loss.detach(), torch.tensor([[w * 0.5], [-w * 0.3]]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-w], [w]]))          # d(w A l)/d(-l) = -w A


def test_gradient_is_the_group_losses_gradient():
    """Two groups of 3, 2 actions: grad of sum_i L_i equals (G / beta) grad of sum_g,j -log sigmoid(-(beta/G) D_gj)."""
    g = torch.Generator().manual_seed(0)
    l_theta, l_ref = torch.rand(6, 2, generator=g), torch.rand(6, 2, generator=g)
    adv, gid, beta = torch.randn(6, generator=g), torch.tensor([0, 0, 0, 5, 5, 5]), 3.0
    logp, loss, _ = call(l_theta, l_ref, adv, gid, beta=beta)
    loss.sum().backward()
    lt = l_theta.clone().requires_grad_()
    d = torch.stack([(adv[gid == k, None] * (lt[gid == k] - l_ref[gid == k])).sum(0) for k in (0, 5)])  # [2, 2]
    (-torch.nn.functional.logsigmoid(-(beta / 3) * d)).sum().backward()
    torch.testing.assert_close(-logp.grad, lt.grad * 3 / beta)                # d/dl = -d/dlogp


def test_the_clip_stops_a_sample_that_moved_too_far():
    old = torch.tensor([[-0.5], [-0.3]])  # ratio exp(logp - old): sample 0 at exp(-0.5 + 0.6) = 1.105 > 1.05
    logp, loss, s = call(torch.tensor([[0.4], [0.3]]), torch.tensor([[0.4], [0.4]]), torch.tensor([1.0, -1.0]),
                         torch.tensor([0, 0]), old=old, clip=0.05)
    assert s["clipped"].tolist() == [[1.0], [0.0]]
    loss.sum().backward()
    assert logp.grad[0, 0] == 0 and logp.grad[1, 0] != 0


def test_dgpo_trains_and_refuses_partial_groups(tiny_pixel_model, tmp_path):
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    over = [f"model.path={tiny_pixel_model}", "algo.objective.name=dgpo", "sampler.cfg_scale=1.0", "sampler.kind=ode", "model.reference=auto",
            "train.minibatches=1", f"log.out_dir={tmp_path}", "log.tensorboard=false"]
    tr = Trainer(load_config("configs/tiny/flow_smoke.yaml", over))
    before = [p.detach().clone() for p in tr.params]
    m = tr.step(0)
    assert any((p - q).abs().max() > 0 for p, q in zip(tr.params, before))
    assert 0 < m["train/dgpo_weight"] < 1 and math.isfinite(m["train/loss"])
    with pytest.raises(ValueError, match="whole groups"):
        load_config("configs/tiny/flow_smoke.yaml", over + ["train.minibatches=2"])
    with pytest.raises(ValueError, match="model.reference=auto"):
        load_config("configs/tiny/flow_smoke.yaml", over + ["model.reference=none"])
