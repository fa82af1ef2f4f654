"""Advantages, clipped loss, aggregation and KL against hand-computed numbers."""

import math
from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms import ADVANTAGES, KL_ESTIMATORS, LOSS_AGG, POLICY_LOSSES
from mmrl.data import PolicyOutput

CFG = SimpleNamespace(global_std=False, adv_std="population", adv_eps=None, adv_clip=5.0, clip_range=0.2,
                      clip_range_high=None, clip_ratio_c=0.0)


def test_grpo_advantages_hand_computed():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    adv, stats = ADVANTAGES["grpo"](r, gid, torch.ones(6, dtype=torch.bool), CFG)
    std = math.sqrt(2 / 3)  # population std of 1, 2, 3
    assert torch.allclose(adv[:3], torch.tensor([-1, 0, 1]) / (std + 1e-4), atol=1e-5)
    assert (adv[3:] == 0).all()  # zero-std group carries no signal
    assert stats["adv/zero_std_group_frac"] == 0.5


def test_global_std_and_dr_grpo():
    r = torch.tensor([0.0, 2.0, 10.0, 14.0])
    gid = torch.tensor([0, 0, 1, 1])
    valid = torch.ones(4, dtype=torch.bool)
    cfg = SimpleNamespace(**{**vars(CFG), "global_std": True})
    adv, _ = ADVANTAGES["grpo"](r, gid, valid, cfg)
    gstd = r.std(unbiased=False).item()  # sqrt(mean((r-6.5)^2)) = sqrt(32.75)
    assert gstd == pytest.approx(math.sqrt(32.75))
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -2.0, 2.0]) / (gstd + 1e-4), atol=1e-5)
    adv, _ = ADVANTAGES["dr_grpo"](r, gid, valid, CFG)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -2.0, 2.0]))


def test_invalid_samples_excluded_and_clip():
    r = torch.tensor([0.0, 1.0, 100.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1000.0])
    gid = torch.tensor([0, 0, 0] + [1] * 9)
    valid = torch.tensor([True, True, False] + [True] * 9)
    adv, _ = ADVANTAGES["grpo"](r, gid, valid, CFG)
    # group 0 without the invalid 100: mean 0.5, std 0.5
    assert torch.allclose(adv[:2], torch.tensor([-0.5, 0.5]) / (0.5 + 1e-4), atol=1e-5)
    assert adv[2] == 0
    # group 1: mean 1000/9, std 1000*sqrt(8)/9 -> A(1000) = sqrt(8) = 2.83 (unclipped)
    assert adv[-1].item() == pytest.approx(math.sqrt(8), rel=1e-4)
    big = ADVANTAGES["dr_grpo"](r, gid, valid, CFG)[0]  # 888.9 and -111.1 -> clipped to +-5
    assert big[-1].item() == 5.0 and big[3].item() == -5.0


def test_ppo_clip_hand_computed():
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    old = torch.zeros(1, 3)
    loss, s = POLICY_LOSSES["ppo_clip"](logp, old, torch.tensor([[1.0, -1.0, 2.0]]), CFG)
    # A>0, r=1.5 -> clipped 1.2: -1.2 ; A<0, r=0.5 -> min(-0.5, -0.8) = -0.8 -> 0.8 ; r=1.1 in range: -2.2
    assert torch.allclose(loss, torch.tensor([[-1.2, 0.8, -2.2]]), atol=1e-6)
    assert s["clipped"].tolist() == [[1.0, 1.0, 0.0]]
    hi = SimpleNamespace(**{**vars(CFG), "clip_range_high": 0.28})
    loss, _ = POLICY_LOSSES["ppo_clip"](logp, old, torch.tensor([1.0]), hi)
    assert loss[0, 0].item() == pytest.approx(-1.28, abs=1e-6)


