"""The embedded shapes world: grammar, held-out split, renderer and detector."""

import random

import numpy as np
import pytest
import torch

from rewards.shapes import ShapesReward, detect, score
from tasks import shapes as S


def test_grammar_and_split():
    ps = S.all_prompts()
    assert len({p.text for p in ps}) == len(ps) == 948
    assert {p.spec.category for p in ps} == set(S.CATEGORIES)
    train, held = {p.text for p in S.prompts("train")}, {p.text for p in S.prompts("heldout")}
    assert not train & held and len(train) + len(held) == len(ps)
    assert len(held) >= 450
    assert S.parse("a photo of a red circle and a blue square").objects == (S.Obj("circle", "red"), S.Obj("square", "blue"))
    with pytest.raises(ValueError, match="not a shapes-world prompt"):
        S.parse("a purple hexagon")


def test_detector_exact_on_rendered_ground_truth():
    rng = random.Random(0)
    ps = S.all_prompts()
    for _ in range(600):
        p = ps[rng.randrange(len(ps))]
        img = np.asarray(S.render(p.spec, 24, rng))
        assert score(p.spec, detect(img), 24) == (1.0, 1.0), p.text


def test_detector_hand_cases():
    img = np.full((24, 24, 3), 128, np.uint8)
    img[2:9, 2:9] = S.COLORS["red"]            # red square top-left
    img[14:21, 14:21] = S.COLORS["blue"]       # blue square bottom-right
    dets = detect(img)
    assert sorted((d.shape, d.color) for d in dets) == [("square", "blue"), ("square", "red")]
    above = S.Spec("position", (S.Obj("square"), S.Obj("square")), "above")
    assert score(above, dets, 24)[0] == 1.0
    below = S.Spec("position", (S.Obj("square"), S.Obj("square")), "below")
    assert score(below, dets, 24) == (0.0, 0.75)  # count, both objects found; relation wrong
    assert score(S.parse("three squares"), dets, 24) == (0.0, 0.0)
    assert score(S.parse("a red circle"), dets, 24)[0] == 0.0
    assert score(S.parse("two squares"), dets, 24) == (1.0, 1.0)


def test_reward_callable_shapes():
    rng = random.Random(1)
    texts = ["a green triangle", "two circles"]
    imgs = torch.stack([S.to_tensor(S.render(S.parse(t), 24, rng)) for t in texts])
    out = ShapesReward()(imgs, [{"prompt": t} for t in texts])
    assert out["strict"].tolist() == [1.0, 1.0] and out["overall"].shape == (2,)
    blank = torch.zeros(2, 3, 24, 24)
    assert ShapesReward()(blank, texts)["strict"].tolist() == [0.0, 0.0]


def test_saturation_proxy_by_hand():
    """The hackable proxy pays for colored area: a quarter of the image pure red (chroma 1) -> 0.25."""
    img = torch.zeros(1, 3, 8, 8)            # gray background
    img[0, 0, :4, :4] = 1.0                  # red channel 255 ...
    img[0, 1:, :4, :4] = -1.0                # ... green and blue 0
    out = ShapesReward(strict_weight=1.0, saturation_weight=2.0)(img, ["a red square"])
    assert out["saturation"].item() == pytest.approx(0.25, abs=1e-3)
    assert out["overall"].item() == pytest.approx(out["strict"].item() + 0.5, abs=2e-3)
    assert "saturation" not in ShapesReward()(img, ["a red square"])


def test_pooled_text_embedding_sees_the_whole_prompt():
    """The embedded worlds' CLIP text encoder pools at <eos> (not at the highest token id, transformers' legacy
    path for eos_token_id 2), so prompts differing only in their last word get different pooled embeddings."""
    from mmrl.models.pixel_t2i import build_text_encoder, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer("a video of red circle moving left right".split())
    assert tok.eos_token_id != 2
    enc = build_text_encoder(tok)
    ids = tok(["a red circle moving left", "a red circle moving right"], padding="max_length", max_length=16,
              return_tensors="pt")
    pooled = enc(input_ids=ids.input_ids, attention_mask=ids.attention_mask).text_embeds      # [2, D]
    assert (pooled[0] - pooled[1]).abs().max() > 1e-4
