"""GenEval: its rules on hand-made detections, the metadata reader and task split, the rules against the shapes
reward's own on rendered scenes, and the reward on tiny random-init OWLv2 / Grounding DINO / CLIP models."""

import json
import logging
import os
import random
import runpy

import numpy as np
import pytest
import torch

from mmrl.reward import REWARDS, RewardRunner
from mmrl.task import TASKS
from rewards.geneval import (Rules, box_iou, geneval_score, judge, keep_detections, relative_position,
                             shapes_detections, shapes_metadata)
from tasks.geneval import check_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEFT, RIGHT = (0, 40, 10, 50), (30, 40, 40, 50)   # boxes xyxy, same row
TOP, BOTTOM = (40, 0, 50, 10), (40, 30, 50, 40)   # same column


def meta(tag, include, exclude=None):
    return {"tag": tag, "prompt": "p", "include": include, **({"exclude": exclude} if exclude else {})}


def dets(cls, *scored):
    """{cls: [(box, score, colour), ...]} with distinct boxes along a row."""
    return {cls: [((20 * i, 0, 20 * i + 10, 10), s, c) for i, (s, c) in enumerate(scored)]}


# ------------------------------------------------------------------------------------------------------ rules
def test_relative_position_by_hand():
    assert relative_position(LEFT, RIGHT) == {"left of"}       # offset (-30, 0), shrunk by 0.1 x 20 -> dx = -0.93
    assert relative_position(RIGHT, LEFT) == {"right of"}
    assert relative_position(TOP, BOTTOM) == {"above"}
    assert relative_position(BOTTOM, TOP) == {"below"}
    # diagonal: offset (-20, -20) shrunk to (-18, -18), / 28.28 -> -0.64 on both axes: both relations hold
    assert relative_position((0, 0, 10, 10), (20, 20, 30, 30)) == {"left of", "above"}
    # a knight's move: offset (-10, -20) shrunk to (-8, -18), / 22.36 -> dx = -0.36 (not left), dy = -0.80
    assert relative_position((0, 0, 10, 10), (10, 20, 20, 30)) == {"above"}
    # inside the dead zone (|offset| <= 0.1 x summed sizes on both axes): no relation
    assert relative_position((0, 0, 10, 10), (1, 1, 11, 11)) == set()
    # c scales the shrink: offset 5 less 0.1 x 20 leaves 3 / 5 = 0.6 (left of); less 0.2 x 20 leaves 1 / 5 = 0.2
    assert relative_position((0, 0, 10, 10), (5, 0, 15, 10)) == {"left of"}
    assert relative_position((0, 0, 10, 10), (5, 0, 15, 10), c=0.2) == set()


def test_keep_detections_threshold_order_cap_and_nms():
    raw = dets("dog", (0.3, None), (0.31, None), (0.95, None), (0.5, None))
    assert [d[1] for d in keep_detections(raw, "two_object")["dog"]] == [0.95, 0.5, 0.31]  # > 0.3, best first
    assert [d[1] for d in keep_detections(raw, "counting")["dog"]] == [0.95]               # > 0.9 for counting
    assert [d[1] for d in keep_detections(raw, "colors", Rules(max_objects=2))["dog"]] == [0.95, 0.5]
    assert keep_detections(dets("dog", (0.2, None)), "colors") == {}
    # GenEval's IoU counts pixels inclusively: 10 x 10 boxes overlapping 5 columns -> 50 / 150
    assert box_iou((0, 0, 9, 9), (5, 0, 14, 9)) == pytest.approx(1 / 3)
    dup = {"dog": [((0, 0, 9, 9), 0.9, None), ((5, 0, 14, 9), 0.8, None), ((40, 0, 49, 9), 0.7, None)]}
    assert len(keep_detections(dup, "colors")["dog"]) == 3                                 # default: no NMS
    assert [d[1] for d in keep_detections(dup, "colors", Rules(max_overlap=0.3))["dog"]] == [0.9, 0.7]
    assert len(keep_detections(dup, "colors", Rules(max_overlap=0.34))["dog"]) == 3        # 1/3 < 0.34 survives


