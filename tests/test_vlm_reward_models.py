"""HPSv3 and VideoAlign (rewards/vlm_reward_models.py) on tiny random-init Qwen2-VL models saved in the public
checkpoint layouts, checked against a forward written here through the model's parts (embeddings, vision tower,
text model with sequential positions) and the head at the reward tokens."""

import hashlib
import json
import os

import pytest
import torch
import torch.nn.functional as F

from mmrl.reward import REWARDS
from rewards import vlm_reward_models as vrm

PROMPTS = ["a red circle", "two blue squares on a table", "a green triangle"]
HPS_TOKEN, VA_TOKENS = "<|Reward|>", ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")


def tiny_parts(seed=0):
    from mmrl.models.qwen_vl import build_model, build_processor, build_tokenizer

    torch.manual_seed(seed)
    tok = build_tokenizer(PROMPTS + [vrm.HPSV3_INSTRUCTION, vrm.VIDEOALIGN_PROMPT])
    return tok, build_model("qwen2_vl", tok, "tiny"), build_processor


def legacy(key: str) -> str:
    """Today's Qwen2-VL keys -> transformers 4.45's, the layout of the released checkpoints."""
    return key.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Folders and checkpoints of both rewards, and the torch modules they hold (for the hand-written forward)."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("vlm_rewards")
    tok, model, build_processor = tiny_parts()
    base = str(root / "base")  # stands in for Qwen2-VL-7B / 2B-Instruct: no reward tokens, no head
    model.save_pretrained(base)
    build_processor("qwen2_vl", tok).save_pretrained(base)

    # HPSv3: the public code adds <|Reward|>, resizes the embedding, trains everything, saves one state dict
    tok.add_special_tokens({"additional_special_tokens": [HPS_TOKEN]})
    model.resize_token_embeddings(len(tok))
    with torch.no_grad():
        model.get_input_embeddings().weight[-1].normal_()  # the trained token row
    # hpsv3/model/qwen2vl_trainer.py, rm_head_type "ranknet" without kwargs
    model.rm_head = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                                        torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    for p in model.rm_head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    hps_head = {k: v.clone() for k, v in model.rm_head.state_dict().items()}
    hps_file = str(root / "HPSv3.safetensors")
    save_file({legacy(k): v.clone().contiguous() for k, v in model.state_dict().items()}, hps_file)
    hps_folder = str(root / "hps_folder")  # the same reward model as one folder: tokenizer + rm_head.* inside
    model.save_pretrained(hps_folder)
    build_processor("qwen2_vl", tok).save_pretrained(hps_folder)
    headless = str(root / "headless")  # reward tokens in the tokenizer, no rm_head
    del model.rm_head
    model.save_pretrained(headless)
    build_processor("qwen2_vl", tok).save_pretrained(headless)
    hps_model = model

    # VideoAlign: three tokens, Linear(D, 1) head, LoRA (r 4, alpha 8) on the text model, saved as model.pth
    tok, model, _ = tiny_parts(seed=1)
    tok.add_special_tokens({"additional_special_tokens": list(VA_TOKENS)})
    model.resize_token_embeddings(len(tok))
    with torch.no_grad():
        model.get_input_embeddings().weight[-3:].normal_()
    model.rm_head = torch.nn.Linear(32, 1, bias=False)
    torch.nn.init.normal_(model.rm_head.weight, std=0.5)
    excluded = ("lm_head", "rm_head", "embed_tokens", "visual")  # VideoReward's lora_namespan_exclude
    targets = [n for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and not any(e in n for e in excluded)]
    peft_model = get_peft_model(model, LoraConfig(target_modules=targets, r=4, lora_alpha=8, init_lora_weights=False))
    va_dir = root / "VideoReward"
    os.makedirs(va_dir / "checkpoint-5")
    os.makedirs(va_dir / "checkpoint-12")  # the latest step is loaded
    state = {k.replace("base_model.model.model.visual.", "base_model.model.visual.")
              .replace("base_model.model.model.language_model.", "base_model.model.model."): v
             for k, v in peft_model.state_dict().items()}
    torch.save(state, va_dir / "checkpoint-12" / "model.pth")
    torch.save({}, va_dir / "checkpoint-5" / "model.pth")
    config = {"data_config": {"fps": 2.0, "num_frames": None, "max_frame_pixels": 56 * 56,
                              "eval_dim": list(vrm.DIMENSIONS), "prompt_template_type": "detailed_special",
                              "sample_type": "uniform"},
              "model_config": {"output_dim": 1, "use_special_tokens": True, "reward_token": "special"},
              "peft_lora_config": {"lora_enable": True, "lora_r": 4, "lora_alpha": 8, "use_rslora": False},
              "inference_config": {"VQ_mean": 0.5, "VQ_std": 2.0, "MQ_mean": -1.0, "MQ_std": 0.5,
                                   "TA_mean": 0.0, "TA_std": 4.0}}
    (va_dir / "model_config.json").write_text(json.dumps(config))
    return dict(base=base, hps_file=hps_file, hps_folder=hps_folder, headless=headless,
                hps_model=hps_model.eval(), hps_head=hps_head, va_dir=str(va_dir),
                va_model=peft_model.eval(), va_config=config)


