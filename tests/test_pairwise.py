"""Pref-GRPO pairwise win rates, judges and the answer parser; several rewards (sum vs GDPO) by hand."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.algorithms.advantages import ADVANTAGES, REWARD_AGGREGATIONS
from mmrl.config import AlgoConfig
from mmrl.compose import build_reward, check_kwargs
from mmrl.reward import REWARDS, MultiReward, RewardRunner
from mmrl.rollout.pairwise import PairwiseReward, RuleJudge, ScoreJudge, all_pairs, win_rates
from rewards.judges import parse_verdict


def test_all_pairs_within_groups():
    i, j = all_pairs(torch.tensor([0, 0, 0, 1, 1]))
    assert list(zip(i.tolist(), j.tolist())) == [(0, 1), (0, 2), (1, 2), (3, 4)]
    assert len(all_pairs(torch.arange(8).repeat_interleave(8))[0]) == 8 * 28  # C(8, 2) = 28 per group


def test_win_rates_by_hand():
    # group of 3: 0 beats 1, 0 ties 2, 2 beats 1  ->  w = [1.5/2, 0/2, 1.5/2]
    i, j = torch.tensor([0, 0, 1]), torch.tensor([1, 2, 2])
    w, count = win_rates(torch.tensor([1.0, 0.0, -1.0]), i, j, 3)
    torch.testing.assert_close(w, torch.tensor([0.75, 0.0, 0.75]))
    assert count.tolist() == [2, 2, 2]
    # group z-score (population std 0.35355): A = [0.7071, -1.4142, 0.7071] (eps 1e-4)
    adv, _ = ADVANTAGES["grpo"](w, torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool), AlgoConfig())
    s = math.sqrt(0.125)
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.5, 0.25]) / (s + 1e-4))
    # a failed comparison (NaN) is not counted: sample 1 then has only its loss to 2
    w, count = win_rates(torch.tensor([float("nan"), 0.0, -1.0]), i, j, 3)
    torch.testing.assert_close(w, torch.tensor([0.5, 0.0, 0.75]))
    assert count.tolist() == [1, 1, 2]
    # no counted comparison at all -> NaN (the runner then marks the sample invalid)
    w, _ = win_rates(torch.tensor([float("nan")]), torch.tensor([0]), torch.tensor([1]), 2)
    assert torch.isnan(w).all()


def score_reward(outputs, examples):
    return {"overall": outputs[:, 0].float()}


def test_pairwise_reward_with_a_score_judge_equals_rank_win_rates():
    scores = torch.tensor([[0.3], [0.9], [0.1], [0.5], [5.0], [4.0]])
    gid = torch.tensor([0, 0, 0, 0, 1, 1])
    r = PairwiseReward(ScoreJudge(score_reward), batch_size=2)(scores, [{"prompt": "p"}] * 6, gid)
    # within group 0 the ranks are 0.9 > 0.5 > 0.3 > 0.1: wins 3, 2, 1, 0 out of 3
    torch.testing.assert_close(r["overall"], torch.tensor([1 / 3, 1.0, 0.0, 2 / 3, 1.0, 0.0]))
    assert r["comparisons"].tolist() == [3, 3, 3, 3, 1, 1]


def test_illusory_advantage_ties_within_the_margin():
    """Pointwise scores 1% apart get full-size z-score advantages; a judge that calls gaps <= margin ties gives
    every sample win rate 0.5 and advantage 0."""
    scores = torch.tensor([[0.910], [0.920], [0.915], [0.912]])
    gid, valid, cfg = torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), AlgoConfig()
    point, _ = ADVANTAGES["grpo"](scores[:, 0], gid, valid, cfg)
    assert point.abs().mean() > 0.8 and point.abs().max() > 1.4  # as large as for any real gap
    r = PairwiseReward(ScoreJudge(score_reward, margin=0.02))(scores, [{"prompt": "p"}] * 4, gid)
    assert r["overall"].tolist() == [0.5] * 4 and r["tie_rate"].tolist() == [1.0] * 4
    pair, _ = ADVANTAGES["grpo"](r["overall"], gid, valid, cfg)
    assert pair.abs().max() == 0


def test_symmetric_judging_cancels_position_bias():
    first_wins = RuleJudge(lambda a, b, e: 1)  # a judge that always prefers the first image
    x, gid, ex = torch.zeros(4, 1), torch.zeros(4, dtype=torch.long), [{"prompt": "p"}] * 4
    biased = PairwiseReward(first_wins)(x, ex, gid)["overall"]
    torch.testing.assert_close(biased, torch.tensor([1.0, 2 / 3, 1 / 3, 0.0]))  # earlier samples look better
    assert PairwiseReward(first_wins, symmetric=True)(x, ex, gid)["overall"].tolist() == [0.5] * 4


def test_a_judge_that_raises_on_one_pair_loses_only_that_pair():
    def rule(a, b, e):
        if float(a[0]) == 2 and float(b[0]) == 3:
            raise RuntimeError("judge crashed")
        return 1 if a[0] > b[0] else -1

    pr = PairwiseReward(RuleJudge(rule))
    x = torch.tensor([[1.0], [2.0], [3.0]])
    r = pr(x, [{"prompt": "p"}] * 3, torch.zeros(3, dtype=torch.long))
    assert pr.failed_pairs == 1
    torch.testing.assert_close(r["overall"], torch.tensor([0.0, 1.0, 1.0]))  # 2 and 3 each have one counted pair
    assert r["comparisons"].tolist() == [2, 1, 1]


def test_a_score_judge_that_raises_loses_only_the_failing_pairs():
    """The score judge scores a whole group at once; when that raises, pairs are judged one by one as for any
    judge, so only the pairs with the failing sample (here the one scoring exactly 3) are lost."""
    def fragile(outputs, examples):
        if (outputs[:, 0] == 3).any():
            raise RuntimeError("scorer crashed")
        return score_reward(outputs, examples)

    pr = PairwiseReward(ScoreJudge(fragile))
    r = pr(torch.tensor([[1.0], [2.0], [3.0]]), [{"prompt": "p"}] * 3, torch.zeros(3, dtype=torch.long))
    assert pr.failed_pairs == 2
    assert r["comparisons"].tolist() == [1, 1, 0]
    torch.testing.assert_close(r["overall"][:2], torch.tensor([0.0, 1.0]))


def test_runner_passes_groups_and_never_rescoring_one_by_one():
    calls = []

    class Broken:
        needs_groups = True

        def __call__(self, outputs, examples, group_id):
            calls.append(len(examples))
            raise RuntimeError("judge server down")

    rewards, valid, failures = RewardRunner(Broken())(torch.zeros(4, 1), [{"prompt": "p"}] * 4, torch.zeros(4).long())
    assert calls == [4] and failures == 4 and not valid.any()
    with pytest.raises(ValueError, match="group_id"):
        RewardRunner(Broken())(torch.zeros(4, 1), [{"prompt": "p"}] * 4)


# ------------------------------------------------------------------------------------ the answer parser
@pytest.mark.parametrize("text,want", [
    ("<think>1 is sharper</think><answer>Image 1 is better</answer>", 1),
    ("<think>...</think>\n<answer> image 2 is better </answer>", -1),
    ("<answer>Image 2 is the better</answer>", -1),
    ("<answer>Image 1 is better</answer> then <answer>Image 2 is better</answer>", -1),  # the last answer decides
    ("<answer>Image 1 is better, Image 2 is better</answer>", 0),  # both named: tie
    ("<answer>both are equal</answer>", 0),
    ("<think>Image 1 is better at color</think>Image 2 is better", -1),  # no answer tag: after </think>
    ("", 0), ("<answer>", 0), ("Image 3 is better", 0),
])
def test_parse_verdict(text, want):
    assert parse_verdict(text) == want


NEAR = st.sampled_from(["<answer>", "</answer>", "<think>", "</think>", "Image 1 is better", "Image 2 is better",
                        "image", "1", "2", " is ", "better", "<answer>Image", "\n", "<", ">", "/"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.lists(st.one_of(NEAR, st.text(max_size=5)), max_size=12).map("".join)))
def test_parse_verdict_never_raises(text):
    assert parse_verdict(text) in (-1, 0, 1)


# -------------------------------------------------------------------------------------- several rewards
@REWARDS.register("test_column")
def _column(col: int = 0):
    return lambda outputs, examples: {"overall": outputs[:, col].float()}


def test_multi_reward_weighted_sum_and_components():
    m = build_reward("multi", {"components": {"a": {"name": "test_column", "weight": 2.0, "kwargs": {"col": 0}},
                                              "b": {"name": "test_column", "weight": 0.5, "kwargs": {"col": 1}}}})
    assert isinstance(m, MultiReward) and m.weights == {"a": 2.0, "b": 0.5}
    out = m(torch.tensor([[1.0, 4.0], [0.0, 2.0]]), [{}, {}])
    assert out["overall"].tolist() == [4.0, 1.0] and out["a"].tolist() == [1.0, 0.0] and out["b"].tolist() == [4.0, 2.0]
    with pytest.raises(ValueError, match="unknown keys"):
        build_reward("multi", {"components": {"a": {"name": "test_column", "wieght": 1}}})


def test_gdpo_by_hand_and_the_sum_contrast():
    cfg = AlgoConfig()
    gid, valid = torch.tensor([0, 0, 1, 1]), torch.ones(4, dtype=torch.bool)
    r1, r2 = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.5, 0.5, 0.2, 0.1])
    rewards = {"overall": r1 + r2, "a": r1, "b": r2}
    adv, _ = REWARD_AGGREGATIONS["gdpo"](rewards, {"a": 1.0, "b": 1.0}, gid, valid, cfg, ADVANTAGES["grpo"])
    z1 = 0.5 / (0.5 + 1e-4)       # r1 z-scores: +-z1 in both groups
    z2 = 0.05 / (0.05 + 1e-4)     # r2: group 0 has zero std (advantage 0), group 1 +-z2
    s = torch.tensor([z1, -z1, z1 + z2, -z1 - z2], dtype=torch.float64)
    want = (s - s.mean()) / (s.std(unbiased=False) + 1e-4)
    torch.testing.assert_close(adv, want.float())
    # reward-level sum: one z-score of r1 + r2 = [1.5, .5 | 1.2, .1] gives +-1 (x std/(std+eps)) in both groups
    summed, _ = REWARD_AGGREGATIONS["sum"](rewards, None, gid, valid, cfg, ADVANTAGES["grpo"])
    torch.testing.assert_close(summed, torch.tensor([0.5 / 0.5001, -0.5 / 0.5001, 0.55 / 0.5501, -0.55 / 0.5501]))
    with pytest.raises(ValueError, match="reward.name=multi"):
        REWARD_AGGREGATIONS["gdpo"](rewards, None, gid, valid, cfg, ADVANTAGES["grpo"])


def test_gdpo_keeps_a_small_reward_from_being_drowned():
    """A reward on a 100x larger scale dominates the summed z-score; GDPO gives both the same say."""
    cfg, gid, valid = AlgoConfig(), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool)
    big, small = torch.tensor([100.0, 0.0, 100.0, 0.0]), torch.tensor([0.0, 0.0, 1.0, 1.0])
    rewards = {"overall": big + small, "big": big, "small": small}
    summed, _ = REWARD_AGGREGATIONS["sum"](rewards, None, gid, valid, cfg, ADVANTAGES["grpo"])
    gdpo, _ = REWARD_AGGREGATIONS["gdpo"](rewards, {"big": 1.0, "small": 1.0}, gid, valid, cfg, ADVANTAGES["grpo"])
    assert (summed[2] - summed[0]).abs() < 0.02   # the small reward barely moves the summed advantage
    assert (gdpo[2] - gdpo[0]).abs() > 0.9        # GDPO: the small reward's preference counts fully


def test_batch_normalization_by_hand_and_against_the_drowning():
    """batch: each component z-scored over the batch, weighted sum, then the group estimator."""
    cfg = AlgoConfig()
    gid, valid = torch.tensor([0, 0, 1, 1]), torch.tensor([True, True, True, True])
    big, small = torch.tensor([100.0, 0.0, 100.0, 0.0]), torch.tensor([0.0, 0.0, 1.0, 1.0])
    rewards = {"overall": big + small, "big": big, "small": small}
    adv, _ = REWARD_AGGREGATIONS["batch"](rewards, {"big": 1.0, "small": 1.0}, gid, valid, cfg, ADVANTAGES["grpo"])
    # big: mean 50, std 50 -> z = +-50/50.0001; small: mean .5, std .5 -> z = -+.5/.5001; in each group the
    # sums are [zb + (-zs), -zb + (-zs)] and [zb + zs, -zb + zs]: group z-scores +-zb / (zb + eps) in both
    zb = 50 / 50.0001
    want = zb / (zb + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([want, -want, want, -want]))
    # where the small reward decides within a group, it is not drowned: the groups [big, small] = [(100, 0), (100, 1)]
    big2, small2 = torch.tensor([100.0, 100.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0, 1.0])
    r2 = {"overall": big2 + small2, "big": big2, "small": small2}
    adv2, _ = REWARD_AGGREGATIONS["batch"](r2, {"big": 1.0, "small": 1.0}, gid, valid, cfg, ADVANTAGES["grpo"])
    assert adv2[1] - adv2[0] > 1.9 and adv2[3] - adv2[2] > 1.9  # +-1 in both groups
    # an invalid sample takes no part in the batch statistics and gets 0
    v3 = torch.tensor([True, True, True, False])
    adv3, _ = REWARD_AGGREGATIONS["batch"](r2, {"big": 1.0, "small": 1.0}, gid, v3, cfg, ADVANTAGES["grpo"])
    assert adv3[3] == 0 and adv3[1] > 0 > adv3[0]
    with pytest.raises(ValueError, match="reward.name=multi"):
        REWARD_AGGREGATIONS["batch"](rewards, None, gid, valid, cfg, ADVANTAGES["grpo"])


def test_joined_rewards_keep_every_component():
    """A chunk whose reward failed on every sample has only "overall" (its rows invalid): joined with chunks that
    scored, every component stays, zeros on the failed rows (gdpo / batch read components by name)."""
    from mmrl.rollout.collect import join_rewards

    ok = {"overall": torch.tensor([1.0, 2.0]), "a": torch.tensor([0.5, 0.25])}
    failed = {"overall": torch.zeros(3)}
    got = join_rewards([ok, failed, ok])
    assert sorted(got) == ["a", "overall"] and got["a"].tolist() == [0.5, 0.25, 0, 0, 0, 0.5, 0.25]


def test_scheduled_weights_by_hand():
    from mmrl.reward import weight_schedule

    at = weight_schedule([[10, 1.0], [30, 0.0], [40, 2.0]])
    assert [at(i) for i in (0, 10, 20, 25, 30, 35, 40, 99)] == [1.0, 1.0, 0.5, 0.25, 0.0, 1.0, 2.0, 2.0]
    assert weight_schedule(0.3)(1000) == 0.3
    for bad in ([[5, 1.0], [2, 0.0]], [[0, "x"]], "ramp", [[-1, 1.0]], float("nan")):
        with pytest.raises(ValueError, match="weight"):
            weight_schedule(bad)
    m = build_reward("multi", {"components": {"a": {"name": "test_column", "weight": [[0, 1.0], [4, 0.0]]},
                                              "b": {"name": "test_column", "weight": 2.0, "kwargs": {"col": 1}}}})
    x = torch.tensor([[1.0, 3.0]])
    assert m.weights == {"a": 1.0, "b": 2.0} and m(x, [{}])["overall"].item() == 7.0
    m.set_iteration(1)
    assert m.weights == {"a": 0.75, "b": 2.0} and m(x, [{}])["overall"].item() == 6.75
    m.set_iteration(9)
    assert m(x, [{}])["overall"].item() == 6.0
    with pytest.raises(ValueError, match="components.a.weight"):  # refused when the config is checked
        check_kwargs(REWARDS, "multi", {"components": {"a": {"name": "test_column", "weight": [[3, 1], [1, 0]]}}},
                     "reward")


# ----------------------------------------------------------------------------------- the Qwen-VL judge
def test_vlm_judge_on_a_tiny_qwen25_vl(tiny_vl):
    from rewards.judges import VLMJudge

    judge = VLMJudge(tiny_vl, max_new_tokens=6, batch_size=2)
    a = torch.rand(3, 3, 56, 56) * 2 - 1
    b = -a
    ex = [{"prompt": "a red circle"}] * 3
    v = judge(a, b, ex)  # a random model: whatever it writes, verdicts are well formed
    assert v.shape == (3,) and set(v.tolist()) <= {-1.0, 0.0, 1.0} and len(judge.last_texts) == 3
    # both images reach the model, in order: swapping them changes the logits
    model = judge.model
    with torch.no_grad():
        ab = model(**judge.inputs(a[:1], b[:1], ex[:1])).logits
        ba = model(**judge.inputs(b[:1], a[:1], ex[:1])).logits
    assert not torch.allclose(ab, ba)
    # the generated answer is parsed: a model that writes "Image 2 is better" gives -1 for every pair
    answer = judge.processor.tokenizer("<answer>Image 2 is better</answer>", return_tensors="pt").input_ids

    def fake_generate(input_ids, **kw):
        return torch.cat([input_ids, answer.expand(len(input_ids), -1)], 1)

    judge.model.generate = fake_generate
    assert judge(a, b, ex).tolist() == [-1.0, -1.0, -1.0]
    pr = PairwiseReward(judge)
    r = pr(torch.cat([a, b]), ex * 2, torch.tensor([0, 0, 0, 1, 1, 1]))
    torch.testing.assert_close(r["overall"], torch.tensor([0.0, 0.5, 1.0] * 2))  # the later sample always wins


def test_per_reward_is_pref_grpos_weighted_group_z_scores():
    """per_reward: each reward z-scored within its groups, weighted and summed, no further normalization: Pref-GRPO's
    compute_weighted_advantages at its recipe's weights {unifiedreward_think: 0.4, clip: 0.6} and its std (sample,
    + 1e-8). By hand: group 0 = rows 0-2, group 1 = rows 3-5."""
    cfg = AlgoConfig(adv_std="sample", adv_eps=1e-8)
    gid, valid = torch.tensor([0, 0, 0, 1, 1, 1]), torch.ones(6, dtype=torch.bool)
    think = torch.tensor([1.0, 0.5, 0.0, 0.75, 0.25, 0.5])     # win rates
    clip = torch.tensor([0.30, 0.20, 0.10, 0.26, 0.26, 0.20])
    rewards = {"overall": 0.4 * think + 0.6 * clip, "think": think, "clip": clip}
    adv, stats = REWARD_AGGREGATIONS["per_reward"](rewards, {"think": 0.4, "clip": 0.6}, gid, valid, cfg,
                                                     ADVANTAGES["grpo"])
    # think: group 0 mean .5, sample std .5 -> [1, 0, -1]; group 1 mean .5, std .25 -> [1, -1, 0]
    # clip: group 0 mean .2, std .1 -> [1, 0, -1]; group 1 mean .24, std sqrt(.0012) = .034641 -> [.57735, .57735, -1.1547]
    z = (0.26 - 0.24) / 0.0012 ** 0.5
    want = torch.tensor([0.4 + 0.6, 0.0, -0.4 - 0.6, 0.4 + 0.6 * z, -0.4 + 0.6 * z, -0.6 * 2 * z])
    torch.testing.assert_close(adv, want, atol=1e-6, rtol=0)
    assert set(stats) >= {"adv/think/zero_std_group_frac", "adv/clip/zero_std_group_frac", "adv/abs_mean"}
    with pytest.raises(ValueError, match="reward.name=multi"):
        REWARD_AGGREGATIONS["per_reward"](rewards, None, gid, valid, cfg, ADVANTAGES["grpo"])


def test_judge_answers_read_as_mmrl_or_as_the_reference():
    """parse_verdict's two readings on the answers where they differ (Pref-GRPO's: the first <answer> block,
    case-sensitive "Image 1 is better" before "Image 2 is better", else a tie; no block: a tie)."""
    from rewards.judges import parse_verdict

    cases = {  # text: (mmrl, reference)
        "<answer>Image 1 is better</answer>": (1, 1),
        "<answer>Image 2 is better.</answer>": (-1, -1),
        "<answer>image 1 is better</answer>": (1, 0),                      # case
        "<answer>Image 1 is the better one</answer>": (1, 0),             # "is the better"
        "<answer>Image 2 is better</answer> <answer>Image 1 is better</answer>": (1, -1),  # first vs last block
        "<answer>Image 1 is better than... no, Image 2 is better</answer>": (0, 1),  # both named
        "<think>..</think> Image 2 is better": (-1, 0),                    # no block
        "<answer>Both are equally good</answer>": (0, 0),
    }
    for text, (mine, ref) in cases.items():
        assert parse_verdict(text) == mine, text
        assert parse_verdict(text, reading="reference") == ref, text
    assert parse_verdict("<answer>Video 2 is better</answer>", "video", reading="reference") == -1
    with pytest.raises(ValueError, match="reading"):
        parse_verdict("x", reading="strict")
