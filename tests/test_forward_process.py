"""Forward-process losses (AWM, DiffusionNFT), MixGRPO-Flash sampling (DPM-Solver++(2M), strided ODE, sliding
window), the velocity-space KL and the EMA reference: hand-computed numbers, the policy contract, trainer steps."""

import math
from types import SimpleNamespace

import pytest
import torch

from mmrl.algorithms import KL_ESTIMATORS, POLICY_LOSSES, LossContext
from mmrl.algorithms.losses import NFTKnobs, nft_optimality
from mmrl.compose import load_config
from mmrl.data import PolicyOutput
from mmrl.policy import POLICIES
from mmrl.sampling.flow_sde import dpm2m_step, run_chain, strided_schedule
from mmrl.testing.contract import check_policy

EXAMPLES = [{"prompt": "a red circle"}, {"prompt": "two squares"}]


def make_policy(path, *items):
    return POLICIES["flow"](load_config(None, [f"model.path={path}", "sampler.num_steps=5", *items]))


# ------------------------------------------------------------------------------------------------- formulas
def test_nft_optimality_by_hand():
    a = torch.tensor([-7.0, -5.0, -1.0, 0.0, 2.5, 9.0])
    assert nft_optimality(a, 5.0).tolist() == pytest.approx([0.0, 0.0, 0.4, 0.5, 0.75, 1.0])


def test_nft_loss_by_hand():
    """One action, D = 2: v_old = (1, 0), v = (2, 1), target = (0, 0), t = 0.5, beta = 1, c = 5, A = 2.5."""
    cfg = NFTKnobs(adv_clip=5.0, nft_beta=1.0)
    v = torch.tensor([[[2.0, 1.0]]], requires_grad=True)
    stats = {"velocity": v, "old_velocity": torch.tensor([[[1.0, 0.0]]]), "target": torch.zeros(1, 1, 2),
             "sigma": torch.tensor([[0.5]])}
    lp = torch.zeros(1, 1)
    loss, s = POLICY_LOSSES["nft"](lp, lp, torch.tensor([2.5]), cfg, LossContext(PolicyOutput(lp, stats), None,
                                                                                  torch.zeros(1)))
    # v+ = v = (2, 1): d+ = t (target - v+) = (-1, -0.5): mean d^2 = 0.625, mean |d| = 0.75 -> l+ = 0.83333
    # v- = 2 v_old - v = (0, -1): d- = (0, 0.5): mean d^2 = 0.125, mean |d| = 0.25 -> l- = 0.5
    # r = 0.75: L = 5 (0.75 * 0.83333 + 0.25 * 0.5) / 1 = 3.75
    assert s["nft_positive"].item() == pytest.approx(0.625 / 0.75)
    assert s["nft_negative"].item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(3.75)
    loss.sum().backward()  # dL/dv = 5 [0.75 * 2 d+ (-t) / 0.75 / D + 0.25 * 2 d- (+t) / 0.25 / D] (weights detached)
    want = 5 * (0.75 * 2 * torch.tensor([-1.0, -0.5]) * -0.5 / 0.75 / 2 + 0.25 * 2 * torch.tensor([0.0, 0.5]) * 0.5 / 0.25 / 2)
    assert v.grad[0, 0].tolist() == pytest.approx(want.tolist())


