"""The arithmetic task and its exact-answer reward (the verifiable text task of the SmolLM2 run)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.config import TaskConfig
from tasks.arithmetic import ArithmeticTask
from rewards.arithmetic import ArithmeticReward, parse_last_int
from tasks import arithmetic


@pytest.mark.parametrize("text,value", [
    ("12 + 30 = 42", 42), ("The answer is -7.", -7), ("1,234", 1234), ("42", 42), ("  85\n", 85),
    ("forty-two", None), ("", None), ("78 - 79 is 1.", 1), ("x=3, y=-15", -15), ("3.5", 5),
])
def test_parse_last_int(text, value):
    assert parse_last_int(text) == value


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parse_never_raises(text):
    v = parse_last_int(text)
    assert v is None or isinstance(v, int)


def test_reward_hand_values():
    exs = [{"answer": 42}, {"answer": -1}, {"answer": 5}, {"answer": 7}]
    r = ArithmeticReward(format_weight=0.1)(["40 + 2 = 42", "-1", "five", " 8.\n"], exs)
    assert r["correct"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert r["parsed"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert r["bare"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert torch.allclose(r["overall"], torch.tensor([1.0, 1.1, 0.0, 0.1]))


def test_splits_disjoint_and_answers_right():
    train, held = arithmetic.problems("train", 10, 30, "+-*"), arithmetic.problems("heldout", 10, 30, "+-*")
    assert len(train) + len(held) == 3 * 21 * 21
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in held}
    for p in random.Random(0).sample(train, 20):
        a, b = p["a"], p["b"]
        assert p["answer"] == {"+": a + b, "-": a - b, "*": a * b}[p["op"]]
    task = ArithmeticTask(TaskConfig(eval_prompts=50), lo=10, hi=30)
    assert len(task.eval_examples()) == 50
    assert all(ex["prompt"] in {p["prompt"] for p in held} for ex in task.eval_examples())


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="valid"):
        arithmetic.problems("train", ops="+/")
    with pytest.raises(ValueError, match="split"):
        arithmetic.problems("test")
