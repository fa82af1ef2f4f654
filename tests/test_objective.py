"""The objective seam (mmrl/algorithms/objective.py): terms composed in order, what they declare, the sub-config."""

import pytest
import torch

from mmrl.algorithms.objective import Batch, build_objective
from mmrl.compose import load_config
from mmrl.data import PolicyOutput


class Rows:  # the Rollout fields the terms read
    def __init__(self, n, a, offpolicy=None, extras=None):
        self.is_offpolicy = torch.zeros(n, dtype=torch.bool) if offpolicy is None else offpolicy
        self.extras = extras or {}
        self.action_mask = torch.ones(n, a, dtype=torch.bool)


def batch(logp, old, adv, ref=None, offpolicy=None, extras=None):
    n, a = logp.shape
    return Batch(None, old, adv, torch.zeros(n, dtype=torch.long), torch.ones(n, a, dtype=torch.bool),
                 Rows(n, a, offpolicy, extras), PolicyOutput(logp, {}), ref)


def test_policy_loss_kl_and_anchor_compose_to_hand_numbers():
    """ppo_clip + 0.1 KL (k3) - 0.5 log pi of the injected row. Row 0: r = e^0.3 = 1.34986, A = 2, clip 0.2 ->
    -min(2.69972, 1.2 * 2) = -2.4; row 1 (injected): r = 1, A = -1 -> 1, anchor -0.5 * (-0.3) = +0.15; KL 0 (the
    reference is the policy itself)."""
    cfg = load_config(None, ["model.policy=token", "algo.clip_range=0.2", "algo.kl=k3", "algo.kl_coef=0.1",
                             "algo.sft_coef=0.5", "algo.offpolicy=ground_truth"])
    obj = build_objective(cfg.algo)
    assert [type(t).__name__ for t in obj.terms] == ["PolicyLoss", "KLPenalty", "SupervisedAnchor"]
    assert obj.needs_reference and not obj.needs_whole_groups and obj.actions == "transitions"
    logp, old = torch.tensor([[0.3], [-0.3]]), torch.tensor([[0.0], [-0.3]])
    ref = PolicyOutput(torch.tensor([[0.3], [-0.3]]), {})
    loss, stats = obj.per_action(batch(logp, old, torch.tensor([2.0, -1.0]), ref, torch.tensor([False, True])))
    torch.testing.assert_close(loss, torch.tensor([[-2.4], [1.0 + 0.15]]))
    assert stats["kl"].abs().max() == 0 and stats["clipped"].tolist() == [[1.0], [0.0]]
    values, where = stats["sft_nll"]
    assert where.tolist() == [[False], [True]] and values[1, 0].item() == pytest.approx(0.3)


def test_dual_clip_k2_and_seq_mean_token_sum_compose_to_hand_numbers():
    """verl's token pieces through a loaded config: ppo_clip with dual-clip c = 2 (a sub-config knob), + 0.1 k2, then
    seq-mean-token-sum. Row 0 (A = -1): r = 4 -> PPO max(4, 1.2) = 4, dual-clip min(4, 2) = 2, k2 0.5 ln(4)^2 =
    0.960906 -> 2.0960906; r = 1 -> 1. Row 1 (A = +1): r = 1 -> -1; r = e^0.5 -> clipped 1.2 -> -1.2, k2 0.125 ->
    -1.1875. Per-sequence sums 3.0960906 and -2.1875, mean 0.4542953."""
    cfg = load_config(None, ["model.policy=token", "algo.objective.name=ppo_clip", "algo.kl=k2", "algo.kl_coef=0.1",
                             "algo.objective.kwargs={clip_range: 0.2, clip_ratio_c: 2.0}", "algo.loss_agg=seq_mean_token_sum"])
    obj = build_objective(cfg.algo)
    logp = torch.tensor([[4.0, 1.0], [1.0, 1.0]]).log() + torch.tensor([[0.0, 0.0], [0.0, 0.5]])  # [2, 2]
    zeros = torch.zeros(2, 2)
    loss, stats = obj.per_action(batch(logp, zeros, torch.tensor([-1.0, 1.0]), PolicyOutput(zeros, {})))
    torch.testing.assert_close(loss, torch.tensor([[2.0 + 0.05 * torch.tensor(4.0).log().item() ** 2, 1.0],
                                                   [-1.0, -1.1875]]))
    assert stats["dual_clipped"].tolist() == [[1.0, 0.0], [0.0, 0.0]]
    total = obj.aggregate(loss, torch.ones(2, 2, dtype=torch.bool), 2, 4)
    assert total.item() == pytest.approx((2.0960906 + 1.0 - 2.1875) / 2, abs=1e-6)


