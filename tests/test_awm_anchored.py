"""AWM with an anchored negative branch (mmrl/algorithms/awm_anchored.py): the loss and its gradients against
hand-computed numbers, AWM's gradient at the anchor, the finite minimum of the negative branch, and a training step."""

import math
from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms import POLICY_LOSSES
from mmrl.algorithms.awm_anchored import AWMAnchoredKnobs
from mmrl.config import AlgoConfig


def call(v, target, anchor, adv, old=None, beta=1.0, clip=10.0):
    """v, target, anchor [n, 1, D] (one action per row); log_prob = -mean_d (v - target)^2 as the flow policy's."""
    v = v.clone().requires_grad_()
    logp = -(v - target).pow(2).flatten(2).mean(-1)
    ctx = SimpleNamespace(out=SimpleNamespace(stats={"velocity": v, "target": target}),
                          ref=SimpleNamespace(stats={"velocity": anchor}), group_id=torch.zeros(len(v)))
    old = logp.detach() if old is None else old
    knobs = AWMAnchoredKnobs(clip_range=clip, clip_range_high=None, clip_ratio_c=3.0, nft_beta=beta)
    loss, stats = POLICY_LOSSES["awm_anchored"](logp, old, adv, knobs, ctx)
    return v, loss, stats


def test_negative_branch_by_hand():
    # anchor (1, 0), v (1.5, 0.5), target (0, 1), beta 1: v- = 2 a - v = (0.5, -0.5), v- - target = (0.5, -1.5),
    # l(v-) = (0.25 + 2.25) / 2 = 1.25; A = -2: L = 2 * 1.25 = 2.5;
    # dL/dv = |A| / beta * (2 / D) (v- - target) * (-beta) = -2 * (0.5, -1.5) = (-1, 3)
    v, loss, s = call(torch.tensor([[[1.5, 0.5]]]), torch.tensor([[[0.0, 1.0]]]), torch.tensor([[[1.0, 0.0]]]),
                      torch.tensor([-2.0]))
    torch.testing.assert_close(loss.detach(), torch.tensor([[2.5]]))
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[[-1.0, 3.0]]]))
    torch.testing.assert_close(s["awm_anchor_gap"], torch.tensor([[0.25]]))        # ((0.5)^2 + 0.5^2) / 2
    values, mask = s["awm_negative_loss"]
    assert values.item() == pytest.approx(1.25) and mask.tolist() == [[True]]


def test_negative_branch_beta_half_by_hand():
    # beta 0.5: v- = 1.5 a - 0.5 v = (0.75, -0.25), v- - target = (0.75, -1.25), l = (0.5625 + 1.5625) / 2 = 1.0625;
    # A = -1: L = 1.0625 / 0.5 = 2.125; dL/dv = -(2 / D) (v- - target) = (-0.75, 1.25)
    v, loss, _ = call(torch.tensor([[[1.5, 0.5]]]), torch.tensor([[[0.0, 1.0]]]), torch.tensor([[[1.0, 0.0]]]),
                      torch.tensor([-1.0]), beta=0.5)
    torch.testing.assert_close(loss.detach(), torch.tensor([[2.125]]))
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[[-0.75, 1.25]]]))


def test_positive_branch_is_awm():
    # v (1, 2), target (0, 0): l = 2.5, log_prob -2.5; old -2.6: r = exp(0.1) = 1.10517; A = 2, clip 0.2 (not hit):
    # L = -r A = -2.21034; dL/dv = -A r d(-l)/dv = A r (2 / D)(v - target) = 2 * 1.10517 * (1, 2)
    args = (torch.tensor([[[1.0, 2.0]]]), torch.tensor([[[0.0, 0.0]]]), torch.tensor([[[5.0, 5.0]]]), torch.tensor([2.0]))
    v, loss, s = call(*args, old=torch.tensor([[-2.6]]), clip=0.2)
    r = math.exp(0.1)
    torch.testing.assert_close(loss.detach(), torch.tensor([[-2 * r]]))
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([[[2 * r, 4 * r]]]))
    v2, loss2, _ = call(*args, old=torch.tensor([[-2.6]]), clip=0.2)
    awm, _ = POLICY_LOSSES["awm"](-(v2 - args[1]).pow(2).flatten(2).mean(-1), torch.tensor([[-2.6]]), args[3],
                                  AlgoConfig(clip_range=0.2))
    torch.testing.assert_close(loss2, awm)                                           # the anchor plays no part
    # past the clip (r = exp(0.1) > 1 + 0.05) a positive row gives no gradient, as in AWM
    v3, loss3, s3 = call(*args, old=torch.tensor([[-2.6]]), clip=0.05)
    loss3.sum().backward()
    assert v3.grad.abs().max() == 0 and s3["clipped"].item() == 1.0