def test_judge_counting_threshold_and_exclusion():
    two = meta("counting", [{"class": "dog", "count": 2}], [{"class": "dog", "count": 3}])
    assert judge(two, dets("dog", (0.95, None), (0.92, None))) == (True, "")
    ok, why = judge(two, dets("dog", (0.95, None), (0.85, None), (0.6, None)))  # only one above 0.9
    assert not ok and "expected dog >= 2, found 1" in why
    ok, why = judge(two, dets("dog", (0.95, None), (0.92, None), (0.91, None)))  # a third: excluded
    assert not ok and "expected dog < 3, found 3" in why
    # the same detections under a non-counting tag use threshold 0.3: three dogs then satisfy "at least one"
    assert judge(meta("single_object", [{"class": "dog", "count": 1}]), dets("dog", (0.95, None), (0.85, None),
                                                                           (0.6, None)))[0]


def test_judge_colour_on_the_best_detections_only():
    red_car = meta("colors", [{"class": "car", "count": 1, "color": "red"}])
    assert judge(red_car, dets("car", (0.8, "red")))[0]
    ok, why = judge(red_car, dets("car", (0.8, "blue")))
    assert not ok and "red car" in why
    # GenEval colours only the best `count` detections: a red car behind a better-scored blue one does not count
    assert not judge(red_car, dets("car", (0.9, "blue"), (0.5, "red")))[0]
    assert not judge(red_car, {})[0]
    with pytest.raises(ValueError, match="no colour"):
        judge(red_car, dets("car", (0.9, None)))


@pytest.mark.parametrize("rel", ["left of", "right of", "above", "below"])
def test_judge_position_each_relation(rel):
    """dog `rel` teddy bear: correct exactly when the dog's box is placed that way."""
    m = meta("position", [{"class": "teddy bear", "count": 1},
                          {"class": "dog", "count": 1, "position": [rel, 0]}])
    placements = {"left of": (LEFT, RIGHT), "right of": (RIGHT, LEFT), "above": (TOP, BOTTOM), "below": (BOTTOM, TOP)}
    for placed, (dog, bear) in placements.items():
        ok, why = judge(m, {"dog": [(dog, 0.9, None)], "teddy bear": [(bear, 0.9, None)]})
        assert ok == (placed == rel), (placed, why)
    ok, why = judge(m, {"dog": [(LEFT, 0.9, None)]})  # no target: the clause fails and says so
    assert not ok and "teddy bear >= 1" in why and f"no target for dog to be {rel}" in why


def test_judge_position_checks_every_object_against_every_target():
    m = meta("position", [{"class": "cup", "count": 2}, {"class": "dog", "count": 1, "position": ["left of", 0]}])
    cups = [((30, 0, 40, 10), 0.9, None), ((30, 40, 40, 50), 0.8, None)]
    # left of the first cup (dx = -0.8) but not of the second, 40 px lower (offset (-10, -40): dx = -0.19)
    assert judge(m, {"cup": cups, "dog": [((20, 0, 30, 10), 0.9, None)]})[0] is False
    assert judge(m, {"cup": cups, "dog": [((0, 20, 10, 30), 0.9, None)]})[0] is True


def test_judge_two_object_and_color_attr():
    two = meta("two_object", [{"class": "cat", "count": 1}, {"class": "bus", "count": 1}])
    assert judge(two, {**dets("cat", (0.5, None)), **dets("bus", (0.5, None))})[0]
    assert not judge(two, dets("cat", (0.5, None)))[0]
    # GenEval does not penalise objects it was not asked about (only counting prompts exclude)
    extra = {**dets("cat", (0.5, None), (0.5, None)), **dets("bus", (0.5, None)), **dets("dog", (0.9, None))}
    assert judge(two, extra)[0]
    attr = meta("color_attr", [{"class": "cat", "count": 1, "color": "pink"},
                               {"class": "bus", "count": 1, "color": "green"}])
    assert judge(attr, {**dets("cat", (0.5, "pink")), **dets("bus", (0.5, "green"))})[0]
    ok, why = judge(attr, {**dets("cat", (0.5, "green")), **dets("bus", (0.5, "pink"))})
    assert not ok and "pink cat" in why and "green bus" in why


def test_geneval_score_is_a_mean_over_tags():
    means = {"overall": 0.5, "is/counting": 0.25, "correct/counting": 0.25, "is/colors": 0.75, "correct/colors": 0.25,
             "is/position": 0.0, "correct/position": 0.0}
    got = geneval_score(means)
    assert got == pytest.approx({"counting": 1.0, "colors": 1 / 3, "geneval": 2 / 3})  # not the image mean 0.5