def hand_scores(qwen, proc, head, text: str, token_ids, image=None, video=None) -> torch.Tensor:
    """One sample, no padding: embed, scatter the vision tower's features into the pad tokens, run the text model
    with positions 0..L-1 on all three rotary sections (the public forward), head at each reward token."""
    kind = "image" if image is not None else "video"
    chat = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": text}]}]
    text = proc.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    if image is not None:
        b = proc(text=[text], images=[image], return_tensors="pt",
                 images_kwargs={"do_rescale": False, "do_resize": False})
        feats = qwen.model.visual(b["pixel_values"], grid_thw=b["image_grid_thw"]).pooler_output
        pad = qwen.config.image_token_id
    else:
        b = proc(text=[text], videos=[video], return_tensors="pt",
                 videos_kwargs={"do_rescale": False, "do_resize": False, "do_sample_frames": False})
        feats = qwen.model.visual(b["pixel_values_videos"], grid_thw=b["video_grid_thw"]).pooler_output
        pad = qwen.config.video_token_id
    ids = b["input_ids"][0]
    emb = qwen.get_input_embeddings()(ids)
    emb[ids == pad] = feats
    pos = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
    h = qwen.model.language_model(inputs_embeds=emb[None], position_ids=pos).last_hidden_state[0]
    return torch.cat([head(h[(ids == t).nonzero()[0, 0]]) for t in token_ids])


def ranknet(sd: dict):
    """HPSv3's head from its state dict: Linear 0, ReLU, (Dropout), Linear 3, ReLU, Linear 5."""
    return lambda h: F.linear(F.relu(F.linear(F.relu(F.linear(h, sd["0.weight"], sd["0.bias"])), sd["3.weight"],
                                              sd["3.bias"])), sd["5.weight"], sd["5.bias"])


def images(n=3, seed=0):
    return torch.rand(n, 3, 40, 48, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def videos(n=3, f=9, seed=0):
    return torch.rand(n, 3, f, 30, 30, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_prompts_are_the_public_bytes():
    """sha256 of the public builders' output for "a red circle" (MizzenAI/HPSv3 hpsv3/dataset/data_collator_qwen.py:
    INSTRUCTION.format(...) + prompt_with_special_token; KwaiVGI/VideoAlign prompt_template.py: build_prompt(...,
    "detailed_special")), computed from those files."""
    sha = lambda s: hashlib.sha256(s.encode()).hexdigest()  # noqa: E731
    hps = vrm.HPSv3.texts(["a red circle"])[0]
    va = vrm.VideoAlign.texts([{"prompt": "a red circle"}])[0]
    assert sha(hps) == "ead7a62983e0ca9dc3c0f3634dac834c589c4f6434d497ab436c668f3746e78c"
    assert sha(va) == "e168dabc1c039a1e0e41739ae2f88726c7773f6b10d1b564ec304cc127d4a349"
    assert REWARDS["hpsv3"] is vrm.HPSv3 and REWARDS["video_align"] is vrm.VideoAlign


def test_preprocessing_numbers_by_hand():
    # 480 x 832 to at most 448^2 px: rounded to 476 x 840 = 399,840 px > 200,704, beta = sqrt(480*832 / 200704)
    # = 1.4106 -> floor(12.15) * 28 = 336, floor(21.06) * 28 = 588
    assert vrm.smart_resize(480, 832, 28, 128 * 28 * 28, 448 * 448) == (336, 588)
    # 40 x 48 to exactly 56^2 px: 28 x 56 is too small, beta = sqrt(3136 / 1920) -> ceil(1.83), ceil(2.19) grids
    assert vrm.smart_resize(40, 48, 28, 56 * 56, 56 * 56) == (56, 84)
    # 33 frames at 16 fps sampled at 2 fps: 4.125 -> 4 frames at linspace(0, 32, 4) = 0, 10.67, 21.33, 32
    assert vrm.frame_indices(33, None, 2.0, 16.0) == [0, 11, 21, 32]
    # 81 frames at 16 fps: 10.125 -> 10 frames, 80/9 apart
    assert vrm.frame_indices(81, None, 2.0, 16.0) == [0, 9, 18, 27, 36, 44, 53, 62, 71, 80]
    assert vrm.frame_indices(9, 5, 2.0, None) == [0, 3, 5, 8]  # 5 -> round(2.5) * 2 = 4 (halves to even)
    assert vrm.frame_indices(3, None, 2.0, 1.0) == [0, 2]  # 6 wanted, capped at the even floor of the 3 frames
    with pytest.raises(ValueError, match="video_fps"):
        vrm.frame_indices(9, None, 2.0, None)


def test_checkpoint_keys_and_lora_merge_by_hand():
    assert vrm.current_qwen2vl_key("visual.blocks.0.attn.qkv.weight") == "model.visual.blocks.0.attn.qkv.weight"
    text_key = "model.layers.0.mlp.up_proj.weight"  # transformers 4.45's text model
    assert vrm.current_qwen2vl_key(text_key) == "model.language_model.layers.0.mlp.up_proj.weight"
    for k in ("model.language_model.norm.weight", "model.visual.merger.ln_q.weight", "lm_head.weight",
              "rm_head.weight"):
        assert vrm.current_qwen2vl_key(k) == k
    w, a, b = torch.eye(2), torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0], [4.0]])  # r = 1
    sd = {"base_model.model.q.base_layer.weight": w, "base_model.model.q.base_layer.bias": torch.ones(2),
          "base_model.model.q.lora_A.default.weight": a, "base_model.model.q.lora_B.default.weight": b,
          "base_model.model.rm_head.weight": torch.ones(1, 2)}
    out = vrm.merge_lora(sd, scale=2.0)
    # W + 2 * B @ A = [[1, 0], [0, 1]] + 2 * [[3, 6], [4, 8]]
    torch.testing.assert_close(out["q.weight"], torch.tensor([[7.0, 12.0], [8.0, 17.0]]))
    assert set(out) == {"q.weight", "q.bias", "rm_head.weight"}


