"""Online Diffusion-DPO (mmrl/algorithms/dpo.py) on each group's best and worst sample, against hand-computed numbers."""

import math
from types import SimpleNamespace

import torch

from mmrl.algorithms import POLICY_LOSSES
from mmrl.algorithms.dpo import DPOKnobs


def test_dpo_by_hand():
    # group 0: rows 0-2 (winner row 1, loser row 2); group 1: rows 3-4 with equal advantages (no pair)
    l_theta = torch.tensor([[0.5], [0.30], [0.60], [0.2], [0.2]])
    l_ref = torch.tensor([[0.5], [0.40], [0.50], [0.1], [0.3]])
    adv = torch.tensor([0.1, 1.2, -1.3, 0.0, 0.0])
    logp = (-l_theta).clone().requires_grad_()
    ctx = SimpleNamespace(ref=SimpleNamespace(log_prob=-l_ref), group_id=torch.tensor([0, 0, 0, 1, 1]))
    loss, s = POLICY_LOSSES["dpo"](logp, logp.detach(), adv, DPOKnobs(dpo_beta=10.0), ctx)
    z = -(10 / 2) * ((0.30 - 0.40) - (0.60 - 0.50))                        # = 1.0
    expected = -math.log(1 / (1 + math.exp(-z)))                          # -log sigmoid(1) = 0.313262
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.0], [expected], [0.0], [0.0], [0.0]]))
    assert s["dpo_paired"][:, 0].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    loss.sum().backward()
    # d/d logp_w = d/d(-l_w): -(beta/2) * sigmoid(-z)... by the chain rule: dL/dz = -sigmoid(-z), dz/dl_w = -beta/2
    g = (1 / (1 + math.exp(z))) * (10 / 2)                                # dL/dl_w = sigmoid(-z) * beta / 2
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor([0.0, -g, g, 0.0, 0.0]))


def test_online_dpo_trains(tiny_pixel_model, tmp_path):
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    tr = Trainer(load_config("configs/tiny/flow_smoke.yaml", [
        f"model.path={tiny_pixel_model}", "algo.objective.name=dpo", "sampler.cfg_scale=1.0", "sampler.kind=ode", "model.reference=auto",
        "train.minibatches=1", f"log.out_dir={tmp_path}", "log.tensorboard=false", "train.inner_epochs=2"]))
    before = [p.detach().clone() for p in tr.params]
    m = tr.step(0)
    assert 0 < m["train/dpo_paired"] <= 1 and math.isfinite(m["train/loss"])
    assert any((p - q).abs().max() > 0 for p, q in zip(tr.params, before))