# ------------------------------------------------------------------------------------------- metadata, task
def test_shipped_metadata_is_genevals_553_prompts():
    t = TASKS["geneval"](None, heldout_fraction=0.5)
    rows = t.train + t.heldout
    counts = {tag: sum(r["tag"] == tag for r in rows) for tag in dict.fromkeys(r["tag"] for r in rows)}
    assert counts == {"single_object": 80, "two_object": 99, "counting": 80, "colors": 94, "position": 100,
                      "color_attr": 100}
    assert all(r["category"] == r["tag"] for r in rows)
    assert rows[0]["include"] and {"prompt", "tag", "include"} <= set(rows[0])


@pytest.mark.parametrize("bad, field", [
    ("{not json", "not valid JSON"),
    ({"tag": "colors", "prompt": "a photo of a dog"}, "'include'"),
    ({"tag": "colors", "include": [{"class": "dog", "count": 1}]}, "'prompt'"),
    ({"prompt": "p", "include": [{"class": "dog", "count": 1}]}, "'tag'"),
    ({"tag": "t", "prompt": "p", "include": [{"class": "dog", "count": 0}]}, "include[0] needs 'count'"),
    ({"tag": "t", "prompt": "p", "include": [{"count": 1}]}, "include[0] has no 'class'"),
    ({"tag": "t", "prompt": "p", "include": [{"class": "dog", "count": 1, "color": "teal"}]}, "'teal'"),
    ({"tag": "t", "prompt": "p", "include": [{"class": "dog", "count": 1, "colour": "red"}]},
     "unknown keys ['colour']"),
    ({"tag": "t", "prompt": "p", "include": [{"class": "a", "count": 1, "position": ["left of", 0]},
                                            {"class": "b", "count": 1}]}, "include[0] position"),
    ({"tag": "t", "prompt": "p", "include": [{"class": "a", "count": 1}, {"class": "b", "count": 1,
                                            "position": ["beside", 0]}]}, "include[1] position"),
    ({"tag": "t", "prompt": "p", "include": [{"class": "a", "count": 1}], "exclude": [{"class": "a"}]}, "exclude[0]"),
])
def test_metadata_reader_names_line_and_field(tmp_path, bad, field):
    good = {"tag": "counting", "prompt": "two dogs", "include": [{"class": "dog", "count": 2}],
            "exclude": [{"class": "dog", "count": 3}]}
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + (bad if isinstance(bad, str) else json.dumps(bad)) + "\n")
    with pytest.raises(ValueError) as e:
        TASKS["geneval"](None, metadata=str(path))
    assert f"{path}:3" in str(e.value) and field in str(e.value)


def test_task_split_is_per_tag_seeded_and_disjoint(caplog):
    make = TASKS["geneval"]
    a, b, c = make(None, heldout_fraction=0.5), make(None, heldout_fraction=0.5), make(None, heldout_fraction=0.5,
                                                                                        split_seed=1)
    train, held = {e["prompt"] for e in a.train}, {e["prompt"] for e in a.eval_examples()}
    assert not train & held and len(train | held) == 553
    assert [e["prompt"] for e in a.eval_examples()] == [e["prompt"] for e in b.eval_examples()]
    assert {e["prompt"] for e in c.eval_examples()} != held
    for tag, n in {"single_object": 80, "two_object": 99, "position": 100}.items():
        assert sum(e["tag"] == tag for e in a.eval_examples()) == round(0.5 * n)  # every tag keeps its share
    s1, s2 = a.sample(16, random.Random(3)), a.sample(16, random.Random(3))
    assert s1 == s2 and all(e["prompt"] in train for e in s1)
    s1[0]["include"][0]["count"] = 99  # examples are copies
    assert a.sample(16, random.Random(3))[0]["include"][0]["count"] != 99
    only = make(None, tags=["counting"], heldout_fraction=0.25)
    assert {e["tag"] for e in only.train + only.heldout} == {"counting"} and len(only.heldout) == 20
    with pytest.raises(ValueError, match="'colours'"):
        make(None, tags=["colours"])
    with caplog.at_level(logging.WARNING):
        whole = make(None)
    assert len(whole.eval_examples()) == 553 and "not held out" in caplog.text


def test_task_refuses_prompt_file():
    class Cfg:
        prompt_file = "prompts.jsonl"

    with pytest.raises(ValueError, match="task.kwargs.metadata"):
        TASKS["geneval"](Cfg())


