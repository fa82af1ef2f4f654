"""Token-policy contract (shapes, determinism under a seed, on-policy ratio = 1) for Qwen2-VL, Qwen2.5-VL,
Qwen3-VL and a causal LM; video input; TempSamp-R1 injection; LoRA on the language model only."""

import dataclasses
import json
import random

import pytest
import torch

from conftest import build_tiny_vl
from mmrl.config import LoraConfig, SamplerConfig
from mmrl.policy.token import TokenPolicy, load_token_model
from mmrl.video import VideoError, VideoOptions
from mmrl.testing.contract import check_policy

VIDEO = VideoOptions(min_pixels=56 * 56, max_pixels=56 * 56)


def examples(world, n=2, split="train"):
    from mmrl.config import TaskConfig
    from tasks.grounding import GroundingWorldTask

    task = GroundingWorldTask(TaskConfig(eval_prompts=4), root=world, train_videos=6, test_videos=3)
    return task, task.sample(n, random.Random(0))


def policy_for(path, lora=False, temperature=1.0, **kw):
    model, proc = load_token_model(path)
    return TokenPolicy(model=model, processor=proc, sampler_cfg=SamplerConfig(temperature=temperature, max_new_tokens=10),
                       lora_cfg=LoraConfig(enabled=lora, rank=4, alpha=8), video=VIDEO, **kw)


