"""The vLLM rollout engine (runs where vLLM is installed: its own venv, see README; skipped elsewhere).

    .venv-vllm/bin/python -m pytest -q tests/test_vllm_engine.py

A tiny Qwen2 causal LM (real class, local tokenizer): vLLM's log-probs of the tokens it sampled equal the
trainer's recomputed ones; after the policy's weights change, sync_weights makes vLLM sample from the new
weights; LoRA adapters are merged before the push."""

import os

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


def policy_for(path, lora=False):
    from mmrl.compose import load_config
    from mmrl.policy.token import build_token_policy

    cfg = load_config(None, ["model.policy=token", f"model.path={path}", "model.reference=none", "sampler.engine=vllm",
                             "sampler.max_new_tokens=12", "sampler.temperature=1.0",
                             'sampler.vllm={"max_model_len": 256}', f"model.lora.enabled={str(lora).lower()}",
                             "task.name=arithmetic", "reward.name=arithmetic"])
    return build_token_policy(cfg)


def agreement(policy, seed=0):
    ex = [{"prompt": "what is 3 + 4 ?"}, {"prompt": "what is 12 + 7 ?"}]
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