def test_objective_sub_config_sets_the_loss_and_its_knobs():
    cfg = load_config(None, ["algo.objective.name=ppo_clip", "algo.objective.kwargs={clip_range: 0.5}"])
    obj = build_objective(cfg.algo)
    assert obj.terms[0].knobs.clip_range == 0.5 and cfg.algo.clip_range == 1e-4  # the flat key is not the knob
    # r = e^1 = 2.718 > 1.5: clipped at 1.5 A
    loss, _ = obj.per_action(batch(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([1.0])))
    assert loss.item() == pytest.approx(-1.5)


def test_unknown_knob_and_orphan_kwargs_are_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"\['beta'\] are not knobs of objective 'dgpo'.*clip_range.*dgpo_beta"):
        load_config(None, ["algo.objective.name=dgpo", "algo.objective.kwargs={beta: 2}", "sampler.kind=ode",
                           "sampler.shared_noise=false", "algo.kl=flow_velocity"])
    with pytest.raises(ValueError, match="without algo.objective.name"):
        load_config(None, ["algo.objective.kwargs={clip_range: 0.5}"])
    with pytest.raises(ValueError, match="algo.objective.name"):
        load_config(None, ["algo.objective.name=ppo_clipp"])


def test_what_the_terms_declare_reaches_the_policy_and_the_checks():
    """DGPO declares a reference and whole groups and trains on the forward process: the flow policy records forward
    actions, the run keeps a reference, and minibatches are refused."""
    from mmrl.policy.base import reference_kind

    base = ["algo.objective.name=dgpo", "sampler.kind=ode", "sampler.shared_noise=false"]
    cfg = load_config(None, base)
    obj = build_objective(cfg.algo)
    assert obj.actions == "forward" and obj.needs_reference and obj.needs_whole_groups
    assert reference_kind(cfg) == "auto"
    with pytest.raises(ValueError, match="whole groups"):
        load_config(None, base + ["train.minibatches=2"])


def test_a_users_own_objective_by_import_path(tmp_path, monkeypatch):
    """A loss from the user's file, by package.module:fn, with its own declared knob."""
    (tmp_path / "my_loss.py").write_text(
        "def scaled(log_prob, old_log_prob, advantages, knobs):\n"
        "    return -knobs.scale * advantages[:, None] * log_prob, {}\n"
        "scaled.knobs = ('scale',)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from mmrl.config import AlgoConfig

    assert not hasattr(AlgoConfig(), "scale")
    cfg = load_config(None, ["algo.objective.name=my_loss:scaled", "algo.objective.kwargs={scale: 3.0}"])
    loss, _ = build_objective(cfg.algo).per_action(batch(torch.tensor([[0.5]]), torch.tensor([[0.5]]),
                                                         torch.tensor([2.0])))
    assert loss.item() == pytest.approx(-3.0)


def test_a_knob_set_in_two_places_or_two_losses_named_is_refused():
    with pytest.raises(ValueError, match="same knob twice"):
        load_config("configs/t2i/shapes_nft.yaml", ["algo.nft_beta=0.5"])
    assert build_objective(load_config("configs/t2i/shapes_nft.yaml", ["algo.objective.kwargs.nft_beta=0.5"]).algo
                           ).terms[0].knobs.nft_beta == 0.5
    with pytest.raises(ValueError, match="two losses"):
        load_config("configs/t2i/shapes_nft.yaml", ["algo.policy_loss=awm"])
