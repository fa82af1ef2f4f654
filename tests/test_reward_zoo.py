"""Pointwise reward models on tiny random-init instances of their real classes, checked by hand against the
models' own forward passes; OCR on rendered text with the real RapidOCR models; video rewards."""

import json
import random

import numpy as np
import pytest
import torch

from mmrl.compose import build_reward
from mmrl.reward import REWARDS

open_clip = pytest.importorskip("open_clip")

TINY = {"embed_dim": 32,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 16, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """(arch name, checkpoint path, model) of a tiny open_clip CLIP registered under a config name."""
    d = tmp_path_factory.mktemp("clip")
    (d / "mmrl-tiny-clip.json").write_text(json.dumps(TINY))
    open_clip.add_model_config(str(d / "mmrl-tiny-clip.json"))
    torch.manual_seed(0)
    model = open_clip.create_model("mmrl-tiny-clip", pretrained=None).eval()
    torch.save(model.state_dict(), d / "tiny.pt")
    torch.save({"state_dict": model.state_dict()}, d / "hps.pt")  # HPS checkpoints wrap it in "state_dict"
    return "mmrl-tiny-clip", str(d), model


def images(n=4, size=32, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def manual_cosine(model, imgs, texts):
    """The cosine the open_clip way: its own PIL preprocessing transform, encode, normalize."""
    from PIL import Image

    pre = open_clip.image_transform(model.visual.image_size, is_train=False)
    u8 = ((imgs + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    px = torch.stack([pre(Image.fromarray(x)) for x in u8])
    tok = open_clip.get_tokenizer("mmrl-tiny-clip")(texts)
    with torch.no_grad():
        return (model.encode_image(px, normalize=True) * model.encode_text(tok, normalize=True)).sum(-1)


PROMPTS = ["a red circle", "two blue squares", "a green triangle above a red circle", "three squares"]


def test_clip_score_matches_open_clip_forward(tiny_clip):
    arch, d, model = tiny_clip
    imgs = images()
    r = REWARDS["clip_score"](arch=arch, pretrained=f"{d}/tiny.pt")(imgs, [{"prompt": p} for p in PROMPTS])
    want = manual_cosine(model, imgs, PROMPTS)
    # images are already at the model size: only the uint8 rounding of the PIL path differs
    torch.testing.assert_close(r["cosine"], want, atol=2e-3, rtol=0)
    torch.testing.assert_close(r["overall"], 2.5 * r["cosine"].clamp(min=0))


def test_clip_preprocess_matches_pil_resize_and_crop(tiny_clip):
    from PIL import Image

    from rewards.clip_models import clip_preprocess

    _, _, model = tiny_clip
    low = torch.rand(1, 3, 6, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    x = torch.nn.functional.interpolate(low, size=(48, 64), mode="bilinear")  # smooth, non-square: short side -> 32, crop
    pre = open_clip.image_transform(32, is_train=False)
    want = pre(Image.fromarray(((x[0] + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()))
    got = clip_preprocess(x, 32, open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)[0]
    assert got.shape == want.shape == (3, 32, 32)
    assert (got - want).abs().mean() < 0.03  # bicubic kernels differ slightly between torch and PIL
    shifted = clip_preprocess(x[..., 4:], 32, open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)[0]
    assert (shifted - want).abs().mean() > 3 * (got - want).abs().mean()  # a misplaced crop would show


def test_openai_clip_checkpoints_load_with_quick_gelu(tiny_clip, tmp_path):
    """OpenAI's CLIP weights (a TorchScript archive, or its state dict with the config entries) are read and run
    with QuickGELU, as OpenAI's models compute; the same weights with plain GELU score differently."""
    arch, _, _ = tiny_clip
    torch.manual_seed(1)
    quick = open_clip.create_model(arch, force_quick_gelu=True).eval()
    torch.jit.script(quick).save(str(tmp_path / "ViT-openai.pt"))
    torch.save({**quick.state_dict(), "input_resolution": torch.tensor(32), "context_length": torch.tensor(77),
                "vocab_size": torch.tensor(49408)}, tmp_path / "openai-state.pt")
    from rewards.clip_models import clip_preprocess

    imgs = images(seed=6)
    with torch.no_grad():
        px = clip_preprocess(imgs, 32, open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)
        want = (quick.encode_image(px, normalize=True)
                * quick.encode_text(open_clip.get_tokenizer(arch)(PROMPTS), normalize=True)).sum(-1)
    for f in ("ViT-openai.pt", "openai-state.pt"):
        got = REWARDS["clip_score"](arch=arch, pretrained=str(tmp_path / f))(imgs, PROMPTS)["cosine"]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    gelu = REWARDS["clip_score"](arch=arch, pretrained=str(tmp_path / "openai-state.pt"), quick_gelu=False)
    assert (gelu(imgs, PROMPTS)["cosine"] - want).abs().max() > 1e-3


@pytest.mark.parametrize("name, kwargs", [("clip_score", {}), ("hpsv2", {}), ("aesthetic", {"clip_pretrained": "x.pt"}),
                                          ("temporal_consistency", {"embed": "clip"})])
def test_reward_models_refuse_random_weights(name, kwargs, tiny_clip):
    with pytest.raises(ValueError, match="random_weights: true"):
        REWARDS[name](**kwargs)
    arch, _, _ = tiny_clip
    if name != "aesthetic":  # an explicit request runs on random weights
        r = REWARDS[name](arch=arch, random_weights=True, **kwargs)
        x = images(2, 32)[:, :, None].repeat(1, 1, 2, 1, 1) if name == "temporal_consistency" else images(2)
        assert torch.isfinite(r(x, PROMPTS[:2])["overall"]).all()


def test_hpsv2_loads_wrapped_state_dict(tiny_clip):
    arch, d, model = tiny_clip
    imgs = images(seed=1)
    r = REWARDS["hpsv2"](checkpoint=f"{d}/hps.pt", arch=arch)(imgs, PROMPTS)
    torch.testing.assert_close(r["overall"], manual_cosine(model, imgs, PROMPTS), atol=2e-3, rtol=0)


def test_aesthetic_head_by_hand(tiny_clip, tmp_path):
    from rewards.clip_models import AestheticMLP

    arch, d, model = tiny_clip
    head = AestheticMLP(32)
    with torch.no_grad():
        for layer in head.layers:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.zero_()
                layer.bias.zero_()
        head.layers[7].bias.fill_(5.0)  # every image scores exactly 5
    torch.save(head.state_dict(), tmp_path / "mlp.pth")
    assert sorted(head.state_dict()) == sorted(f"layers.{i}.{k}" for i in (0, 2, 4, 6, 7) for k in ("weight", "bias"))
    r = REWARDS["aesthetic"](mlp=str(tmp_path / "mlp.pth"), clip_pretrained=f"{d}/tiny.pt", arch=arch)(images(), PROMPTS)
    assert torch.equal(r["overall"], torch.full((4,), 5.0))
    # a random head: the reward is the head applied to the normalized image embedding
    torch.manual_seed(0)
    head2 = AestheticMLP(32).eval()
    torch.save(head2.state_dict(), tmp_path / "mlp2.pth")
    rew = REWARDS["aesthetic"](mlp=str(tmp_path / "mlp2.pth"), clip_pretrained=f"{d}/tiny.pt", arch=arch)
    imgs = images(seed=3)
    with torch.no_grad():
        want = head2(rew.image_features(imgs))
    torch.testing.assert_close(rew(imgs, PROMPTS)["overall"], want)


@pytest.fixture(scope="module")
def tiny_pickscore(tmp_path_factory):
    """(folder, model, tokenizer, image processor) of a tiny transformers CLIPModel saved as a PickScore folder."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    from mmrl.models.qwen_vl import build_tokenizer

    d = tmp_path_factory.mktemp("pickscore")
    tok = build_tokenizer(PROMPTS * 4, vocab_size=300)
    torch.manual_seed(0)
    cfg = CLIPConfig(text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=77, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, bos_token_id=tok.pad_token_id),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        image_size=32, patch_size=16), projection_dim=16)
    model = CLIPModel(cfg).eval()
    model.save_pretrained(d)
    tok.save_pretrained(d)
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    ip.save_pretrained(d)
    return str(d), model, tok, ip


def test_pickscore_hf_clip(tiny_pickscore):
    from rewards.clip_models import clip_preprocess

    path, model, tok, ip = tiny_pickscore
    imgs = images(seed=2)
    r = REWARDS["pickscore"](path=path)(imgs, PROMPTS)
    with torch.no_grad():
        px = clip_preprocess(imgs, 32, ip.image_mean, ip.image_std)
        out = model(pixel_values=px, **tok(PROMPTS, padding=True, return_tensors="pt"))
    torch.testing.assert_close(r["overall"], out.logits_per_image.diagonal(), atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------------- OCR
def render_text(text: str, w=160, h=48) -> torch.Tensor:
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(img).text((8, 8), text, fill="black", font=ImageFont.load_default(size=28))
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 127.5 - 1


def test_ocr_formula_by_hand():
    from rewards.ocr import levenshtein, ocr_score, target_text

    assert levenshtein("kitten", "sitting") == 3
    assert ocr_score("mmr1", "mmrl") == pytest.approx(0.75)
    assert ocr_score("Hello World", "hello world") == 1.0  # case and spaces ignored
    assert ocr_score("something else entirely", "ab") == 0.0  # clamped at 0
    assert target_text('a sign that says "OPEN NOW"') == "OPEN NOW"
    with pytest.raises(ValueError, match="quoted"):
        target_text("a sign")


def test_ocr_reads_rendered_text():
    pytest.importorskip("rapidocr_onnxruntime")
    imgs = torch.stack([render_text("mmrl 42"), render_text("GRPO")])
    r = REWARDS["ocr"]()(imgs, ['a poster with the text "mmrl 42"', 'a sign that says "DPO"'])
    assert r["overall"][0] == 1.0
    assert r["overall"][1] == pytest.approx(1 - 2 / 3)  # reads GRPO: "grpo" -> "dpo" is 2 edits
    blank = REWARDS["ocr"]()(torch.ones(1, 3, 48, 160), ['"A"'])
    assert blank["found"][0] == 0 and blank["overall"][0] == 0


# ------------------------------------------------------------------------------------------------- video
def test_frame_reward_aggregates_an_image_reward():
    from tasks import shapes

    p = shapes.prompts("train")[0]
    frame = shapes.to_tensor(shapes.render(p.spec, 24, random.Random(0)))
    video = frame[:, None].repeat(1, 4, 1, 1).unsqueeze(0)  # [1, 3, 4, H, W]: the right image in every frame
    ex = [{"prompt": p.text}]
    mean = build_reward("video_frames", {"reward": "shapes"})(video, ex)
    assert mean["strict"][0] == 1.0
    video[0, :, 2] = 0.0  # one gray frame: nothing detected there
    assert build_reward("video_frames", {"reward": "shapes"})(video, ex)["strict"][0] == 0.75
    assert build_reward("video_frames", {"reward": "shapes", "agg": "min"})(video, ex)["strict"][0] == 0.0


def test_temporal_consistency(tiny_clip):
    x = images(2, 16)
    static = x[:, :, None].repeat(1, 1, 3, 1, 1)  # [2, 3, 3, 16, 16]
    flip = torch.stack([x, -x, x], 2)
    tc = REWARDS["temporal_consistency"]()
    torch.testing.assert_close(tc(static, PROMPTS[:2])["overall"], torch.ones(2))
    torch.testing.assert_close(tc(flip, PROMPTS[:2])["overall"], -torch.ones(2))  # centered pixels: cos(x, -x) = -1
    arch, d, _ = tiny_clip
    clip_tc = REWARDS["temporal_consistency"](embed="clip", arch=arch, pretrained=f"{d}/tiny.pt")
    torch.testing.assert_close(clip_tc(static, PROMPTS[:2])["overall"], torch.ones(2), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="N, 3, F, H, W"):
        tc(x, PROMPTS[:2])


# ------------------------------------------------------------------------------------------- ImageReward
IR_CONFIG = {"vision": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                            image_size=32, patch_size=16, layer_norm_eps=1e-6),
             "text": dict(vocab_size=5 + len({w for p in PROMPTS for w in p.split()}), hidden_size=16,
                          intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, encoder_hidden_size=32,
                          max_position_embeddings=64)}


@pytest.fixture(scope="module")
def tiny_image_reward(tmp_path_factory):
    """(folder, model, original-layout state dict) of a tiny ImageReward: ImageReward.pt and its tokenizer tok/."""
    from transformers import BertTokenizer

    from rewards.image_reward import ImageRewardModel

    d = tmp_path_factory.mktemp("image_reward")
    words = sorted({w for p in PROMPTS for w in p.split()})
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizer(str(d / "vocab.txt")).save_pretrained(d / "tok")
    torch.manual_seed(0)
    model = ImageRewardModel(IR_CONFIG["vision"], IR_CONFIG["text"]).eval()
    # the released layout: BLIP's timm-style ViT names, BERT names under blip.text_encoder, unused BLIP heads
    inverse = [("vision.embeddings.class_embedding", "blip.visual_encoder.cls_token"),
               ("vision.embeddings.position_embedding", "blip.visual_encoder.pos_embed"),
               ("vision.embeddings.patch_embedding.", "blip.visual_encoder.patch_embed.proj."),
               ("vision.post_layernorm.", "blip.visual_encoder.norm."), ("vision.encoder.layers.", "blip.visual_encoder.blocks."),
               (".layer_norm1.", ".norm1."), (".layer_norm2.", ".norm2."), (".self_attn.projection.", ".attn.proj."),
               (".self_attn.qkv.", ".attn.qkv."), ("text.", "blip.text_encoder.")]
    original = {}
    for k, v in model.state_dict().items():
        for a, b in inverse:
            k = k.replace(a, b)
        original[k] = v.clone()
    original["blip.text_proj.weight"] = torch.zeros(4, 16)  # BLIP heads ImageReward does not use
    torch.save(original, d / "ImageReward.pt")
    return str(d), model, original


def test_image_reward_loads_the_original_checkpoint_layout(tiny_image_reward, tmp_path):
    from transformers import BertTokenizer

    from rewards.image_reward import MEAN, STD

    d, model, original = tiny_image_reward
    cfg = IR_CONFIG
    rew = REWARDS["image_reward"](checkpoint=f"{d}/ImageReward.pt", tokenizer=f"{d}/tok", config=cfg)
    imgs = images(seed=4)
    got = rew(imgs, PROMPTS)["overall"]
    from rewards.clip_models import clip_preprocess
    from rewards.image_reward import CLIP_MEAN, CLIP_STD

    tok = BertTokenizer.from_pretrained(f"{d}/tok")(PROMPTS, padding="max_length", max_length=35, return_tensors="pt")
    assert (tok.input_ids[:, 0] == 2).all()  # [CLS] leads, as in ImageReward's scoring
    with torch.no_grad():
        img = model.vision(pixel_values=clip_preprocess(imgs, 32, CLIP_MEAN, CLIP_STD)).last_hidden_state
        cls = model.text(input_ids=tok.input_ids, attention_mask=tok.attention_mask, encoder_hidden_states=img).last_hidden_state[:, 0]
        want = (model.mlp(cls) - MEAN) / STD
    torch.testing.assert_close(got, want)
    broken = {k: v for k, v in original.items() if k != "blip.visual_encoder.norm.weight"}
    torch.save(broken, tmp_path / "broken.pt")
    with pytest.raises(ValueError, match="not an ImageReward checkpoint"):
        REWARDS["image_reward"](checkpoint=str(tmp_path / "broken.pt"), tokenizer=f"{d}/tok", config=cfg)(imgs, PROMPTS)


# ------------------------------------------------------------------------------------------ on an accelerator
ZOO = ["shapes", "clip_score", "hpsv2", "aesthetic", "pickscore", "image_reward", "ocr", "video_frames",
       "temporal_consistency", "temporal_consistency_clip", "motion", "pairwise", "multi"]


def zoo_reward(name, device, tiny_clip, tiny_pickscore, tiny_image_reward, tmp_path):
    """(reward, inputs, examples): every reward of the zoo with its model (if any) on `device`."""
    arch, d, _ = tiny_clip
    clip = dict(arch=arch, device=device)
    if name == "aesthetic":
        torch.manual_seed(0)
        from rewards.clip_models import AestheticMLP

        torch.save(AestheticMLP(32).state_dict(), tmp_path / "mlp.pth")
    made = {
        "shapes": lambda: REWARDS["shapes"](),
        "clip_score": lambda: REWARDS["clip_score"](pretrained=f"{d}/tiny.pt", **clip),
        "hpsv2": lambda: REWARDS["hpsv2"](checkpoint=f"{d}/hps.pt", **clip),
        "aesthetic": lambda: REWARDS["aesthetic"](mlp=str(tmp_path / "mlp.pth"), clip_pretrained=f"{d}/tiny.pt", **clip),
        "pickscore": lambda: REWARDS["pickscore"](path=tiny_pickscore[0], device=device),
        "image_reward": lambda: REWARDS["image_reward"](checkpoint=f"{tiny_image_reward[0]}/ImageReward.pt",
                                                        tokenizer=f"{tiny_image_reward[0]}/tok", config=IR_CONFIG,
                                                        device=device),
        "ocr": lambda: REWARDS["ocr"](),
        "video_frames": lambda: build_reward("video_frames", {"reward": "clip_score",
                                                              "reward_kwargs": dict(pretrained=f"{d}/tiny.pt", **clip)}),
        "temporal_consistency": lambda: REWARDS["temporal_consistency"](),
        "temporal_consistency_clip": lambda: REWARDS["temporal_consistency"](embed="clip", pretrained=f"{d}/tiny.pt",
                                                                             **clip),
        "motion": lambda: REWARDS["motion"](),
        "pairwise": lambda: build_reward("pairwise", {"judge": "score", "judge_kwargs": {"reward": "shapes"}}),
        "multi": lambda: build_reward("multi", {"components": {"shapes": {"weight": 1.0}, "clip_score": {
            "weight": 0.5, "kwargs": dict(pretrained=f"{d}/tiny.pt", **clip)}}}),
    }
    video = name in ("video_frames", "temporal_consistency", "temporal_consistency_clip", "motion")
    x = torch.rand(4, 3, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1 if video else images(seed=5)
    examples = [{"prompt": p} for p in PROMPTS]
    if name == "ocr":
        examples = [{"prompt": f'{p} with the text "ab"'} for p in PROMPTS]
    if name in ("shapes", "pairwise", "multi"):
        from tasks import shapes

        examples = [{"prompt": p.text} for p in shapes.prompts("train")[:4]]
    if name == "motion":
        from tasks import motion

        examples = [{"prompt": p.text} for p in motion.prompts("train")[:4]]
    return made[name](), x, examples


@pytest.mark.parametrize("name", ZOO)
def test_every_reward_runs_on_an_accelerator(name, tiny_clip, tiny_pickscore, tiny_image_reward, tmp_path):
    """Images on the (fake) accelerator and the reward model there too: no op mixes devices (the check a GPU
    would make), and the scores equal the CPU ones."""
    from mmrl.reward import RewardRunner
    from mmrl.testing.fake_device import fake_accelerator

    reward, x, examples = zoo_reward(name, "cpu", tiny_clip, tiny_pickscore, tiny_image_reward, tmp_path)
    gid = torch.tensor([0, 0, 1, 1])
    want, ok, _ = RewardRunner(reward, "raise")(x, examples, gid)
    with fake_accelerator() as dev:
        reward, x, examples = zoo_reward(name, dev, tiny_clip, tiny_pickscore, tiny_image_reward, tmp_path)
        got, ok_dev, _ = RewardRunner(reward, "raise")(x.to(dev), examples, gid)
    assert ok.all() and ok_dev.all()
    assert set(got) == set(want)
    for k in want:
        assert got[k].device.type == "cpu"
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)