def test_equals_awm_gradient_at_the_anchor():
    """v_theta = v_a: every row's gradient is AWM's, A (2 / D)(v - target), whatever the sign of A."""
    g = torch.Generator().manual_seed(0)
    v0, target = torch.randn(6, 1, 5, generator=g), torch.randn(6, 1, 5, generator=g)
    adv = torch.tensor([1.5, -0.5, 0.0, -2.0, 0.7, -1.1])
    v, loss, _ = call(v0, target, v0.clone(), adv, beta=0.7)
    loss.sum().backward()
    v_awm = v0.clone().requires_grad_()
    awm, _ = POLICY_LOSSES["awm"](-(v_awm - target).pow(2).flatten(2).mean(-1), -(v0 - target).pow(2).flatten(2).mean(-1),
                                  adv, AlgoConfig(clip_range=10.0))
    awm.sum().backward()
    torch.testing.assert_close(v.grad, v_awm.grad)


def test_negative_branch_has_a_finite_minimum():
    """AWM's negative term falls without bound as v moves away from the target; the anchored one is a bowl whose
    minimum is v = a + (a - target) / beta."""
    a, target, beta = torch.tensor([[[1.0, -1.0]]]), torch.tensor([[[0.0, 0.5]]]), 0.5
    vmin = a + (a - target) / beta                                                    # (3, -4)
    v, loss, _ = call(vmin, target, a, torch.tensor([-1.0]), beta=beta)
    loss.sum().backward()
    assert v.grad.abs().max() < 1e-6 and loss.item() == pytest.approx(0.0, abs=1e-6)
    far = vmin + torch.tensor([[[10.0, 10.0]]])
    _, loss_far, _ = call(far, target, a, torch.tensor([-1.0]), beta=beta)
    assert loss_far.item() > 1                                                        # pushed back
    awm_far, _ = POLICY_LOSSES["awm"](-(far - target).pow(2).flatten(2).mean(-1), torch.tensor([[-0.5]]),
                                      torch.tensor([-1.0]), AlgoConfig(clip_range=1e9))
    awm_near, _ = POLICY_LOSSES["awm"](-(vmin - target).pow(2).flatten(2).mean(-1), torch.tensor([[-0.5]]),
                                       torch.tensor([-1.0]), AlgoConfig(clip_range=1e9))
    assert awm_far.item() < awm_near.item()                                           # AWM: further is lower


def test_refuses_without_reference():
    v = torch.zeros(1, 1, 2, requires_grad=True)
    ctx = SimpleNamespace(out=SimpleNamespace(stats={"velocity": v, "target": v.detach()}), ref=None,
                          group_id=torch.zeros(1))
    with pytest.raises(ValueError, match="reference"):
        POLICY_LOSSES["awm_anchored"](torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([-1.0]),
                                      AWMAnchoredKnobs(clip_range=1.0, clip_range_high=None, clip_ratio_c=3.0), ctx)


