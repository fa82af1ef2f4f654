"""GRPO-Guard RatioNorm and gradient reweighting, TempFlow-GRPO noise-aware weights (docs/algorithms.md §4, 5)."""

import pytest
import torch

from mmrl.algorithms.ratio import RATIO_TRANSFORMS
from mmrl.algorithms.weighting import WEIGHTINGS, TempFlowKnobs
from mmrl.data import PolicyOutput, Rollout

from test_flow_policy import make_policy


def _rollout(n, a, **extras):
    return Rollout(group_id=torch.zeros(n, dtype=torch.long), old_log_prob=torch.zeros(n, a),
                   action_mask=torch.ones(n, a, dtype=torch.bool), examples=[{}] * n, outputs=None, extras=extras)


def test_weights_by_hand():
    ro = _rollout(1, 2, sigma=torch.tensor([[1.0, 0.8]]), sigma_next=torch.tensor([[0.8, 0.5]]))
    out = PolicyOutput(torch.zeros(1, 2), {"std": torch.tensor([[0.1, 0.3]]), "schedule_std_mean": torch.tensor(0.2)})
    assert WEIGHTINGS["guard_dt"](ro, out)[0].tolist() == pytest.approx([1 / 0.2, 1 / 0.3])
    # std / the schedule's mean std (the official constant form: tests/test_step_branch.py)
    assert WEIGHTINGS["tempflow"](ro, out, TempFlowKnobs(None))[0].tolist() == pytest.approx([0.5, 1.5])


def test_ratio_norm_by_hand():
    # log r = -0.3, b = 0.5, s = 0.2  ->  log r' = (-0.3 + 0.5) * 0.2 = 0.04
    lp, old = torch.tensor([[-1.3]]), torch.tensor([[-1.0]])
    out = PolicyOutput(lp, {"std": torch.tensor([[0.2]]), "ratio_bias": torch.tensor([[0.5]])})
    assert (RATIO_TRANSFORMS["guard"](lp, old, _rollout(1, 1), out) - old).item() == pytest.approx(0.04)
    with pytest.raises(ValueError, match="flow policy"):
        RATIO_TRANSFORMS["guard"](lp, old, _rollout(1, 1), PolicyOutput(lp, {}))


def test_ratio_norm_centers_the_perturbed_log_ratio(tiny_pixel_model):
    """Under a perturbed policy the raw log-ratio mean is negative and differs across steps, while the
    normalized one has |mean| < 0.1 std at every step."""
    pol = make_policy(tiny_pixel_model, **{"sampler.num_steps": 6})
    ro = pol.sample([{"prompt": "a red circle"}, {"prompt": "two squares"}], 512, torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.02 * p.std().nan_to_num(0.0) * torch.randn_like(p))
        out = pol.log_prob(ro, torch.arange(len(ro)))
    raw = out.log_prob - ro.old_log_prob                                                    # [N, A]
    norm = RATIO_TRANSFORMS["guard"](out.log_prob, ro.old_log_prob, ro, out) - ro.old_log_prob
    raw_mean = raw.mean(0)
    assert (raw_mean < 0).all() and (raw_mean.max() - raw_mean.min()) > 0.5 * raw_mean.abs().min()
    assert (norm.mean(0).abs() < 0.1 * norm.std(0)).all(), (norm.mean(0), norm.std(0))


def test_schedule_std_mean_by_hand(tiny_pixel_model):
    """Flow-GRPO std per step s_t sqrt(-dt_t), s_t = a sqrt(sigma / (1 - sigma)) (sigma_1 at the sigma = 1 pole),
    averaged over the trainable steps (all but the last)."""
    import math

    pol = make_policy(tiny_pixel_model, **{"sampler.num_steps": 4, "sampler.shift": 1.0, "sampler.noise_level": 0.7})
    sig = [float(x) for x in pol.sigmas]                     # 1, 0.667, 0.334, 0.001, 0
    s = [0.7 * math.sqrt(sig[i] / (1 - (sig[1] if sig[i] == 1 else sig[i]))) for i in range(3)]
    want = sum(s[i] * math.sqrt(sig[i] - sig[i + 1]) for i in range(3)) / 3
    assert pol.schedule_std_mean == pytest.approx(want, rel=1e-5)
