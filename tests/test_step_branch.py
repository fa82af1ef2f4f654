"""TempFlow-GRPO per-step branching (mmrl/rollout/step_branch.py; docs/algorithms.md §4): the sampler by hand, its
per-step groups, the policy contract, and the official constant weight."""

import math

import pytest
import torch

from mmrl.algorithms.objective import build_objective
from mmrl.algorithms.weighting import WEIGHTINGS, TempFlowKnobs
from mmrl.compose import credit_name, load_config
from mmrl.config import AlgoConfig
from mmrl.data import PolicyOutput, Rollout
from mmrl.errors import ConfigError
from mmrl.models.families.common import static_schedule
from mmrl.rollout.step_branch import run_branches, step_credit
from mmrl.sampling.flow_sde import gaussian_log_prob, step_mean_std
from mmrl.testing.contract import check_policy

from test_flow_policy import make_policy

SIGMAS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])  # S = 4 steps, trainable 0 .. 2


def test_run_branches_by_hand():
    """v(x) = -x on 1-element latents. The trunk's Euler steps x_{i+1} = x_i (1 - dt_i); a child of step j is
    drawn around the SDE mean at the trunk's x_j and finished by Euler; 2 prompts, branch steps [0, 2], K = 2."""
    calls = []

    def velocity(x, s, prompt):
        calls.append(len(x))
        return -x

    x0 = torch.tensor([[2.0], [-1.0]])
    gens = [torch.Generator().manual_seed(r) for r in range(8)]
    br = run_branches(velocity, x0, SIGMAS, [0, 2], 2, "flow_grpo", 0.7, gens)
    # rows in (prompt, step, child) order
    assert br.step.tolist() == [0, 0, 2, 2, 0, 0, 2, 2]
    # the trunk: x_1 = x_0 (1 + 0.25), x_2 = x_1 (1 + 0.25); x_2 is where step 2's children start
    t2 = 2.0 * 1.25 * 1.25  # prompt 0's x_2 = 3.125 (prompt 1's: -1.5625)
    assert br.latents[:, 0].tolist() == pytest.approx([2.0, 2.0, t2, t2, -1.0, -1.0, -1.5625, -1.5625])
    # step 0's children: flow_grpo at sigma 1 uses sigma_max = 0.75: s = 0.7 sqrt(1 / 0.25) = 1.4, std = s sqrt(0.25)
    assert br.std[:2].tolist() == pytest.approx([0.7, 0.7])
    mean0 = 2.0 + (-2.0 + 1.4**2 / 2 * (2.0 + 0.0)) * -0.25  # x + [v + s^2/(2 sigma)(x + (1 - sigma) v)] dt
    assert br.mean[:2, 0].tolist() == pytest.approx([mean0, mean0])
    noise = [torch.randn(1, generator=torch.Generator().manual_seed(r)).item() for r in (0, 1)]  # rows 0, 1's own
    assert br.next_latents[:2, 0].tolist() == pytest.approx([mean0 + 0.7 * noise[0], mean0 + 0.7 * noise[1]])
    # a step-0 child finished by Euler over sigmas 0.75 -> 0.5 -> 0.25 -> 0: x (1.25)^3
    assert br.final[0, 0].item() == pytest.approx(br.next_latents[0, 0].item() * 1.25**3)
    # a step-2 child: SDE from trunk x_2 at sigma 0.5 -> 0.25, then one Euler step to 0: x (1.25)
    s2 = 0.7 * math.sqrt(0.5 / 0.5)
    mean2 = t2 + (-t2 + s2**2 / 1.0 * (t2 + 0.5 * -t2)) * -0.25
    assert br.mean[2, 0].item() == pytest.approx(mean2)
    assert br.std[2].item() == pytest.approx(s2 * 0.5)
    assert br.final[2, 0].item() == pytest.approx(br.next_latents[2, 0].item() * 1.25)
    assert br.log_prob[2].item() == pytest.approx(gaussian_log_prob(br.next_latents[2:3], br.mean[2:3],
                                                                    br.std[2:3]).item())
    # transformer rows: the trunk runs steps 0 .. 2 (2 rows each), step 0's 4 children 3 steps, step 2's 4 children 1
    assert calls == [2, 4, 4, 4, 2, 2, 4] and br.rows == 3 * 2 + 4 * 3 + 4 * 1
    # a child's noise is its own: the same rows from a batch of one prompt are the same
    one = run_branches(velocity, x0[1:], SIGMAS, [0, 2], 2, "flow_grpo", 0.7,
                       [torch.Generator().manual_seed(r) for r in range(4, 8)])
    assert torch.equal(one.next_latents, br.next_latents[4:]) and torch.equal(one.final, br.final[4:])
    with pytest.raises(ValueError, match="below the last step"):
        run_branches(velocity, x0, SIGMAS, [3], 2, "flow_grpo", 0.7, gens)


