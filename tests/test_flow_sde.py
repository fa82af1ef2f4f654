"""SDE / ODE / CPS steps against hand-computed values and torch.distributions.Normal."""

import math

import pytest
import torch
from torch.distributions import Normal

from mmrl.sampling.flow_sde import flow_grpo_std_scale, gaussian_log_prob, run_chain, step, step_mean_std


def test_flow_grpo_mean_std_hand_computed():
    # one element: x = 0.5, v = -1, sigma = 0.6, sigma_next = 0.5, a = 0.7
    x, v = torch.tensor([[0.5]]), torch.tensor([[-1.0]])
    sig, nxt = torch.tensor([0.6]), torch.tensor([0.5])
    mean, std = step_mean_std("flow_grpo", x, v, sig, nxt, 0.7, sigma_max=0.9)
    s = 0.7 * math.sqrt(0.6 / 0.4)                       # 0.857321...
    dt = -0.1
    want_mean = 0.5 + (-1.0 + s**2 / (2 * 0.6) * (0.5 + 0.4 * -1.0)) * dt
    assert mean.item() == pytest.approx(want_mean, abs=1e-6)
    assert std.item() == pytest.approx(s * math.sqrt(0.1), abs=1e-6)
    assert want_mean == pytest.approx(0.5 + (-1 + 0.6125 * 0.1) * -0.1, abs=1e-6)  # = 0.593875


def test_sigma_one_uses_sigma_max():
    s = flow_grpo_std_scale(torch.tensor([1.0, 0.5]), 0.7, sigma_max=0.9)
    assert s[0].item() == pytest.approx(0.7 * math.sqrt(1.0 / 0.1), rel=1e-6)
    assert s[1].item() == pytest.approx(0.7, rel=1e-6)


def test_dance_constant_std_and_ode():
    x, v = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    sig, nxt = torch.tensor([0.8, 0.8]), torch.tensor([0.7, 0.7])
    _, std = step_mean_std("dance", x, v, sig, nxt, 0.3, 0.9)
    assert torch.allclose(std, torch.full((2,), 0.3 * math.sqrt(0.1)))
    mean, std0 = step_mean_std("ode", x, v, sig, nxt, 0.7, 0.9)
    assert torch.allclose(mean, x - 0.1 * v, atol=1e-6) and (std0 == 0).all()


def test_cps_hand_computed():
    x, v = torch.tensor([[0.2]]), torch.tensor([[0.4]])
    sig, nxt = torch.tensor([0.6]), torch.tensor([0.4])
    mean, std = step_mean_std("cps", x, v, sig, nxt, 0.5, 0.9)
    std_w = 0.4 * math.sin(0.5 * math.pi / 2)
    x0, x1 = 0.2 - 0.6 * 0.4, 0.2 + 0.4 * 0.4
    assert std.item() == pytest.approx(std_w, abs=1e-6)
    assert mean.item() == pytest.approx(x0 * 0.6 + x1 * math.sqrt(0.16 - std_w**2), abs=1e-6)


@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_log_prob_matches_normal(reduce):
    g = torch.Generator().manual_seed(0)
    x, m = torch.randn(3, 2, 5, generator=g), torch.randn(3, 2, 5, generator=g)
    std = torch.tensor([0.1, 0.5, 2.0])
    ref = Normal(m, std.view(3, 1, 1)).log_prob(x).flatten(1)
    ref = ref.mean(1) if reduce == "mean" else ref.sum(1)
    assert torch.allclose(gaussian_log_prob(x, m, std, reduce), ref, atol=1e-5)
    with pytest.raises(ValueError, match="mean' or 'sum"):
        gaussian_log_prob(x, m, std, "max")


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_step_samples_from_its_density(kind):
    x, v = torch.zeros(4000, 1), torch.ones(4000, 1)
    sig, nxt = torch.full((4000,), 0.5), torch.full((4000,), 0.4)
    out = step(kind, x, v, sig, nxt, 0.7, 0.9, torch.Generator().manual_seed(1))
    z = (out.next - out.mean) / out.std.view(-1, 1)
    assert abs(z.mean().item()) < 0.06 and abs(z.std().item() - 1) < 0.05
    assert torch.allclose(out.log_prob, Normal(out.mean, out.std.view(-1, 1)).log_prob(out.next).squeeze(1), atol=1e-5)


def test_unknown_sampler_errors():
    with pytest.raises(ValueError, match="valid: ode, flow_grpo, dance, cps"):
        step_mean_std("ddim", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.zeros(1), 0.7, 0.9)


def test_run_chain_ode_is_euler():
    sigmas = torch.tensor([1.0, 0.5, 0.0])
    traj = run_chain(lambda x, s: torch.ones_like(x), torch.zeros(2, 3), sigmas, ["ode", "ode"], 0.7)
    assert torch.allclose(traj.latents[:, -1], torch.full((2, 3), -1.0))
    assert traj.log_prob.shape == (2, 2) and (traj.std == 0).all()