def tiny_lm(path) -> str:
    """Save a tiny random-init causal LM (Qwen2ForCausalLM) with its tokenizer at path."""
    from mmrl.models.qwen_vl import build_causal_lm, build_tokenizer

    tok = build_tokenizer(["what is two plus two? four"])
    build_causal_lm(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


LM_PROMPTS = [{"prompt": "what is two plus two?"}, {"prompt": "a much longer prompt than the first one is"}]


def policy_and_examples(kind, media, tmp_path, world, **kw):
    """A tiny policy of `kind` (a Qwen-VL version or "causal_lm") and prompts of different lengths with `media`
    (video, image or text)."""
    import numpy as np
    from PIL import Image

    if kind == "causal_lm":
        return policy_for(tiny_lm(tmp_path / "lm"), **kw), LM_PROMPTS
    pol = policy_for(build_tiny_vl(str(tmp_path / kind), kind), **kw)
    _, exs = examples(world, n=3)
    if media == "image":
        rng = np.random.default_rng(0)
        exs = [{"prompt": ex["prompt"], "image": Image.fromarray(rng.integers(0, 255, (56, 56, 3), dtype=np.uint8))}
               for ex in exs]
    return pol, exs


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_contract_vlm(kind, tmp_path, tiny_world):
    pol = policy_for(build_tiny_vl(str(tmp_path / kind), kind))
    _, exs = examples(tiny_world)
    assert check_policy(pol, exs, 3)["max_ratio_error"] < 1e-5  # the shared contract
    ro = pol.sample(exs, 3, torch.Generator().manual_seed(0))
    n, c = ro.extras["completion_ids"].shape
    assert n == 6 and ro.old_log_prob.shape == (n, c) == ro.action_mask.shape
    assert ro.group_id.tolist() == [0, 0, 0, 1, 1, 1] and len(ro.outputs) == 6
    assert (ro.old_log_prob[~ro.action_mask] == 0).all() and (ro.old_log_prob[ro.action_mask] < 0).all()
    again = pol.sample(exs, 3, torch.Generator().manual_seed(0))
    assert torch.equal(again.extras["completion_ids"], ro.extras["completion_ids"])  # determinism under a seed
    # on-policy ratio = 1: recomputed log-probs equal the rollout's, in any minibatch composition
    for idx in (torch.arange(n), torch.tensor([4, 1]), torch.tensor([5])):
        with torch.no_grad():
            lp = pol.log_prob(ro, idx).log_prob
        ratio = torch.exp(lp - ro.old_log_prob[idx])[ro.action_mask[idx]]
        assert (ratio - 1).abs().max() < 1e-5


def test_contract_causal_lm(tmp_path):
    pol, exs = policy_for(tiny_lm(tmp_path / "lm")), LM_PROMPTS
    assert check_policy(pol, exs, 2)["max_ratio_error"] < 1e-5  # the shared contract
    assert not pol.is_vlm
    ro = pol.sample(exs, 2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        lp = pol.log_prob(ro, torch.tensor([3, 0])).log_prob
    assert (torch.exp(lp - ro.old_log_prob[[3, 0]])[ro.action_mask[[3, 0]]] - 1).abs().max() < 1e-5
    # left padding must not change a prompt's log-probs: position ids are counted over real tokens
    alone = pol.sample(exs[:1], 2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        solo = pol.log_prob(ro.select(torch.tensor([0])), torch.tensor([0])).log_prob
    assert torch.allclose(solo, ro.old_log_prob[:1], atol=1e-5) and len(alone) == 2


def test_video_reaches_the_model(tiny_vl, tiny_world):
    """Video embeddings vary across tokens, and shuffling the frames changes the logits."""
    pol = policy_for(tiny_vl)
    _, exs = examples(tiny_world, 1)
    enc = pol.encode_prompt(exs[0])
    assert tuple(enc["video_grid_thw"][0].tolist()) == (8, 4, 4)  # 16 frames at 2 fps, 56 px -> 8 x 2 x 2 tokens
    assert float(enc["second_per_grid_ts"][0]) == pytest.approx(1.0)  # temporal patch of 2 frames at 2 fps
    batch = pol._collate([enc])
    with torch.no_grad():
        base = pol.model(**batch).logits[0, -1]
        feats = pol.model.model.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"])
        feats = torch.cat(list(feats.pooler_output if hasattr(feats, "pooler_output") else feats))
        assert feats.std(0).mean() > 1e-3 * feats.abs().mean()
        pv = batch["pixel_values_videos"].view(8, -1, batch["pixel_values_videos"].shape[-1])
        shuffled = dict(batch, pixel_values_videos=pv.flip(0).reshape(batch["pixel_values_videos"].shape))
        assert not torch.allclose(pol.model(**shuffled).logits[0, -1], base, atol=1e-6)


def test_text_first_fixes_answer_to_video_distances(tiny_vl, tiny_world):
    """The world puts the query before the video: the M-RoPE distance from the first answer position to every
    video token is then the same for queries of different lengths (video first, it shifts with the length)."""
    pol = policy_for(tiny_vl)
    _, exs = examples(tiny_world, 1)
    assert exs[0]["text_first"]
    vid = pol.tokenizer.convert_tokens_to_ids("<|video_pad|>")

    def distances(text_first: bool, prompt: str) -> torch.Tensor:
        b = pol._collate([pol.encode_prompt(dict(exs[0], prompt=prompt, text_first=text_first))])
        pos, _ = pol.model.model.get_rope_index(b["input_ids"], b["mm_token_type_ids"],
                                                video_grid_thw=b["video_grid_thw"],
                                                second_per_grid_ts=b["second_per_grid_ts"],
                                                attention_mask=b["attention_mask"])
        ids = b["input_ids"][0]
        assert (ids == vid).nonzero()[0] > 5 if text_first else (ids == vid).nonzero()[0] < 5
        return pos[:, 0, -1:] - pos[:, 0, ids == vid]  # [3, video tokens]

    short, long = "the red circle appears.", "the red circle appears. Answer in seconds, please."
    assert torch.equal(distances(True, short), distances(True, long))
    assert not torch.equal(distances(False, short), distances(False, long))


def test_broken_videos_name_the_file_or_are_counted(tiny_vl, tiny_world, tmp_path):
    bad = tmp_path / "broken.mp4"
    bad.write_bytes(b"\x00not a video" * 50)
    _, exs = examples(tiny_world, 2)
    broken = [dict(exs[0], video=str(bad)), dict(exs[1], video=str(tmp_path / "missing.mp4"))]
    pol = policy_for(tiny_vl)
    with pytest.raises(VideoError, match="broken.mp4.*corrupt"):
        pol.sample(broken[:1] + exs[1:], 2, torch.Generator().manual_seed(0))
    with pytest.raises(VideoError, match="missing.mp4.*does not exist"):
        pol.encode_prompt(broken[1])
    pol = policy_for(tiny_vl, video_on_error="skip")
    ro = pol.sample(broken + exs[:1], 2, torch.Generator().manual_seed(0))
    assert len(ro) == 2 and pol.skipped_examples == 2


def test_ground_truth_injection(tiny_vl, tiny_world):
    from mmrl.algorithms.offpolicy import OFFPOLICY

    pol = policy_for(tiny_vl)
    task, exs = examples(tiny_world, 2)
    ro = pol.sample(exs, 3, torch.Generator().manual_seed(0))
    inj, stats = OFFPOLICY["ground_truth"](pol, ro, task)
    assert inj.is_offpolicy.tolist() == [False, False, True, False, False, True] and stats["offpolicy/injected"] == 2
    assert inj.outputs[2] == task.reference_output(exs[0]) and inj.outputs[0] == ro.outputs[0]
    with torch.no_grad():
        lp = pol.log_prob(inj, torch.arange(6)).log_prob
    assert torch.allclose(lp[inj.action_mask], inj.old_log_prob[inj.action_mask], atol=1e-5)


def test_lora_trains_the_language_model_only(tiny_vl, tiny_world):
    pol = policy_for(tiny_vl, lora=True)
    names = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n and "visual" not in n for n in names)
    _, exs = examples(tiny_world, 1)
    ro = pol.sample(exs, 2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.5 * torch.randn_like(p))
        live = pol.log_prob(ro, torch.arange(2)).log_prob
        with pol.reference():
            ref = pol.log_prob(ro, torch.arange(2)).log_prob
    m = ro.action_mask
    assert torch.allclose(ref[m], ro.old_log_prob[m], atol=1e-5) and not torch.allclose(live[m], ref[m], atol=1e-4)


def _logp_and_grads(pol, ro, idx, shared):
    pol.shared_prefix = shared
    pol.model.zero_grad()
    out = pol.log_prob(ro, idx).log_prob
    (out * ro.action_mask[idx]).sum().backward()
    grads = {n: p.grad.clone() for n, p in pol.model.named_parameters() if p.grad is not None}
    return out.detach(), grads


@pytest.mark.parametrize("kind,media", [("qwen2_vl", "video"), ("qwen2_5_vl", "video"), ("qwen2_5_vl", "image"),
                                        ("qwen3_vl", "video"), ("qwen3_vl", "image"), ("causal_lm", "text")])
def test_shared_prefix_forward_equals_naive(kind, media, tmp_path, tiny_world):
    """Each prompt runs once and its KV cache is indexed out to its rows: log-probs and gradients equal the
    naive [prompt | completion] forward, with left padding (prompts of different lengths), partial groups
    and any row order."""
    pol, exs = policy_and_examples(kind, media, tmp_path, tiny_world, freeze_vision=False)
    ro = pol.sample(exs, 3, torch.Generator().manual_seed(0))
    assert len({p["input_ids"].shape[1] for p in map(pol.encode_prompt, exs)}) > 1  # left padding is exercised
    for idx in (torch.arange(len(ro)), torch.tensor([5, 0, 4, 1])):
        naive, g_naive = _logp_and_grads(pol, ro, idx, shared=False)
        shared, g_shared = _logp_and_grads(pol, ro, idx, shared=True)
        assert torch.allclose(shared, naive, atol=1e-5), (shared - naive).abs().max()
        assert g_naive.keys() == g_shared.keys() and len(g_naive) > 0
        if kind != "causal_lm":
            assert any("visual" in n for n in g_shared)  # gradients reach the vision tower through the cache
        for n in g_naive:
            assert torch.allclose(g_shared[n], g_naive[n], atol=1e-5), (n, (g_shared[n] - g_naive[n]).abs().max())


@pytest.mark.parametrize("kind,media", [("qwen2_5_vl", "video"), ("causal_lm", "text")])
def test_shared_prefix_under_checkpointing_and_lockstep_equals_naive(kind, media, tmp_path, tiny_world):
    """Gradient checkpointing keeps the shared-prefix KV cache: log-probs and gradients equal the naive forward
    without checkpointing, and in backward each prompt is recomputed once (U x P tokens through a decoder layer),
    not once per row. Lockstep (several processes under FSDP2: every scoring call makes the prompt and completion
    forwards) equals it too, for rows whose prompts all differ and for one-token completions."""
    pol, exs = policy_and_examples(kind, media, tmp_path, tiny_world, freeze_vision=False)
    ro = pol.sample(exs, 3, torch.Generator().manual_seed(0))
    idx = torch.tensor([5, 0, 4, 1, 2])
    naive, g_naive = _logp_and_grads(pol, ro, idx, shared=False)
    pol.enable_gradient_checkpointing()
    assert pol._checkpointed
    layer0 = next(m for n, m in pol.model.named_modules() if n.endswith("layers.0.self_attn") and "visual" not in n)
    tokens = []
    layer0.register_forward_hook(lambda m, a, kw, out: tokens.append(kw["hidden_states"].shape[:2].numel()),
                                 with_kwargs=True)
    checkpointed, g_ckpt = _logp_and_grads(pol, ro, idx, shared=True)
    assert torch.allclose(checkpointed, naive, atol=1e-5), (checkpointed - naive).abs().max()
    assert g_ckpt.keys() == g_naive.keys()
    for n in g_naive:
        assert torch.allclose(g_ckpt[n], g_naive[n], atol=1e-5), (n, (g_ckpt[n] - g_naive[n]).abs().max())
    distinct = list({id(p): p for p in (pol.encode_prompt(ro.examples[i]) for i in idx.tolist())}.values())
    prompt, rows = pol._collate(distinct)["input_ids"].numel(), idx.numel() * ro.extras["completion_ids"].shape[1]
    assert len(distinct) < len(idx) and tokens == [prompt, rows, rows, prompt]  # U P, n C; backward: n C, U P
    pol.lockstep = True
    for rows, width in ((torch.tensor([0, 3]), None), (idx, 1)):  # distinct prompts; one-token completions
        one = ro if width is None else dataclasses.replace(
            ro, extras={"completion_ids": ro.extras["completion_ids"][:, :width]}, action_mask=ro.action_mask[:, :width],
            old_log_prob=ro.old_log_prob[:, :width])
        a, ga = _logp_and_grads(pol, one, rows, shared=False)
        b, gb = _logp_and_grads(pol, one, rows, shared=True)
        assert torch.allclose(a, b, atol=1e-5) and ga.keys() == gb.keys()
        assert all(torch.allclose(ga[n], gb[n], atol=1e-5) for n in ga)


@pytest.mark.parametrize("kind,media", [("qwen2_vl", "video"), ("qwen2_5_vl", "video"), ("qwen3_vl", "image"),
                                        ("causal_lm", "text")])
def test_prefix_cache_engine_matches_hf_generate(kind, media, tmp_path, tiny_world):
    """The prefix-cache engine decodes what HF generate decodes (greedy: token for token, with left padding),
    and its samples are deterministic under a seed."""
    from mmrl.rollout.engine import HFEngine, SamplingParams

    pol, exs = policy_and_examples(kind, media, tmp_path, tiny_world)
    batch = pol._collate([pol.encode_prompt(ex) for ex in exs])
    hf = HFEngine(pol.model, pol.eos_id, pol.pad_id, pol.suppress_ids)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, group_size=1)
    ours, ref = pol.engine.generate(batch, greedy, 0), hf.generate(batch, greedy, 0)
    assert ours.shape[0] == len(exs) and torch.equal(ours, ref[:, :ours.shape[1]])
    assert (ref[:, ours.shape[1]:] == pol.pad_id).all()  # HF may pad on past the last EOS
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, group_size=4)
    a, b = pol.engine.generate(batch, sampled, 7), pol.engine.generate(batch, sampled, 7)
    assert torch.equal(a, b) and not torch.equal(a, pol.engine.generate(batch, sampled, 8))


def test_export_merges_the_lora_into_a_transformers_folder(tiny_vl, tmp_path):
    from transformers import AutoModelForImageTextToText

    from mmrl.export import export

    pol = policy_for(tiny_vl, lora=True, model_path=tiny_vl)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    pol.save_pretrained(str(tmp_path / "policy"))
    assert json.load(open(tmp_path / "policy" / "mmrl_policy.json"))["policy"] == "token"  # the policy's one name
    export(str(tmp_path / "policy"), str(tmp_path / "merged"))
    merged = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged")).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    pol.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, pol.model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
