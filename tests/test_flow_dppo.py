"""Flow-DPPO (mmrl/algorithms/flow_dppo.py): the asymmetric step-KL mask against hand-computed numbers, the step KL
the flow policy reports against a hand computation, and a short training run on a tiny pixel model."""

import math
from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms import POLICY_LOSSES
from mmrl.algorithms.flow_dppo import FlowDPPOKnobs


def test_the_mask_by_hand():
    knobs = FlowDPPOKnobs(dppo_kl_threshold=0.1)
    # four steps: (ratio, advantage, KL)
    ratio = torch.tensor([[1.2, 1.2, 0.8, 0.8, 1.2]])
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0]])
    kl = torch.tensor([[0.5, 0.05, 0.5, 0.5, 0.5]])
    old = torch.zeros(1, 5)
    logp = torch.log(ratio).requires_grad_()
    loss, s = POLICY_LOSSES["flow_dppo"](logp, old, adv, knobs,
                                       SimpleNamespace(out=SimpleNamespace(stats={"ratio_bias": kl})))
    # 1: far, up, good -> dropped; 2: near -> kept; 3: far but moving back (rho < 1, A > 0) -> kept;
    # 4: far, down, bad -> dropped; 5: far, up, bad (corrective) -> kept
    assert s["clipped"].tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0]]
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.0, -1.2, -0.8, 0.0, 1.2]]))
    loss.sum().backward()  # d(-A rho)/d logp = -A rho where kept, 0 where dropped
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1.2, -0.8, 0.0, 1.2]]))


def test_the_step_kl_is_the_exact_gaussian_kl(tiny_pixel_model):
    """The flow policy's ratio_bias for a changed velocity equals mean_d (mu - mu_old)^2 / (2 s^2) by hand."""
    from mmrl.compose import build_policy, load_config

    pol = build_policy(load_config("configs/tiny/flow_smoke.yaml", [f"model.path={tiny_pixel_model}",
                                                                    "algo.objective.name=flow_dppo"]))
    ro = pol.sample([{"prompt": "a red circle"}], 2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(torch.randn_like(p) * 1e-3)
        out = pol.log_prob(ro, torch.arange(2))
    e, m = ro.extras, ro.action_mask
    mu, mu_old, std = out.stats["mean"], e["old_mean"], e["std"]
    by_hand = (mu - mu_old).pow(2).flatten(2).mean(-1) / (2 * std ** 2)
    torch.testing.assert_close(out.stats["ratio_bias"][m], by_hand[m], rtol=1e-4, atol=1e-12)
    assert by_hand[m].max() > 0


def test_flow_dppo_trains(tiny_pixel_model, tmp_path):
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    tr = Trainer(load_config("configs/tiny/flow_smoke.yaml", [
        f"model.path={tiny_pixel_model}", "algo.objective.name=flow_dppo", "algo.objective.kwargs.dppo_kl_threshold=1e-9",
        f"log.out_dir={tmp_path}", "log.tensorboard=false", "train.inner_epochs=2"]))
    before = [p.detach().clone() for p in tr.params]
    m = tr.step(0)
    assert any((p - q).abs().max() > 0 for p, q in zip(tr.params, before))
    assert m["train/step_kl"] > 0 and 0 <= m["train/clip_frac"] <= 1 and math.isfinite(m["train/loss"])
    with pytest.raises(ValueError, match="algo.ratio=none"):
        load_config("configs/tiny/flow_smoke.yaml", [f"model.path={tiny_pixel_model}", "algo.objective.name=flow_dppo",
                                                     "algo.ratio=guard"])
