"""UnifiedReward-style VLM judges: the public answer formats parsed by hand and fuzzed, the pointwise reward on
tiny random-init Qwen2-VL / Qwen2.5-VL folders (shapes, determinism, unreadable answers -> NaN and counted, a
scripted answer read end to end, micro-batches = one batch, videos), on the fake accelerator, and served."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmrl.reward import REWARDS, RewardRunner
from rewards import unified_reward_prompts as ur
from rewards.judges import (PAIRWISE_STYLES, POINTWISE_STYLES, UnifiedRewardScore, VLMJudge, parse_scores,
                            parse_verdict)

EX = [{"prompt": "a red circle"}, {"prompt": "two blue squares"}, {"prompt": "a green triangle"},
      {"prompt": "a yellow circle above a red square"}, {"prompt": "three green circles"}]


# ---------------------------------------------------------------------------------------------- parsing
UR1 = POINTWISE_STYLES["unified_reward"]
UR1_VIDEO = POINTWISE_STYLES["unified_reward_video"]
UR2 = POINTWISE_STYLES["unified_reward_2"]
UR2_ANSWER = "Alignment Score (1-5): 2.694700002670288\nCoherence Score (1-5): 2.3715\nStyle Score (1-5): 2.8025\n"


@pytest.mark.parametrize("style,text,want", [
    (UR1, "red (attribute): 1\ncircle (object): 1\nFinal Score: 4", {"score": 4.0}),
    (UR1, "circle (object): 1\nsquare (object): 0\nFinal Score: 3.5", {"score": 3.5}),
    (UR1, "Final Score: **4.5**", {"score": 4.5}),
    (UR1, "final score: 2", {"score": 2.0}),
    (UR1, "Final Score: 5/5", {"score": 5.0}),
    (UR1, "Final Score: 3\n...on reflection, Final Score: 4", {"score": 4.0}),    # the last one counts
    (UR1, "I will assign a score from 1 to 5 after 'Final Score:'.", None),        # the instruction echoed
    (UR1, "Final Score: 7", None), (UR1, "Final Score: 0", None), (UR1, "Final Score: -3", None),
    (UR1, "Final Score: " + "9" * 400, None),                                       # inf, not an error
    (UR1, "The image shows a red circle.", None), (UR1, "", None), (UR1, "\n\n\n\n", None),
    (UR1_VIDEO, "visual quality: 4\ntemporal consistency: 4\ndynamic degree: 3\ntext-to-video alignment: 1\n"
                "factual consistency: 2\nFinal Score: 6", {"score": 6.0}),
    (UR1_VIDEO, "Final Score: 11", None),
    (UR2, UR2_ANSWER, {"alignment": 2.694700002670288, "coherence": 2.3715, "style": 2.8025}),
    (UR2, "Alignment Score (1-5): 4\nCoherence Score (1-5): 5", None),              # no style score
    (UR2, "Alignment Score (1-5): X\nCoherence Score (1-5): Y\nStyle Score (1-5): Z", None),
])
def test_parse_scores_on_real_looking_answers(style, text, want):
    assert parse_scores(text, style) == want


@pytest.mark.parametrize("style,text,want", [
    ("unified_reward_think", "<think>\n1. Semantic consistency: Image 1 (9/10) - ...; Image 2 (7/10) - ...\n"
                             "Total score:\nImage 1: 9=9\nImage 2: 7=7\n</think>\n"
                             "<answer>Image 1 is better</answer>", 1),
    ("unified_reward_think", "<think>...</think><answer>Image 2 is better</answer>", -1),
    ("unified_reward_think", "<think>Image 1 is better overall</think>\nImage 1 is better", 0),  # no <answer>: tie
    ("unified_reward_think_qwen3", "<think>\n        Total score:\n        Image 1: 8=8\n        Image 2: 9=9\n"
                                   "        </think>\n        <answer>Image 2 is better</answer>", -1),
    ("unified_reward_think_video", "<think>...</think>\n<answer>Video 1 is better</answer>", 1),
    ("unified_reward_think_qwen3_video", "<answer>Image 1 is better</answer>", 0),  # a video judge names videos
    ("unified_reward", "Image 2 is better.", -1),
    ("unified_reward", "Both images are equally good.", 0),
    ("default", "<think>Image 1 is better at color</think>Image 2 is better", -1),
])
def test_pairwise_styles_read_their_public_answers(style, text, want):
    s = PAIRWISE_STYLES[style]
    assert parse_verdict(text, s.noun, s.require_answer) == want


def test_every_style_formats_a_caption_verbatim():
    for s in [*PAIRWISE_STYLES.values(), *POINTWISE_STYLES.values()]:
        text = s.prompt.format(caption="a {red} circle")
        assert text.count("a {red} circle") == 1
    # the texts are the public ones: the answer formats they ask for, and the Think-qwen3 caption brackets
    assert "after 'Final Score:'" in ur.UR_POINT and "from 1 to 10 after 'Final Score:'" in ur.UR_POINT_VIDEO
    assert ur.UR_THINK_QWEN3.format(caption="x").count("「x」") == 1
    assert "\n            Dimension name: \n                Image 1 (x/10) - rationale; \n" in ur.UR_THINK_QWEN3
    with pytest.raises(KeyError, match="unified_reward_think"):
        VLMJudge("unused", style="unified_reward_thnk")


NEAR = st.sampled_from(["Final Score:", "final score", "Alignment Score (1-5):", "Coherence Score", "Style Score",
                        "Physics Score (1-5):", ":", "：", "**", "4", "4.5", ".", "-", "1e9", "9" * 40, " ", "\n",
                        "<answer>", "</answer>", "</think>", "Video 1 is better", "Image 2 is better"])
TEXTS = st.one_of(st.text(), st.lists(st.one_of(NEAR, st.text(max_size=4)), max_size=14).map("".join))


@settings(max_examples=300, deadline=None)
@given(TEXTS)
def test_parsers_never_raise(text):
    for s in POINTWISE_STYLES.values():
        got = parse_scores(text, s)
        assert got is None or (set(got) == set(s.scores) and all(s.lo <= v <= s.hi for v in got.values()))
    for s in PAIRWISE_STYLES.values():
        assert parse_verdict(text, s.noun, s.require_answer) in (-1, 0, 1)


# ------------------------------------------------------------------------------------- tiny real models
@pytest.fixture(scope="module")
def tiny_qwen2_vl(tmp_path_factory) -> str:
    from conftest import build_tiny_vl

    return build_tiny_vl(str(tmp_path_factory.mktemp("models") / "tiny-qwen2_vl"), "qwen2_vl")


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl"])
def judge_path(request, tiny_qwen2_vl, tiny_vl) -> str:
    return tiny_qwen2_vl if request.param == "qwen2_vl" else tiny_vl


def images(n: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 56, 56, generator=torch.Generator().manual_seed(seed)) * 2 - 1  # [n, 3, H, W]


def scripted(judge, answer_for):
    """Make the judge's model answer `answer_for(prompt text, mean pixel of the row's image)`: the answer depends
    on the row's own caption and image, so a row mixed up in batching gets a wrong answer."""
    model, proc = judge.vlm.load()

    def generate(input_ids, attention_mask, pixel_values, image_grid_thw, **kw):
        sizes = image_grid_thw.prod(-1).tolist()                          # patches per image
        means = [p.mean().item() for p in pixel_values.split(sizes)]
        prompts = proc.batch_decode(input_ids, skip_special_tokens=True)
        ids = [proc.tokenizer(answer_for(t, m)).input_ids for t, m in zip(prompts, means)]
        width = max(map(len, ids))
        ans = torch.tensor([i + [proc.tokenizer.pad_token_id] * (width - len(i)) for i in ids])
        return torch.cat([input_ids, ans.to(input_ids.device)], 1)      # [b, P + T]

    model.generate = generate


def test_unreadable_answers_are_nan_counted_and_invalid(judge_path):
    """A random model writes garbage: every score is NaN (never a silent 0), counted, and the runner excludes
    the samples; two calls give the same answers."""
    r = REWARDS["unified_reward"](path=judge_path, max_new_tokens=6, batch_size=2)
    out = r(images(), EX)
    assert set(out) == {"overall", "score", "parsed"} and all(v.shape == (5,) for v in out.values())
    read = torch.tensor([parse_scores(t, UR1) is not None for t in r.last_texts])
    assert len(r.last_texts) == 5 and out["parsed"].bool().tolist() == read.tolist()
    assert torch.isnan(out["overall"][~read]).all() and r.unparseable == int((~read).sum()) > 0
    texts = list(r.last_texts)
    again = r(images(), EX)
    assert r.last_texts == texts
    torch.testing.assert_close(again["overall"], out["overall"], equal_nan=True)
    rewards, valid, failures = RewardRunner(r)(images(), EX)
    assert valid.tolist() == read.tolist() and failures == int((~read).sum())
    assert rewards["overall"][~valid].eq(0).all()  # the runner zeroes invalid entries and excludes them


def test_a_scripted_answer_is_read_per_row_and_batches_do_not_matter(judge_path):
    def answer(prompt, mean_pixel):
        if "three green circles" in prompt:
            return "circle (object): 1\nI am not sure."
        return f"circle (object): 1\nFinal Score: {3 + max(-2.0, min(2.0, mean_pixel)):.4f}"

    gray = torch.linspace(-0.8, 0.8, 5).view(5, 1, 1, 1).expand(5, 3, 56, 56)  # brighter and brighter
    outs = []
    for bs in (1, 2, 5):
        r = UnifiedRewardScore(judge_path, batch_size=bs)
        scripted(r, answer)
        outs.append(r(gray, EX))
        assert r.unparseable == 1
    out = outs[0]
    for o in outs[1:]:
        assert all(torch.equal(o[k].nan_to_num(-1), out[k].nan_to_num(-1)) for k in out)
    assert out["parsed"].tolist() == [1, 1, 1, 1, 0] and math.isnan(out["overall"][4])
    s = out["score"][:4]
    assert (s.diff() > 0).all() and ((s >= 1) & (s <= 5)).all()   # each row read its own image
    torch.testing.assert_close(out["overall"][:4], s / 5)          # default scale: 1 / the top score


def test_left_padded_rows_see_what_they_see_alone(tiny_vl):
    """Greedy answers in a micro-batch equal the answers alone when every row's next-token logits do."""
    r = UnifiedRewardScore(tiny_vl)
    model, _ = r.vlm.load()
    turns = r.turns(images(3), EX[:3])
    with torch.no_grad():
        batch = model(**r.vlm.encode(turns)).logits[:, -1]                 # [3, V]
        alone = torch.cat([model(**r.vlm.encode([t])).logits[:, -1] for t in turns])
    torch.testing.assert_close(batch, alone, rtol=1e-4, atol=1e-5)


def test_two_scores_weights_and_the_wrong_modality(tiny_vl):
    r = UnifiedRewardScore(tiny_vl, style="unified_reward_2", weights={"alignment": 2.0}, scale=1.0)
    scripted(r, lambda prompt, m: UR2_ANSWER)
    out = r(images(2), EX[:2])
    assert set(out) == {"overall", "alignment", "coherence", "style", "parsed"}
    want = (2 * 2.694700002670288 + 2.3715 + 2.8025) / 4
    torch.testing.assert_close(out["overall"], torch.full((2,), want))
    with pytest.raises(ValueError, match="not scores of style"):
        UnifiedRewardScore(tiny_vl, style="unified_reward_2", weights={"aesthetics": 1.0})
    with pytest.raises(ValueError, match="pick a style"):
        r(torch.zeros(2, 3, 4, 56, 56), EX[:2])


def test_videos_as_video_inputs_and_as_frames(tiny_vl):
    vids = torch.rand(2, 3, 4, 56, 56, generator=torch.Generator().manual_seed(1)) * 2 - 1  # [N, 3, F, H, W]
    seen = []
    for style, key in [("unified_reward_video", "pixel_values_videos"), ("unified_reward_2_video", "pixel_values")]:
        r = UnifiedRewardScore(tiny_vl, style=style, max_new_tokens=4)
        model, _ = r.vlm.load()
        real = model.generate
        model.generate = lambda **kw: seen.append(kw) or real(**kw)
        out = r(vids, EX[:2])
        assert all(v.shape == (2,) for v in out.values()) and key in seen[-1]
    assert seen[0]["video_grid_thw"].shape == (2, 3)       # one video per sample
    assert seen[1]["image_grid_thw"].shape == (2 * 4, 3)   # 4 frames (all there are) per sample as images
    j = VLMJudge(tiny_vl, style="unified_reward_think_video", max_new_tokens=4)
    assert j.inputs(vids, -vids, EX[:2])["video_grid_thw"].shape == (4, 3)  # both videos of each pair
    assert j(vids, -vids, EX[:2]).shape == (2,)


def test_think_style_judge_end_to_end(tiny_vl):
    """The Think prompt reaches the model with the caption in its brackets; the public answer decides."""
    j = VLMJudge(tiny_vl, style="unified_reward_think_qwen3")
    prompts = []

    def answer(prompt, mean_pixel):
        prompts.append(prompt)
        return "<think>\nTotal score:\nImage 1: 5=5\nImage 2: 8=8\n</think>\n<answer>Image 2 is better</answer>"

    scripted(j, answer)
    a = images(2)
    assert j(a, -a, EX[:2]).tolist() == [-1.0, -1.0] and j.unparseable == 0
    assert "「two blue squares」" in prompts[1] and "Image 2 is better" in prompts[1]


def test_every_tensor_goes_to_the_accelerator(tiny_vl):
    from mmrl.testing.fake_device import fake_accelerator

    want = UnifiedRewardScore(tiny_vl, max_new_tokens=3, batch_size=1)
    ref = want(images(2), EX[:2])
    with fake_accelerator() as dev:
        r = UnifiedRewardScore(tiny_vl, device=dev, max_new_tokens=3, batch_size=1)
        model, _ = r.vlm.load()
        assert all(p.device == dev for p in model.parameters())
        real, seen = model.generate, []
        model.generate = lambda **kw: seen.append(kw) or real(**kw)
        out = r(images(2), EX[:2])
    assert len(seen) == 2 and all(v.device == dev for kw in seen for v in kw.values() if torch.is_tensor(v))
    assert r.last_texts == want.last_texts and all(v.device.type == "cpu" for v in out.values())
    torch.testing.assert_close(out["overall"], ref["overall"], equal_nan=True)


def test_served_equals_direct(tiny_vl):
    from mmrl.reward_server import RemoteReward, RewardServer

    r = UnifiedRewardScore(tiny_vl, batch_size=4)
    scripted(r, lambda prompt, m: f"Final Score: {3 + max(-2.0, min(2.0, m)):.4f}")
    x = images(4, seed=3)
    direct = r(x, EX[:4])
    srv = RewardServer(r, "unified_reward", max_wait_ms=1).start()
    try:
        served = RemoteReward(srv.url, timeout_s=30, retries=0)(x, EX[:4])
    finally:
        srv.close()
    assert set(served) == set(direct)
    for k in direct:
        torch.testing.assert_close(served[k], direct[k], equal_nan=True)


def test_clips_are_sampled_at_two_fps_of_their_own_rate():
    """A 33-frame 16-fps clip shows 4 frames (33 / 16 * 2, at least 4, even) at linspace(0, 32, 4).round(), as
    qwen-vl-utils samples a 2-fps video; without clip_fps every frame is shown."""
    from rewards.judges import ChatVLM

    clip = torch.arange(33.0).view(33, 1, 1, 1).expand(33, 3, 2, 2)
    got = ChatVLM("unused", clip_fps=16).sampled(clip)
    assert got[:, 0, 0, 0].tolist() == [0.0, 11.0, 21.0, 32.0]
    assert ChatVLM("unused", clip_fps=16, video_fps=4).sampled(clip).shape[0] == 8  # 33 / 16 * 4 = 8.25
    assert ChatVLM("unused").sampled(clip).shape[0] == 33