def test_adv_std_population_vs_sample_hand_computed():
    """G = 4. [1, 0, 0, 1]: mean 0.5, squared deviations 4 x 0.25 = 1; population var 1/4 (std 0.5), sample var 1/3
    (std 0.57735). [1, 0, 0, 0]: mean 0.25, squares 0.5625 + 3 x 0.0625 = 0.75; population var 0.1875
    (std 0.43301), sample var 0.25 (std 0.5) -> A = 0.75 / 0.5 = 1.5 and -0.25 / 0.5 = -0.5."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    gid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    valid = torch.ones(8, dtype=torch.bool)
    pop, _ = ADVANTAGES["grpo"](r, gid, valid, CFG)                                     # flow_grpo: np.std + 1e-4
    smp, _ = ADVANTAGES["grpo"](r, gid, valid, SimpleNamespace(**{**vars(CFG), "adv_std": "sample"}))  # verl: + 1e-6
    assert pop.tolist() == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, -0.5 / 0.5001, 0.5 / 0.5001,
                                          0.75 / (math.sqrt(0.1875) + 1e-4)] + [-0.25 / (math.sqrt(0.1875) + 1e-4)] * 3)
    s3 = math.sqrt(1 / 3) + 1e-6
    assert smp.tolist() == pytest.approx([0.5 / s3, -0.5 / s3, -0.5 / s3, 0.5 / s3, 1.5, -0.5, -0.5, -0.5], rel=1e-5)
    # same rewards, same sign: the two differ by the std ratio sqrt(G / (G - 1)) = 1.1547 (up to the epsilons)
    assert (pop / smp).tolist() == pytest.approx([math.sqrt(4 / 3)] * 8, rel=1e-3)
    auto = SimpleNamespace(**{**vars(CFG), "adv_std": "auto"})  # an AlgoConfig not loaded with a policy: population
    assert torch.equal(ADVANTAGES["grpo"](r, gid, valid, auto)[0], pop)
    with pytest.raises(ValueError, match="algo.adv_std='unbiased'"):
        ADVANTAGES["grpo"](r, gid, valid, SimpleNamespace(**{**vars(CFG), "adv_std": "unbiased"}))


def test_adv_std_auto_follows_the_policy():
    """auto -> population (+1e-4) for flow recipes, sample (+1e-6) for token ones, resolved once at load."""
    from mmrl.algorithms.advantages import std_kind
    from mmrl.compose import load_config  # the policy kind's std is resolved where the config meets its kind
    flow, token = load_config(None, []), load_config(None, ["model.policy=token"])
    assert (flow.algo.adv_std, std_kind(flow.algo)) == ("population", (0, 1e-4))
    assert (token.algo.adv_std, std_kind(token.algo)) == ("sample", (1, 1e-6))
    explicit = load_config(None, ["model.policy=token", "algo.adv_std=population", "algo.adv_eps=1e-3"])
    assert std_kind(explicit.algo) == (0, 1e-3)
    with pytest.raises(ValueError, match="algo.adv_std"):
        load_config(None, ["algo.adv_std=biased"])


def test_dual_clip_hand_computed():
    """verl's clip_ratio_c = 3. A = -1: r = 4 -> PPO loss max(4, 1.2) = 4, dual-clip min(4, 3) = 3 (gradient 0);
    r = 2 -> 2 < 3 unchanged; A = +1, r = 4 -> -1.2 (dual-clip never touches A > 0)."""
    logp = torch.log(torch.tensor([[4.0, 2.0, 4.0]])).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, s = POLICY_LOSSES["ppo_clip"](logp, torch.zeros(1, 3), adv, SimpleNamespace(**{**vars(CFG), "clip_ratio_c": 3.0}))
    assert loss[0].tolist() == pytest.approx([3.0, 2.0, -1.2], abs=1e-6)
    assert s["dual_clipped"].tolist() == [[1.0, 0.0, 0.0]]
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 2.0, 0.0], abs=1e-6)  # d(-A r)/dlogp = -A r = 2 for r = 2
    off, _ = POLICY_LOSSES["ppo_clip"](logp.detach(), torch.zeros(1, 3), adv, CFG)  # clip_ratio_c = 0: plain PPO
    assert off[0].tolist() == pytest.approx([4.0, 2.0, -1.2], abs=1e-6)
    from mmrl.compose import load_config
    with pytest.raises(ValueError, match="algo.clip_ratio_c must be > 1"):
        load_config(None, ["algo.clip_ratio_c=0.5"])


def test_loss_aggregation():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert LOSS_AGG["seq_mean_token_mean"](loss, mask, 2, 4).item() == pytest.approx((2.0 + 4.0) / 2)
    assert LOSS_AGG["token_mean"](loss, mask, 2, 4).item() == pytest.approx(10.0 / 4)
    assert LOSS_AGG["seq_sum_norm"](loss, mask, 2, 4).item() == pytest.approx(10.0 / 6)
    # verl's seq-mean-token-sum: per-sample sums 1 + 2 + 3 = 6 and 4, mean over the 2 samples = 5
    assert LOSS_AGG["seq_mean_token_sum"](loss, mask, 2, 4).item() == pytest.approx(5.0)


def test_kl_estimators():
    cur = PolicyOutput(torch.tensor([[0.0, -1.0]]), {"mean": torch.tensor([[[1.0, 3.0], [0.0, 0.0]]]),
                                                    "std": torch.tensor([[0.5, 1.0]])})
    ref = PolicyOutput(torch.tensor([[0.5, -1.0]]), {"mean": torch.tensor([[[0.0, 1.0], [0.0, 0.0]]]),
                                                    "std": torch.tensor([[0.5, 1.0]])})
    assert torch.allclose(KL_ESTIMATORS["k1"](cur, ref), torch.tensor([[-0.5, 0.0]]))
    assert torch.allclose(KL_ESTIMATORS["k3"](cur, ref), torch.tensor([[math.exp(0.5) - 1.5, 0.0]]), atol=1e-6)
    assert torch.allclose(KL_ESTIMATORS["k2"](cur, ref), torch.tensor([[0.125, 0.0]]))  # 0.5 * (0 - 0.5)^2
    # mean_d (1, 4) = 2.5 ; / (2 * 0.25) = 5
    assert torch.allclose(KL_ESTIMATORS["flow_mean"](cur, ref), torch.tensor([[5.0, 0.0]]))


def test_registry_error_lists_valid_keys():
    with pytest.raises(KeyError, match=r"Did you mean 'grpo'\? \(valid: \['dr_grpo', 'grpo'\] or a package.module:Name path"):
        ADVANTAGES["grp"]