def test_nft_on_policy_gradient_is_advantage_weighted_matching():
    """At v = v_old the positive and negative terms' plain matching gradients cancel: what is left is
    (2r - 1) c = clip(A) times the gradient of the (adaptively weighted) matching loss."""
    cfg = NFTKnobs(adv_clip=5.0, nft_beta=0.5)
    torch.manual_seed(0)
    v_old, target = torch.randn(1, 1, 6), torch.randn(1, 1, 6)
    grads = []
    for adv in (2.0, -2.0, 0.0):
        v = v_old.clone().requires_grad_(True)
        stats = {"velocity": v, "old_velocity": v_old, "target": target, "sigma": torch.tensor([[0.7]])}
        loss, _ = POLICY_LOSSES["nft"](torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([adv]), cfg,
                                       LossContext(PolicyOutput(torch.zeros(1, 1), stats), None, torch.zeros(1)))
        loss.sum().backward()
        grads.append(v.grad.clone())
    d = 0.7 * (target - v_old)
    matching = 2 * d * -0.7 / d.abs().mean() / 6  # gradient of mean d^2 / sg(mean |d|) in v
    assert grads[0].flatten().tolist() == pytest.approx((2.0 * matching).flatten().tolist(), abs=1e-6)
    assert grads[1].flatten().tolist() == pytest.approx((-2.0 * matching).flatten().tolist(), abs=1e-6)
    assert grads[2].abs().max().item() < 1e-6


def test_awm_is_the_clipped_advantage_weighted_matching_loss():
    cfg = SimpleNamespace(clip_range=0.1, clip_range_high=None, clip_ratio_c=3.0)
    old = torch.tensor([[-0.5, -0.5]])                     # -l_old
    lp = torch.tensor([[-0.3, -0.7]], requires_grad=True)  # -l: ratios e^0.2 = 1.2214 (clipped to 1.1), e^-0.2
    loss, s = POLICY_LOSSES["awm"](lp, old, torch.tensor([1.0]), cfg)
    assert loss.detach()[0].tolist() == pytest.approx([-1.1, -math.exp(-0.2)], rel=1e-5)
    assert s["clipped"].tolist() == [[1.0, 0.0]]
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, -math.exp(-0.2)], rel=1e-5)  # A > 0: l goes down


def test_velocity_kl_by_hand():
    cur = PolicyOutput(torch.zeros(1, 2), {"velocity": torch.tensor([[[1.0, 2.0], [0.0, 0.0]]])})
    ref = PolicyOutput(torch.zeros(1, 2), {"velocity": torch.tensor([[[0.0, 0.0], [0.0, 3.0]]])})
    assert KL_ESTIMATORS["flow_velocity"](cur, ref)[0].tolist() == pytest.approx([0.5 * 2.5, 0.5 * 4.5])


def test_dpm2m_step_by_hand_and_second_order():
    # sigma_prev 0.8, sigma 0.6, sigma_next 0.3: lambda = log((1 - s) / s)
    lam = lambda s: math.log((1 - s) / s)  # noqa: E731
    h, r = lam(0.3) - lam(0.6), (lam(0.6) - lam(0.8)) / (lam(0.3) - lam(0.6))
    x, x0, x0p = torch.tensor([1.0]), torch.tensor([0.2]), torch.tensor([0.4])
    d = (1 + 1 / (2 * r)) * 0.2 - 0.4 / (2 * r)
    want = 0.3 / 0.6 * 1.0 - 0.7 * math.expm1(-h) * d
    assert dpm2m_step(x, x0, x0p, 0.8, 0.6, 0.3).item() == pytest.approx(want)
    # first order = the Euler step of v = (x - x0) / sigma
    assert dpm2m_step(x, x0, None, None, 0.6, 0.3).item() == pytest.approx(1.0 + (0.3 - 0.6) * (1.0 - 0.2) / 0.6)
    # Gaussian data x0 ~ N(0, a^2): the exact ODE keeps x / sqrt((1 - s)^2 a^2 + s^2), so x(0) = a x(1)
    a = 0.5
    def vel(x, s):
        s = s[:, None]
        x0 = (1 - s) * a**2 / ((1 - s) ** 2 * a**2 + s**2) * x
        return (x - x0) / s
    x1 = torch.tensor([[1.3], [-0.7]])
    sig = torch.linspace(1, 0, 7)
    err = {k: (run_chain(vel, x1, sig, ["ode"] * 6, 0.0, ode_solver=k).latents[:, -1] - a * x1).abs().max().item()
           for k in ("euler", "dpm2m")}
    assert err["dpm2m"] < 0.5 * err["euler"], err


