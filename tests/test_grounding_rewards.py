"""Grounding rewards and metrics against hand-computed values; the parser never raises."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewards.grounding import GroundingReward, format_ok, iou_v2, parse_answer
from tasks.grounding import constant_baseline
from tasks.grounding_metrics import grounding_metrics, multi_window_iou, tiou


@pytest.mark.parametrize("text,dur,want", [
    ("<think>x</think><answer>2.5 to 6</answer>", None, (2.5, 6.0)),
    ("<answer>1 to 2</answer> then <answer>3.0 and 4.5</answer>", None, (3.0, 4.5)),  # the LAST block
    ("<answer>from 1 to 2, no: 3 - 7</answer>", None, (3.0, 7.0)),                   # the LAST span in it
    ("the event is 4 to 9 seconds", None, (4.0, 9.0)),                                 # no block: whole text
    ("<answer>5 to 3</answer>", None, None),                                           # start > end
    ("<answer>soon</answer>", None, None),
    ("<answer>2 to 50</answer>", 8.0, (2.0, 8.0)),                                     # clamped to duration
    ("", None, None),
    # a minus sign is read (it was dropped: "-3 to 4" read as 3 to 4), then clamped when a duration is known
    ("<answer>-3 to 4</answer>", None, (-3.0, 4.0)),
    ("<answer>-3 to 4</answer>", 8.0, (0.0, 4.0)),
    ("<answer>-2.5 - 1</answer>", 8.0, (0.0, 1.0)),
    ("<answer>3-4</answer>", 8.0, (3.0, 4.0)),                                        # a hyphen between numbers
    ("<answer>2 to -1</answer>", 8.0, None),                                           # start > end
    ("<answer>-3 to -1</answer>", 8.0, (0.0, 0.0)),                                    # wholly before the video
])
def test_parse_answer(text, dur, want):
    assert parse_answer(text, dur) == want


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(), st.none(), st.integers(), st.binary()))
def test_parse_answer_never_raises(x):
    out = parse_answer(x, 10.0)
    assert out is None or (0 <= out[0] <= out[1] <= 10.0)


def test_tiou_and_iou_v2_by_hand():
    assert tiou((2, 6), (4, 8)) == pytest.approx(2 / 6)
    assert tiou((0, 1), (2, 3)) == 0.0
    assert tiou((3, 3), (3, 3)) == 1.0 and tiou((3, 3), (4, 4)) == 0.0  # zero-length union
    assert tiou(None, (1, 2)) == 0.0
    # iou_v2 = IoU * (1 - |s - s'| / T) * (1 - |e - e'| / T) = (2/6) * (1 - 2/10) * (1 - 2/10)
    assert iou_v2((2, 6), (4, 8), 10) == pytest.approx((2 / 6) * 0.8 * 0.8)
    assert multi_window_iou((2, 6), [(10, 12), (4, 8), (2, 5)]) == pytest.approx(3 / 4)


def test_format_and_metrics():
    assert format_ok("<think>a</think> <answer>1 to 2</answer>") == 1.0
    assert format_ok("<answer>1 to 2</answer>") == 0.0
    assert format_ok("<think>a</think><answer>1 to 2</answer> extra") == 0.0
    m = grounding_metrics([0.3, 0.5, 0.69, 0.7, 0.0])
    assert m["mIoU"] == pytest.approx(2.19 / 5)
    assert (m["R1@0.3"], m["R1@0.5"], m["R1@0.7"]) == (80.0, 60.0, 20.0)  # threshold is >=


def test_grounding_reward_components():
    ex = {"duration": 10.0, "windows": [[4.0, 8.0]]}
    out = GroundingReward(format_weight=0.1)(["<think></think><answer>2 to 6</answer>", "no answer"], [ex, ex])
    assert out["iou"].tolist() == pytest.approx([2 / 6, 0.0])
    assert out["format"].tolist() == [1.0, 0.0] and out["parsed"].tolist() == [1.0, 0.0]
    assert out["overall"].tolist() == pytest.approx([2 / 6 + 0.1, 0.0])
    v2 = GroundingReward(accuracy="iou_v2", format_weight=0.0)(["<answer>2 to 6</answer>"], [ex])
    assert v2["overall"].item() == pytest.approx((2 / 6) * 0.8 * 0.8)
    with pytest.raises(ValueError, match="iou_v2"):
        GroundingReward(accuracy="map")
    # hit bonus: [4, 7] has tIoU 0.75 >= 0.7 and earns it; [2, 6] (1/3) does not
    hit = GroundingReward(format_weight=0.0, hit_weight=0.5)(["<answer>4 to 7</answer>", "<answer>2 to 6</answer>"],
                                                              [ex, ex])
    assert hit["overall"].tolist() == pytest.approx([0.75 + 0.5, 2 / 6])
    with pytest.raises(ValueError, match="hit_threshold"):
        GroundingReward(hit_threshold=0.0)


def test_the_injected_ground_truth_earns_the_whole_reward():
    """TempSamp-R1 injects task.reference_output: with GroundingTask's default answer it must pass the format reward
    the prompt asks for (it scored format 0, so a good on-policy answer out-scored the ground truth)."""
    from tasks.grounding import GROUNDING_ANSWER, GroundingTask

    ex = {"duration": 30.0, "windows": [[11.2, 25.0]]}
    text = GroundingTask.reference_output(type("T", (), {"answer_template": GROUNDING_ANSWER})(), ex)
    out = GroundingReward(format_weight=0.1)([text], [ex])
    assert out["format"].item() == 1.0 and out["iou"].item() == pytest.approx(1.0, abs=1e-3)
    assert out["overall"].item() == pytest.approx(1.1, abs=1e-3)


def test_constant_baseline_is_fit_on_train_and_scored_on_eval():
    fit = [{"duration": 10.0, "windows": [[2.0, 6.0]]}] * 3
    res = constant_baseline(fit, [{"duration": 20.0, "windows": [[4.0, 12.0]]}])
    assert res["window_fraction"] == [0.2, 0.6] and res["mIoU"] == pytest.approx(1.0)
    assert not math.isnan(constant_baseline(fit, fit)["R1@0.7"])


def test_tempsamp_shaping_by_hand():
    from mmrl.algorithms.shaping import REWARD_SHAPINGS, TempSampKnobs

    r = torch.tensor([1.0, 0.8, 0.3, 0.0])
    out = REWARD_SHAPINGS["tempsamp"](r, TempSampKnobs(tau=0.8, alpha=1.0))
    want = [0.8 + 0.01 * math.log(1.2), 0.8, 0.8 - (math.exp(0.5) - 1) / (math.e - 1),
            0.8 - (math.exp(0.8) - 1) / (math.e - 1)]
    assert out.tolist() == pytest.approx(want, abs=1e-6)