# -------------------------------------------------------------------------------------------- shapes world
def test_shapes_detections_boxes_and_metadata():
    from PIL import Image, ImageDraw

    from tasks.shapes import BACKGROUND, Obj, Placed, Spec, _draw, parse

    img = Image.new("RGB", (36, 36), BACKGROUND)
    a, b = Placed("circle", "red", 6, 6, 5), Placed("triangle", "blue", 18, 30, 5)  # one cell across, two down
    for p in (a, b):
        _draw(ImageDraw.Draw(img), p)
    det = shapes_detections(np.asarray(img))
    assert det == {"circle": [((1.0, 1.0, 12.0, 12.0), 1.0, "red")],
                   "triangle": [((13.0, 25.0, 24.0, 36.0), 1.0, "blue")]}  # pixel extents, x1 and y1 exclusive
    spec = parse("a circle left of a triangle")
    m = shapes_metadata(spec, "a circle left of a triangle")
    assert m["include"] == [{"class": "triangle", "count": 1},
                            {"class": "circle", "count": 1, "position": ["left of", 0]}]
    # the knight's move: the shapes rule (centres 12 px apart > 36 / 8) says left of, GenEval's says only above
    from rewards.shapes import detect, score

    assert score(spec, detect(np.asarray(img)), 36)[0] == 1.0
    ok, why = judge(m, det)
    assert not ok and "found above" in why
    counting = shapes_metadata(Spec("counting", (Obj("square"),) * 3), "three squares")
    assert counting["exclude"] == [{"class": "square", "count": 4}] and check_metadata(counting, "x") is counting


def test_geneval_rules_agree_with_shapes_rules_on_renders():
    """Every disagreement is a known rule difference; without extra objects or a position prompt they agree."""
    res = runpy.run_path(os.path.join(ROOT, "scripts", "geneval_agreement.py"))["agreement"](6, seed=0)
    tags = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
    assert res["total"]["disagree"]["other"] == 0 and res["total"]["n"] == 6 * 3 * 6
    for tag in tags:
        r = res[tag]
        assert r["agree"] + sum(r["disagree"].values()) == r["n"] == 18
        assert r["by_mode"]["own"]["agree"] == 6 or tag == "position"
        assert r["by_mode"]["same_tag"]["agree"] == 6 or tag == "position"
        assert 0 < r["geneval_correct"] < r["n"]  # both verdicts occur
        if tag != "position":
            assert r["disagree"]["position_rule"] == 0
    assert res["single_object"]["disagree"]["extra_objects"] > 0  # GenEval's leniency shows up where expected