def test_hpsv3_equals_the_hand_forward_from_checkpoint_and_folder(models):
    m, x = models, images()
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(m["hps_folder"])
    tid = [proc.tokenizer.convert_tokens_to_ids(HPS_TOKEN)]
    px = (F.interpolate((x + 1) / 2, size=(56, 84), mode="bicubic", antialias=True).clamp(0, 1))  # hand-derived size
    with torch.no_grad():
        want = torch.stack([hand_scores(m["hps_model"], proc, ranknet(m["hps_head"]),
                                        vrm.HPSV3_INSTRUCTION.format(text_prompt=p) + vrm.HPSV3_SUFFIX, tid, image=im)
                            for p, im in zip(PROMPTS, px)])  # [N, 2]: mu, log sigma
    for kw in (dict(path=m["base"], checkpoint=m["hps_file"]), dict(path=m["hps_folder"])):
        r = REWARDS["hpsv3"](pixels=56 * 56, **kw)
        got = r(x, [{"prompt": p} for p in PROMPTS])
        assert set(got) == {"overall", "sigma"}
        torch.testing.assert_close(got["overall"], want[:, 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(got["sigma"], want[:, 1].exp(), atol=1e-5, rtol=0)
        assert got["overall"].std() > 1e-4  # the images and prompts reach the score
    # batch_size splits into micro-batches (padded differently): the same scores
    split = vrm.HPSv3(m["hps_folder"], pixels=56 * 56, batch_size=1)(x, PROMPTS)
    torch.testing.assert_close(split["overall"], want[:, 0], atol=1e-5, rtol=0)
    again = r(x, PROMPTS)
    assert torch.equal(again["overall"], got["overall"]) and torch.equal(again["sigma"], got["sigma"])


def test_video_align_equals_the_lora_model_forward(models):
    m, v = models, videos()
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(m["base"])
    proc.tokenizer.add_special_tokens({"additional_special_tokens": list(VA_TOKENS)})
    tids = proc.tokenizer.convert_tokens_to_ids(list(VA_TOKENS))
    qwen = m["va_model"].base_model.model  # the unmerged LoRA model, as the public code runs it
    # 9 frames, num_frames 4: linspace(0, 8, 4) = 0, 2.67, 5.33, 8 -> 0, 3, 5, 8;
    # 30 x 30 -> 28 x 28 (at most 56^2 px from model_config.json, at least 28^2)
    fr = ((v[:, :, [0, 3, 5, 8]].transpose(1, 2) + 1) / 2).reshape(-1, 3, 30, 30)
    fr = F.interpolate(fr, size=(28, 28), mode="bicubic", antialias=True).clamp(0, 1).reshape(3, 4, 3, 28, 28)
    with torch.no_grad():
        raw = torch.stack([hand_scores(qwen, proc, qwen.rm_head, vrm.VIDEOALIGN_PROMPT.format(text_prompt=p), tids,
                                       video=f) for p, f in zip(PROMPTS, fr)])  # [N, 3]
    inf = m["va_config"]["inference_config"]
    want = {d: (raw[:, i] - inf[f"{d}_mean"]) / inf[f"{d}_std"] for i, d in enumerate(vrm.DIMENSIONS)}
    r = REWARDS["video_align"](path=m["base"], checkpoint=m["va_dir"], num_frames=4, min_frame_pixels=28 * 28,
                               weights={"VQ": 1.0, "MQ": 0.5, "TA": 2.0})
    got = r(v, PROMPTS)
    assert r.weights == {"VQ": 1.0, "MQ": 0.5, "TA": 2.0} and r.max_pixels == 56 * 56  # from model_config.json
    for d in vrm.DIMENSIONS:
        torch.testing.assert_close(got[d], want[d], atol=1e-5, rtol=0)
    torch.testing.assert_close(got["overall"], want["VQ"] + 0.5 * want["MQ"] + 2 * want["TA"], atol=1e-5, rtol=0)
    assert (raw.std(0) > 1e-4).all()
    # the model.pth file alone (its folder's model_config.json is found), micro-batches of 1, raw scores
    one = vrm.VideoAlign(m["base"], os.path.join(m["va_dir"], "checkpoint-12", "model.pth"), num_frames=4,
                         min_frame_pixels=28 * 28, batch_size=1, normalize=False)(v, PROMPTS)
    for i, d in enumerate(vrm.DIMENSIONS):
        torch.testing.assert_close(one[d], raw[:, i], atol=1e-5, rtol=0)


def test_missing_head_or_tokens_refuse_with_the_names(models, tmp_path):
    m = models
    with pytest.raises(ValueError, match=r"missing rm_head\.0\.weight, rm_head\.0\.bias, rm_head\.3\.weight"):
        vrm.HPSv3(m["headless"], pixels=56 * 56)(images(1), PROMPTS[:1])
    with pytest.raises(ValueError, match=r"has no <\|Reward\|>.*checkpoint"):
        vrm.HPSv3(m["base"], pixels=56 * 56)(images(1), PROMPTS[:1])
    torch.save({"base_model.model.rm_head.weight": torch.zeros(1, 32)}, tmp_path / "model.pth")
    with pytest.raises(ValueError, match="does not fit"):  # a head without the backbone
        vrm.VideoAlign(m["base"], str(tmp_path / "model.pth"), num_frames=4)(videos(1), PROMPTS[:1])
    with pytest.raises(ValueError, match="video_fps"):
        vrm.VideoAlign(m["base"], fps=2.0)
    r = vrm.HPSv3(m["base"], pixels=56 * 56, random_head=True)  # the explicit escape: runs, on a random head
    a, b = r(images(2), PROMPTS[:2]), vrm.HPSv3(m["base"], pixels=56 * 56, random_head=True)(images(2), PROMPTS[:2])
    assert torch.isfinite(a["overall"]).all() and torch.equal(a["overall"], b["overall"])


def test_on_a_fake_accelerator_and_served(models):
    from mmrl.reward import RewardRunner
    from mmrl.reward_server import RemoteReward, RewardServer
    from mmrl.testing.fake_device import fake_accelerator

    m, v = models, videos(2)
    kw = dict(path=m["base"], checkpoint=m["va_dir"], num_frames=4, min_frame_pixels=28 * 28)
    reward = vrm.VideoAlign(**kw)
    want, ok, _ = RewardRunner(reward, "raise")(v, PROMPTS[:2])
    with fake_accelerator() as dev:
        got, ok_dev, _ = RewardRunner(vrm.VideoAlign(device=dev, **kw), "raise")(v.to(dev), PROMPTS[:2])
    assert ok.all() and ok_dev.all() and set(got) == set(want) == {"overall", *vrm.DIMENSIONS}
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=0)
    srv = RewardServer(reward, "video_align").start()
    try:
        served = RemoteReward(srv.url, timeout_s=30, retries=0)(v, [{"prompt": p} for p in PROMPTS[:2]])
    finally:
        srv.close()
    assert set(served) == set(want) and all(torch.equal(served[k], want[k]) for k in want)
