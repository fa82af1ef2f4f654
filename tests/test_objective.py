"""The objective seam (mmrl/algorithms/objective.py): terms composed in order, what they declare, the sub-config and
the knobs dataclasses (mmrl/algorithms/knobs.py), read from the registries."""

import dataclasses
import re

import pytest
import torch

from mmrl.algorithms import POLICY_LOSSES, REWARD_SHAPINGS
from mmrl.algorithms.dgpo import DGPOKnobs
from mmrl.algorithms.knobs import build_knobs
from mmrl.algorithms.objective import Batch, build_objective
from mmrl.compose import load_config
from mmrl.config import AlgoConfig
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
                             "algo.objective.sft_coef=0.5", "algo.offpolicy=ground_truth"])
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
    """verl's token pieces through a loaded config: ppo_clip with dual-clip c = 2 (algo.clip_ratio_c), + 0.1 k2, then
    seq-mean-token-sum. Row 0 (A = -1): r = 4 -> PPO max(4, 1.2) = 4, dual-clip min(4, 2) = 2, k2 0.5 ln(4)^2 =
    0.960906 -> 2.0960906; r = 1 -> 1. Row 1 (A = +1): r = 1 -> -1; r = e^0.5 -> clipped 1.2 -> -1.2, k2 0.125 ->
    -1.1875. Per-sequence sums 3.0960906 and -2.1875, mean 0.4542953."""
    cfg = load_config(None, ["model.policy=token", "algo.objective.name=ppo_clip", "algo.kl=k2", "algo.kl_coef=0.1",
                             "algo.clip_range=0.2", "algo.clip_ratio_c=2.0", "algo.loss_agg=seq_mean_token_sum"])
    obj = build_objective(cfg.algo)
    logp = torch.tensor([[4.0, 1.0], [1.0, 1.0]]).log() + torch.tensor([[0.0, 0.0], [0.0, 0.5]])  # [2, 2]
    zeros = torch.zeros(2, 2)
    loss, stats = obj.per_action(batch(logp, zeros, torch.tensor([-1.0, 1.0]), PolicyOutput(zeros, {})))
    torch.testing.assert_close(loss, torch.tensor([[2.0 + 0.05 * torch.tensor(4.0).log().item() ** 2, 1.0],
                                                   [-1.0, -1.1875]]))
    assert stats["dual_clipped"].tolist() == [[1.0, 0.0], [0.0, 0.0]]
    total = obj.aggregate(loss, torch.ones(2, 2, dtype=torch.bool), 2, 4)
    assert total.item() == pytest.approx((2.0960906 + 1.0 - 2.1875) / 2, abs=1e-6)


def test_the_loss_gets_its_knobs_dataclass_from_kwargs_and_the_shared_algo_keys():
    """dgpo's own knob from algo.objective.kwargs (a YAML string '5e1' read as the float it is), the shared clip_range
    from algo.clip_range; its loss at r = 1 is w A l with w = sigmoid(beta / G D): one row, A = 1, l = 0.5, l_ref =
    0.4 -> D = 0.1, w = sigmoid(50 * 0.1) = 0.993307, loss 0.496654."""
    cfg = load_config(None, ["algo.objective.name=dgpo", "algo.objective.kwargs={dgpo_beta: '5e1'}",
                             "algo.clip_range=0.3"])
    knobs = build_objective(cfg.algo).terms[0].knobs
    assert knobs == DGPOKnobs(clip_range=0.3, dgpo_beta=50.0)
    logp = torch.tensor([[-0.5]])
    loss, _ = POLICY_LOSSES["dgpo"](logp, logp, torch.tensor([1.0]), knobs,
                                    Ctx(ref=PolicyOutput(torch.tensor([[-0.4]]), {}), group_id=torch.tensor([0])))
    assert loss.item() == pytest.approx(0.5 / (1 + 2.718281828459045 ** -5.0))


class Ctx:  # the LossContext fields dgpo reads
    def __init__(self, ref, group_id):
        self.ref, self.group_id = ref, group_id


@pytest.mark.parametrize("override, message", [
    ("algo.objective.kwargs={beta: 2}", r"algo.objective.kwargs: 'beta' is not a knob of 'dgpo'. Did you mean "
                                        r"'dgpo_beta'\? Its knobs: \['dgpo_beta'\] \(it also reads algo.clip_range\)"),
    ("algo.objective.kwargs={clip_range: 0.5}", r"several components read clip_range, so it is set once, at "
                                                r"algo.clip_range \(e.g. algo.clip_range=0.5\)"),
    ("algo.objective.kwargs={dgpo_beta: high}", r"'algo.objective.kwargs.dgpo_beta' expects float, got 'high'"),
])
def test_a_bad_knob_is_refused_at_load_naming_the_loss_and_the_valid_ones(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, ["algo.objective.name=dgpo", override])


def test_an_unknown_loss_names_the_key():
    with pytest.raises(ValueError, match="algo.objective.name.*ppo_clipp.*Did you mean 'ppo_clip'"):
        load_config(None, ["algo.objective.name=ppo_clipp"])


@pytest.mark.parametrize("registry, where", [(POLICY_LOSSES, "algo.objective"), (REWARD_SHAPINGS, "algo.shaping")])
def test_every_entry_declares_its_knobs_as_a_dataclass_with_defaults(registry, where):
    """Read from the registry, so a new loss or shaping is checked without editing this test: its knobs are a
    dataclass (or none), built from empty kwargs (its own knobs have defaults), and a stray kwarg is refused."""
    for name in registry:
        knobs = build_knobs(registry[name], name, {}, where, AlgoConfig())
        assert knobs is None or dataclasses.is_dataclass(knobs), name
        with pytest.raises(ValueError, match=rf"{re.escape(where)}\.kwargs.*no_such_knob.*'{name}'"):
            build_knobs(registry[name], name, {"no_such_knob": 1}, where, AlgoConfig())


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
    """A loss from the user's file, by package.module:fn, with its own knob declared as a dataclass beside it."""
    (tmp_path / "my_loss.py").write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class ScaledKnobs:\n"
        "    scale: float = 1.0\n"
        "def scaled(log_prob, old_log_prob, advantages, knobs):\n"
        "    return -knobs.scale * advantages[:, None] * log_prob, {}\n"
        "scaled.knobs = ScaledKnobs\n"
        "def tupled(log_prob, old_log_prob, advantages, knobs):\n"
        "    return -advantages[:, None] * log_prob, {}\n"
        "tupled.knobs = ('scale',)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not hasattr(AlgoConfig(), "scale")
    cfg = load_config(None, ["algo.objective.name=my_loss:scaled", "algo.objective.kwargs={scale: 3.0}"])
    loss, _ = build_objective(cfg.algo).per_action(batch(torch.tensor([[0.5]]), torch.tensor([[0.5]]),
                                                         torch.tensor([2.0])))
    assert loss.item() == pytest.approx(-3.0)
    with pytest.raises(ValueError, match=r"'my_loss:tupled' declares knobs=\('scale',\): declare them as a dataclass"):
        load_config(None, ["algo.objective.name=my_loss:tupled"])


def test_the_terms_knobs_live_in_algo_objective():
    """algo.objective.tis_cap / sft_coef are the terms' one home: checked against the policy and the injection."""
    with pytest.raises(ValueError, match=r"algo.objective.tis_cap corrects a token engine's"):
        load_config(None, ["algo.objective.tis_cap=2"])
    with pytest.raises(ValueError, match=r"algo.objective.sft_coef > 0 trains the NLL of injected rows"):
        load_config(None, ["model.policy=token", "algo.objective.sft_coef=1.0"])