def test_trains_with_the_ema_anchor(tiny_pixel_model, tmp_path):
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    over = [f"model.path={tiny_pixel_model}", "algo.objective.name=awm_anchored", "sampler.cfg_scale=1.0", "sampler.kind=ode",
            "algo.kl_reference=ema", "train.ema_decay=0.9", f"log.out_dir={tmp_path}", "log.tensorboard=false"]
    tr = Trainer(load_config("configs/tiny/flow_smoke.yaml", over))
    before = [p.detach().clone() for p in tr.params]
    m = tr.step(0)
    assert any((p - q).abs().max() > 0 for p, q in zip(tr.params, before))
    assert math.isfinite(m["train/loss"]) and m["train/awm_anchor_gap"] >= 0
    with pytest.raises(ValueError, match="reference"):
        load_config("configs/tiny/flow_smoke.yaml", over + ["train.ema_decay=0"])
    cfg = load_config("configs/t2i/shapes_awm_anchored.yaml", [])
    assert cfg.algo.objective.name == "awm_anchored" and cfg.algo.clip_range == 1e-3 and cfg.train.ema_decay == 0.97
    assert cfg.algo.objective.kwargs["anchor"] == "ema" and cfg.algo.kl_reference == "base"
    assert cfg.algo.kl == "flow_velocity" and cfg.algo.kl_coef == 0.25


def test_ema_anchor_is_read_instead_of_the_reference():
    """kwargs.anchor=ema: the negative branch is anchored at ctx.anchor (the EMA's velocity); ctx.ref (the KL's
    reference, e.g. the frozen base) plays no part in it. Same numbers as test_negative_branch_by_hand."""
    v = torch.tensor([[[1.5, 0.5]]], requires_grad=True)
    target = torch.tensor([[[0.0, 1.0]]])
    logp = -(v - target).pow(2).flatten(2).mean(-1)
    ctx = SimpleNamespace(out=SimpleNamespace(stats={"velocity": v, "target": target}),
                          ref=SimpleNamespace(stats={"velocity": torch.full((1, 1, 2), 9.0)}),
                          anchor=SimpleNamespace(stats={"velocity": torch.tensor([[[1.0, 0.0]]])}),
                          group_id=torch.zeros(1))
    knobs = AWMAnchoredKnobs(clip_range=10.0, clip_range_high=None, clip_ratio_c=3.0, anchor="ema")
    loss, s = POLICY_LOSSES["awm_anchored"](logp, logp.detach(), torch.tensor([-2.0]), knobs, ctx)
    torch.testing.assert_close(loss, torch.tensor([[2.5]]))
    torch.testing.assert_close(s["awm_anchor_gap"], torch.tensor([[0.25]]))
    with pytest.raises(ValueError, match="anchor must be reference or ema"):
        AWMAnchoredKnobs(clip_range=1.0, clip_range_high=None, clip_ratio_c=3.0, anchor="base")


def test_ema_anchor_beside_a_kl_to_the_base(tiny_pixel_model, tmp_path):
    """The trainer runs the EMA for the anchor and the frozen base for the KL: after the first optimizer steps the
    EMA lags the weights, so the anchor gap is > 0, and the KL to the base is > 0."""
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    over = [f"model.path={tiny_pixel_model}", "algo.objective.name=awm_anchored", "sampler.cfg_scale=1.0", "sampler.kind=ode",
            "algo.objective.kwargs={anchor: ema}", "algo.kl_reference=base", "model.reference=auto",
            "algo.kl_coef=0.05", "algo.kl=flow_velocity", "train.ema_decay=0.9", "train.minibatches=2",
            f"log.out_dir={tmp_path}", "log.tensorboard=false"]
    tr = Trainer(load_config("configs/tiny/flow_smoke.yaml", over))
    assert tr.objective.needs_ema_anchor
    tr.step(0)
    m = tr.step(1)
    assert math.isfinite(m["train/loss"]) and m["train/awm_anchor_gap"] > 0 and m["train/kl"] > 0
    with pytest.raises(ValueError, match="kwargs.anchor=ema anchors at the EMA"):
        load_config("configs/tiny/flow_smoke.yaml", over + ["train.ema_decay=0"])
    # without a KL nothing reads the frozen base: no reference forward, no reference loaded
    no_kl = load_config("configs/tiny/flow_smoke.yaml", over + ["algo.kl_coef=0"])
    assert not Trainer(no_kl).objective.needs_reference