# ------------------------------------------------------------------------------------------------ models


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Folders of tiny random-init OWLv2, Grounding DINO and CLIPModel (real classes, local tokenizers)."""
    from transformers import BertTokenizer, GroundingDinoConfig, GroundingDinoForObjectDetection, \
        GroundingDinoImageProcessor, GroundingDinoProcessor

    from mmrl.testing.tiny_rewards import WORDS, tiny_clip, tiny_owlv2

    root = tmp_path_factory.mktemp("geneval")
    tiny_owlv2(str(root / "owlv2"))
    tiny_clip(str(root / "clip"))
    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + WORDS.split()
    bert = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    gd = GroundingDinoConfig(
        backbone_config=dict(model_type="swin", embed_dim=16, depths=[1, 1], num_heads=[1, 1], window_size=4,
                             image_size=32, out_features=["stage1", "stage2"]),
        text_config=dict(model_type="bert", vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=64),
        d_model=32, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        encoder_attention_heads=2, decoder_attention_heads=2, num_queries=10, num_feature_levels=2,
        encoder_n_points=2, decoder_n_points=2, max_text_len=32)  # decoder_layers=1 breaks box-head weight tying
    GroundingDinoForObjectDetection(gd).save_pretrained(root / "gdino")
    GroundingDinoProcessor(GroundingDinoImageProcessor(size={"shortest_edge": 32, "longest_edge": 64}),
                           bert).save_pretrained(root / "gdino")
    return {k: str(root / k) for k in ("owlv2", "clip", "gdino")}


def examples(tags=None):
    rows = TASKS["geneval"](None, heldout_fraction=0.5).eval_examples()
    rows = [r for r in rows if r["tag"] in tags] if tags else rows
    by_tag = {}
    for r in rows:
        by_tag.setdefault(r["tag"], r)
    return list(by_tag.values())


def images(n, h=40, w=48, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.mark.parametrize("detector", ["owlv2", "gdino"])
def test_reward_scores_with_tiny_detectors(tiny_models, detector):
    exs = examples()  # one example of each of the six tags
    kind = {"owlv2": "owlv2", "gdino": "grounding_dino"}[detector]
    reward = REWARDS["geneval"](detector_path=tiny_models[detector], clip_path=tiny_models["clip"], detector=kind,
                                batch_size=4)
    imgs = images(len(exs))
    r = reward(imgs, exs)
    assert set(r) == {"overall"} | {f"{k}/{t}" for k in ("is", "correct") for t in
                                    ("single_object", "two_object", "counting", "colors", "position", "color_attr")}
    assert all(v.shape == (6,) and set(v.tolist()) <= {0.0, 1.0} for v in r.values())
    assert torch.equal(sum(r[k] for k in r if k.startswith("is/")), torch.ones(6))
    assert all(torch.equal(r[f"correct/{e['tag']}"][i], r["overall"][i]) for i, e in enumerate(exs))
    assert all(torch.equal(reward(imgs, exs)[k], v) for k, v in r.items())  # deterministic
    # raw detections: boxes inside the (non-square) image, classes among the queries
    raw = reward.detect(np.zeros((2, 40, 48, 3), np.uint8), exs[:2])
    for d, e in zip(raw, exs[:2]):
        assert set(d) <= {c["class"] for c in e["include"]}
        assert all(0 <= b[0] <= b[2] <= 48 and 0 <= b[1] <= b[3] <= 40 and s > 0.3 for v in d.values() for b, s in v)
    # whatever the weights: with every box kept (threshold below any score, no NMS) a single object is found and a
    # count of 2 always sees too many; with none kept, nothing is correct
    one = [e for e in exs if e["tag"] in ("single_object", "counting")]
    loose = REWARDS["geneval"](detector_path=tiny_models[detector], detector=kind, threshold=-1.0,
                               counting_threshold=-1.0, max_overlap=1.0)
    assert loose(imgs[:2], one)["overall"].tolist() == [1.0, 0.0]
    strict = REWARDS["geneval"](detector_path=tiny_models[detector], detector=kind, threshold=1.0,
                                counting_threshold=1.0)
    assert strict(imgs[:2], one)["overall"].tolist() == [0.0, 0.0]


def test_grounding_dino_class_tokens(tiny_models):
    from transformers import AutoProcessor

    from rewards.geneval import _token_spans

    proc = AutoProcessor.from_pretrained(tiny_models["gdino"])
    text = "red car. dog."
    ids = proc(images=[np.zeros((8, 8, 3), np.uint8)], text=[text], return_tensors="pt")["input_ids"][0]
    # [CLS] red car . dog . [SEP]
    assert proc.tokenizer.convert_ids_to_tokens(ids.tolist())[1:6] == ["red", "car", ".", "dog", "."]
    assert _token_spans(proc.tokenizer, text, ["red car", "dog"], ids) == [[1, 2], [4]]


def test_colour_reads_only_the_box(tiny_models):
    from rewards.geneval import _ClipColors

    colors = _ClipColors(tiny_models["clip"], "cpu", batch_size=2)
    img = images(1, seed=1)[0]
    boxes = [(2.0, 3.0, 20.0, 25.0), (20.4, 0.0, 48.0, 40.0), (47.0, 39.0, 47.0, 39.0)]  # the last one is empty
    got = colors(img, boxes, "car")
    outside = img.clone()
    outside[:, 30:, :] = 1.0  # below the first box
    assert colors(outside, boxes[:1], "car") == got[:1] and len(got) == 3
    assert set(got) <= {"red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white"}


def test_reward_refuses_and_isolates(tiny_models):
    exs = examples(["colors", "single_object"])
    with pytest.raises(ValueError, match="grounding_dino"):
        REWARDS["geneval"](detector_path=tiny_models["owlv2"], detector="yolo")
    no_clip = REWARDS["geneval"](detector_path=tiny_models["owlv2"])
    with pytest.raises(ValueError, match="clip_path"):
        no_clip(images(2), exs)
    with pytest.raises(ValueError, match="no GenEval metadata"):
        no_clip(images(1), [{"prompt": "a photo of a dog"}])
    with pytest.raises(ValueError, match="tags are"):
        REWARDS["geneval"](detector_path=tiny_models["owlv2"], tags=["colors"])(images(1), exs[:1])

    def broken(imgs, classes, threshold):
        if "tv" in classes:
            raise RuntimeError("CUDA out of memory")
        return [{}]

    single = [e for e in TASKS["geneval"](None).eval_examples() if e["tag"] == "single_object"]
    batch = [next(e for e in single if e["include"][0]["class"] == "tv"), single[0]]
    no_clip.detector = broken
    runner = RewardRunner(no_clip)
    out, valid, failures = runner(images(2), batch)
    assert valid.tolist() == [False, True] and failures == 1
    assert "a photo of a tv" in runner.last_error and "CUDA out of memory" in runner.last_error