def test_step_credit_groups_a_prompts_children_by_step():
    """2 prompts x steps {1, 3} x K = 3: grpo z-scores (population std, eps 1e-4) within (prompt, step)."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0,    # prompt 0: step 1 -> (1, 0, 0); step 3 -> zero std
                      0.0, 2.0, 4.0, 3.0, 0.0, 0.0])   # prompt 1: step 1 -> (0, 2, 4); step 3 -> (3, 0, 0)
    step = torch.tensor([1, 1, 1, 3, 3, 3] * 2).unsqueeze(1)
    ro = Rollout(group_id=torch.tensor([0] * 6 + [1] * 6), old_log_prob=torch.zeros(12, 1),
                 action_mask=torch.ones(12, 1, dtype=torch.bool), examples=[{}] * 12, outputs=None,
                 extras={"step_index": step})
    cfg = load_config(None, ["sampler.branch_children=3", "sampler.num_steps=5", "sampler.sde_window_size=2",
                             "train.group_size=6", "train.minibatches=1"])
    assert credit_name(cfg) == "step_branch"
    adv, stats = step_credit({"overall": r}, None, ro, torch.ones(12, dtype=torch.bool), cfg, 0)
    s1 = math.sqrt(2 / 9)  # (1, 0, 0): mean 1/3, population std sqrt(2/9)
    s2 = math.sqrt(8 / 3)  # (0, 2, 4): mean 2
    s3 = math.sqrt(2.0)    # (3, 0, 0): mean 1
    want = [(2 / 3) / (s1 + 1e-4), (-1 / 3) / (s1 + 1e-4), (-1 / 3) / (s1 + 1e-4), 0, 0, 0,
            -2 / (s2 + 1e-4), 0, 2 / (s2 + 1e-4), 2 / (s3 + 1e-4), -1 / (s3 + 1e-4), -1 / (s3 + 1e-4)]
    assert adv.tolist() == pytest.approx(want, abs=1e-5)
    assert stats["adv/zero_std_group_frac"] == pytest.approx(1 / 4)  # one (prompt, step) group of four


def test_policy_contract_and_rows(tiny_pixel_model):
    """Each child one action; rows (prompt, step, child); the on-policy ratio is 1; a prompt's rows are the same
    sampled alone; the sampling rows are counted as run_branches counts them (CFG doubles)."""
    pol = make_policy(tiny_pixel_model, **{"sampler.branch_children": 2, "sampler.sde_window_size": 2,
                                           "sampler.sde_window_range": "[1,2]", "train.group_size": 4,
                                           "sampler.cfg_scale": 2.0})
    ex = [{"prompt": "a red circle"}, {"prompt": "two blue squares"}]
    ro = pol.sample(ex, 4, torch.Generator().manual_seed(0))
    assert ro.old_log_prob.shape == (8, 1) and ro.outputs.shape == (8, 3, 24, 24)
    assert ro.group_id.tolist() == [0] * 4 + [1] * 4
    assert ro.extras["step_index"][:, 0].tolist() == [1, 1, 2, 2] * 2  # window [1, 2] of steps 0 .. 3
    assert torch.equal(ro.extras["sigma"][:, 0], pol.sigmas[ro.extras["step_index"][:, 0]])
    # the children of a step start from one trunk state, and differ
    assert torch.equal(ro.extras["latents"][0], ro.extras["latents"][1])
    assert not torch.equal(ro.extras["next_latents"][0], ro.extras["next_latents"][1])
    # 5 steps: trunk rows 2 x (steps 0 .. 2), children 4 x 3 (step 1) + 4 x 2 (step 2); x2 with CFG
    assert pol.rollout_counts() == {"transformer_rows": [2 * (3 * 2 + 4 * 3 + 4 * 2)]}
    assert pol.rollout_counts() == {"transformer_rows": [0]}
    assert check_policy(pol, ex, 4)["max_ratio_error"] < 1e-5
    alone = pol.sample(ex, 4, torch.Generator().manual_seed(0), rows=torch.arange(4, 8))
    torch.testing.assert_close(alone.outputs, ro.outputs[4:], rtol=0, atol=1e-5)
    torch.testing.assert_close(alone.old_log_prob, ro.old_log_prob[4:])
    with pytest.raises(ValueError, match="whole groups"):
        pol.sample(ex, 4, torch.Generator().manual_seed(0), rows=torch.arange(2, 6))
    with pytest.raises(ConfigError, match="train.group_size=4"):
        pol.sample(ex, 6, torch.Generator().manual_seed(0))


def test_config_names_the_group_size_and_refuses_what_does_not_compose():
    base = ["sampler.num_steps=10", "sampler.branch_children=4", "sampler.sde_window_size=4"]
    load_config(None, [*base, "train.group_size=16", "train.minibatches=1"])
    load_config(None, ["sampler.num_steps=10", "sampler.branch_children=6", "train.group_size=54", "train.minibatches=1"])
    with pytest.raises(ConfigError, match="train.group_size=16"):
        load_config(None, [*base, "train.group_size=8"])
    for extra, match in ((["tree.split_steps=[1]", "tree.branch=2"], "two rollout shapes"),
                         (["sampler.ode_stride=2"], "ode_stride=1"), (["algo.credit=group"], "algo.credit=auto")):
        with pytest.raises(ConfigError, match=match):
            load_config(None, [*base, "train.group_size=16", "train.minibatches=1", *extra])


def test_tempflow_constant_weight_is_the_official_form():
    """algo.tempflow_constant = c: w = c std (the official 2.25 x std_dev_t); null: std / the schedule's mean std.
    The constants are 1 / that mean at the official schedules: SD3 10 steps shift 3 a 0.7 -> 2.252; FLUX 10 steps at
    1024 px (shift e^1.15) a 0.9 -> 1.731."""
    ro = Rollout(group_id=torch.zeros(1, dtype=torch.long), old_log_prob=torch.zeros(1, 2),
                 action_mask=torch.ones(1, 2, dtype=torch.bool), examples=[{}], outputs=None)
    out = PolicyOutput(torch.zeros(1, 2), {"std": torch.tensor([[0.1, 0.3]]), "schedule_std_mean": torch.tensor(0.2)})
    assert WEIGHTINGS["tempflow"](ro, out, TempFlowKnobs(2.25))[0].tolist() == pytest.approx([0.225, 0.675])
    assert WEIGHTINGS["tempflow"](ro, out, TempFlowKnobs(None))[0].tolist() == pytest.approx([0.5, 1.5])
    for shift, a, c in ((3.0, 0.7, 2.25), (math.exp(1.15), 0.9, 1.73)):
        s = static_schedule(10, shift)
        zeros = torch.zeros(len(s) - 2, 1)  # the trainable steps 0 .. 8
        _, std = step_mean_std("flow_grpo", zeros, zeros, s[:-2], s[1:-1], a, float(s[1]))
        assert 1 / std.mean().item() == pytest.approx(c, abs=0.005)
    # the knob reaches the weighting from algo.tempflow_constant
    obj = build_objective(AlgoConfig(weighting="tempflow+guard_dt", tempflow_constant=1.73))
    (w,) = [t for t in obj.terms if getattr(t, "name", "") == "tempflow"]
    assert w.knobs.tempflow_constant == 1.73


def test_a_trainer_step_logs_its_sampling_rows(tiny_pixel_model, tmp_path):
    """One iteration on the tiny model: 2 prompts, 4 steps, 2 children at 2 window steps (start drawn in [0, 2));
    the logged transformer rows are the trunk's and the children's, CFG 2 doubling them."""
    from test_trainer import cfg_for
    from mmrl.trainer import Trainer

    tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "train.iterations=1", "log.eval_at_start=false",
                         "sampler.num_steps=4", "sampler.branch_children=2", "sampler.sde_window_size=2",
                         "sampler.sde_window_range=[0,2]", "train.group_size=4", "algo.weighting=tempflow"))
    m = tr.step(0)
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    per_start = {0: 2 * 2 + 4 * 3 + 4 * 2, 1: 2 * 3 + 4 * 2 + 4 * 1}  # trunk rows + children rows, window [j, j+1]
    assert m["rollout/transformer_rows_mean"] in {2 * r for r in per_start.values()}


def test_the_plan_counts_a_branching_iteration_as_it_runs():
    """flow_steps: one action per child; per child, its share of the trunk (steps 0 .. 3 of a prompt's 16 children)
    and its ODE finish: the shapes recipe's 128 rows make the 992 transformer rows its rollout logs."""
    from mmrl.plan_rows import flow_steps

    cfg = load_config("configs/t2i/shapes_tempflow_branch.yaml", [])
    trained, calls = flow_steps(cfg.sampler, forward=False)
    assert trained == 1 and calls == pytest.approx((4 + 4 * (9 + 8 + 7 + 6)) / 16)
    assert cfg.train.prompts_per_iter * cfg.train.group_size * calls == pytest.approx(992)