def test_strided_schedule_keeps_the_sde_steps():
    sig = torch.linspace(1, 0, 11)
    kinds = ["ode", "flow_grpo", "flow_grpo"] + ["ode"] * 7
    s2, k2, pos = strided_schedule(sig, kinds, 3)
    assert s2.tolist() == pytest.approx([1.0, 0.9, 0.8, 0.7, 0.4, 0.1, 0.0])
    assert k2 == ["ode", "flow_grpo", "flow_grpo", "ode", "ode", "ode"]
    assert (pos[1], pos[2]) == (1, 2) and s2[pos[1]] == sig[1] and s2[pos[2] + 1] == sig[3]
    assert strided_schedule(sig, kinds, 1)[0].tolist() == sig.tolist()


# ------------------------------------------------------------------------------------------------ the policy
@pytest.mark.parametrize("kind", ["ode", "flow_grpo"])
def test_forward_process_policy_contract(tiny_pixel_model, kind):
    pol = make_policy(tiny_pixel_model, "algo.objective.name=nft", "sampler.cfg_scale=1.0", f"sampler.kind={kind}", "sampler.forward_timesteps=3",
                      "sampler.forward_t_range=[0.2,0.9]")
    ro = pol.sample(EXAMPLES, 3, torch.Generator().manual_seed(0))
    assert ro.old_log_prob.shape == (6, 3) and ro.extras["latents"].shape == (6, 3, 3, 24, 24)
    t = ro.extras["sigma"]
    assert ((t >= 0.2) & (t <= 0.9)).all() and len(set(t.flatten().tolist())) == 18
    # x_t = (1 - t) x0 + t eps and target = eps - x0 reproduce the stored x_t from the decoded final sample's latent
    x0 = ro.extras["latents"] - t[..., None, None, None] * (ro.extras["target"] + 0)  # x_t - t (eps - x0) = x0
    assert torch.allclose(x0, x0[:, :1].expand_as(x0), atol=1e-5)  # one x0 per sample, whatever the noise level
    assert check_policy(pol, EXAMPLES, 3)["max_ratio_error"] < 1e-5
    out = pol.log_prob(ro, torch.tensor([4, 1]))
    assert torch.allclose(out.stats["velocity"], ro.extras["old_velocity"][[4, 1]], atol=1e-5)


def test_flash_sampler_contract_and_fewer_calls(tiny_pixel_model):
    calls = {}
    for name, items in {"chain": [], "flash": ["sampler.ode_solver=dpm2m", "sampler.ode_stride=2"]}.items():
        pol = make_policy(tiny_pixel_model, "sampler.num_steps=9", "sampler.sde_window_size=2",
                          "sampler.sde_window_range=[3,4]", *items)
        n = [0]
        pol.model.transformer.register_forward_pre_hook(lambda m, a, k: n.__setitem__(0, n[0] + 1), with_kwargs=True)
        ro = pol.sample(EXAMPLES, 2, torch.Generator().manual_seed(0))
        calls[name] = n[0]
        assert ro.extras["step_index"][0].tolist() == [3, 4]
        assert check_policy(pol, EXAMPLES, 2)["max_ratio_error"] < 1e-5
    assert calls == {"chain": 9, "flash": 2 + 2 + 2}  # steps 0-2 -> 0, 2 (2 calls), window 3, 4, then 5, 7 -> 9


def test_sliding_window_moves_with_the_iteration(tiny_pixel_model):
    pol = make_policy(tiny_pixel_model, "sampler.num_steps=8", "sampler.sde_window_size=2",
                      "sampler.sde_window_range=[1,4]", "sampler.window_schedule=sliding", "sampler.window_shift_every=5")
    starts = []
    for it in (0, 4, 5, 10, 14, 15, 100):
        pol.iteration = it
        starts.append(pol._window(torch.Generator().manual_seed(it))[0])
    assert starts == [1, 1, 2, 3, 3, 3, 3]  # one step later every 5 iterations, never past the last start (3)


# ------------------------------------------------------------------------------------------------ the loop
@pytest.mark.parametrize("items", [
    ["algo.objective.name=nft", "sampler.cfg_scale=1.0", "sampler.kind=ode"],
    ["algo.objective.name=awm", "sampler.cfg_scale=1.0", "algo.clip_range=1e-3", "algo.kl_coef=0.1", "algo.kl=flow_velocity",
     "algo.kl_reference=ema", "train.ema_decay=0.5", "train.lr=0.01"],
    ["sampler.ode_solver=dpm2m", "sampler.ode_stride=2", "sampler.sde_window_size=1", "algo.kl_coef=0.01",
     "algo.kl=flow_velocity", "sampler.window_schedule=sliding"],
])
def test_trainer_steps_move_the_weights(tiny_pixel_model, tmp_path, items):
    from mmrl.trainer import Trainer

    cfg = load_config(None, [f"model.path={tiny_pixel_model}", "task.name=shapes", "reward.name=shapes",
                             "sampler.num_steps=4", "sampler.cfg_scale=1", "train.prompts_per_iter=2",
                             "train.group_size=4", "train.minibatches=2", f"log.out_dir={tmp_path}", *items])
    tr = Trainer(cfg)
    before = [p.detach().clone() for p in tr.params]
    m = tr.step(0)
    assert m["train/optimizer_steps"] == 2 and math.isfinite(m["train/loss"])
    assert any(not torch.equal(b, p) for b, p in zip(before, tr.params))
    if "algo.kl_reference=ema" in items:  # the EMA reference starts at the initial weights, then lags behind them
        assert tr.step(1)["train/kl"] > 0


@pytest.mark.parametrize("items, match", [
    (["algo.objective.name=nft", "sampler.cfg_scale=1.0", "sampler.kind=ode", "sampler.shared_noise=true"], "shared_noise"),
    (["algo.objective.name=awm", "sampler.cfg_scale=1.0", "algo.weighting=tempflow"], "algo.weighting"),
    (["algo.objective.name=awm", "sampler.cfg_scale=1.0", "algo.kl_coef=0.1", "algo.kl=flow_mean"], "flow_velocity"),
    (["sampler.kind=ode"], "sampler.kind"),
    (["algo.kl_reference=ema", "algo.kl_coef=0.1", "algo.kl=flow_velocity"], "train.ema_decay"),
    (["sampler.forward_t_range=[0.5,0.2]"], "forward_t_range"),
    (["sampler.ode_solver=rk4"], "ode_solver"),
    (["model.policy=token", "algo.objective.name=nft"], "which flow policies record"),
])
def test_config_errors_name_the_fix(items, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, items)


@pytest.mark.parametrize("config", ["shapes_nft", "shapes_awm", "shapes_mixgrpo_flash"])
def test_new_configs_train_two_iterations(tiny_pixel_model, tmp_path, config):
    """Each shipped config of these methods, on the tiny pixel model with a small batch: 2 iterations, a checkpoint,
    held-out evaluations at the start and the end (the GPU configs run in scripts/gpu_check.py --device cpu)."""
    import os

    from mmrl.runs import train

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", "t2i", config + ".yaml"), [
        f"model.path={tiny_pixel_model}", "train.prompts_per_iter=2", "train.group_size=4", "train.iterations=2",
        "task.eval_prompts=4", "sampler.eval_steps=2", f"log.out_dir={tmp_path}", "log.progress=false"])
    res = train(cfg)
    assert res["iterations"] == 2 and res["eval_end"]["n"] == 4
    assert os.path.isdir(tmp_path / "checkpoints" / "iter-000002")
