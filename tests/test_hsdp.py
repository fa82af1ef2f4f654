"""Hybrid sharding (train.parallel=hsdp): FSDP2 on a 2-D ("replicate", "shard") mesh ends where one process ends on 4
gloo CPU processes (2 x 2), its gradient shards cross the replicas once per optimizer step, `mmrl plan` shards over a
node; DDP's gradients are its bucket views; TF32 follows train.tf32 on CUDA only."""

import os
import subprocess
import sys
import time

import pytest
import torch
from nodes import launch_nodes
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests/workers/dist_matrix.py")  # 4 prompts: a group for each of 4 ranks
PROMPTS = ["--set", "train.prompts_per_iter=4"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": ROOT}


def max_diff(a, b) -> float:
    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


def run(model, out, *args, procs: int = 1) -> str:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
        if procs > 1 else [sys.executable]
    r = subprocess.run([*launch, WORKER, model, str(out), *args, *PROMPTS], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_hsdp_on_2x2_processes_ends_where_one_process_ends(tiny_pixel_model, tmp_path):
    """4 prompts x 4 samples, 2 minibatches, 2 iterations, micro-batches of 2 transitions (several backwards per
    optimizer step) on 4 processes as 2 shard groups of 2 (train.shard_size=2): the parameters equal one process's
    (fp32; 1e-6 allows reduction order), and the replicas all-reduce each FSDP unit's gradient shard once per
    optimizer step, not once per backward."""
    start = time.time()
    run(tiny_pixel_model, tmp_path / "one", "--parallel", "none", "--features", "plain,micro")
    out = run(tiny_pixel_model, tmp_path / "hsdp", "--parallel", "hsdp", "--features", "plain,micro", "--set",
              "train.shard_size=2", procs=4)
    lines = {ln.split(":")[0]: ln.split() for ln in out.splitlines() if " world 4 " in ln}
    assert set(lines) == {"plain", "micro"}, out
    for f, words in lines.items():
        assert "mesh (2, 2) ('replicate', 'shard')" in " ".join(words), words
        d = max_diff(tmp_path / "one" / f"{f}.safetensors", tmp_path / "hsdp" / f"{f}.safetensors")
        print(f"hsdp 2 x 2, {f}: max abs difference from one process {d:.2e}")
        assert d < 1e-6, f"{f}: {d}"
    count = {f: int(w[w.index("all-reduces") + 1]) for f, w in lines.items()}
    steps = {f: int(w[w.index("steps") + 1]) for f, w in lines.items()}
    assert steps["micro"] == steps["plain"] == 4 and count["plain"] > 0 and count["micro"] == count["plain"], (count, steps)
    print(f"replica all-reduces over 4 optimizer steps: {count}; {time.time() - start:.0f} s")


@pytest.mark.slow  # ~80 s on 2 cores: 2 "nodes" x 2 processes, 3 feature sets and a save
def test_hsdp_on_two_nodes_shards_per_node(tiny_pixel_model, tmp_path):
    """Two torchrun launches of 2 processes each (2 "nodes" on localhost, a default group without a CPU backend as
    NCCL): train.shard_size=0 shards within each node (LOCAL_WORLD_SIZE=2). Plain, EMA with a KL to it and a frozen
    reference copy (sharded like the policy), and LoRA end where one process ends; a checkpoint is written from the
    shards and loads as a policy with the trained weights."""
    features = "plain,ema_kl,lora"
    run(tiny_pixel_model, tmp_path / "one", "--parallel", "none", "--features", features)
    args = [WORKER, tiny_pixel_model, str(tmp_path / "nodes"), "--parallel", "hsdp", "--features", features,
            "--save", "--nccl-like", *PROMPTS]
    text = launch_nodes(args, tmp_path, cwd=ROOT, env=ENV, per_node=2, timeout=900)
    for f in features.split(","):
        assert f"{f}: world 4 mesh (2, 2) ('replicate', 'shard')" in text[0], text[0][-3000:]
        d = max_diff(tmp_path / "one" / f"{f}.safetensors", tmp_path / "nodes" / f"{f}.safetensors")
        print(f"hsdp 2 nodes x 2, {f}: max abs difference from one process {d:.2e}")
        assert d < 1e-6, f"{f}: {d}"
    from mmrl.checkpoint import policy_folder
    from mmrl.policy.flow import load_policy_checkpoint

    single = load_file(tmp_path / "one" / "plain.safetensors")
    model = load_policy_checkpoint(policy_folder(str(tmp_path / "nodes/run-plain-hsdp/checkpoints/iter-000002")))
    trained = list(model.transformer.parameters())
    assert len(trained) == len(single)
    assert max((p.detach() - single[f"p{i}"]).abs().max().item() for i, p in enumerate(trained)) < 1e-6


def test_plan_shards_over_a_node_under_hsdp():
    """`mmrl plan --world 16 train.parallel=hsdp`: weights, gradients and AdamW state per GPU are fsdp's on one node
    of 8 (PLAN_NODE_GPUS), or on train.shard_size GPUs; a shard group that does not divide the GPUs is refused."""
    from mmrl.compose import load_config
    from mmrl.plan import format_plan, plan

    items = ["train.micro_batch=4", "train.prompts_per_iter=16"]
    cfg = lambda *o: load_config("configs/t2v/motion_grpo.yaml", items + list(o))  # noqa: E731
    hsdp, fsdp8 = plan(cfg("train.parallel=hsdp"), world=16), plan(cfg("train.parallel=fsdp"), world=8)
    two, fsdp2 = plan(cfg("train.parallel=hsdp", "train.shard_size=2"), world=4), plan(cfg("train.parallel=fsdp"), world=2)
    assert (hsdp["sharded_over"], two["sharded_over"]) == (8, 2)
    for k in ("weights_trained_fp32_gib", "gradients_fp32_gib", "adamw_state_fp32_gib", "fsdp_gathered_blocks_gib"):
        assert hsdp[k] == pytest.approx(fsdp8[k]) and two[k] == pytest.approx(fsdp2[k]) and hsdp[k] > 0
    assert hsdp["adamw_state_fp32_gib"] == pytest.approx(two["adamw_state_fp32_gib"] / 4)  # 8 GPUs share it, not 2
    assert "sharded over 8, replicated 2x across nodes" in format_plan(hsdp)
    with pytest.raises(ValueError, match="must divide the 12 GPUs"):
        plan(cfg("train.parallel=hsdp"), world=12)
    with pytest.raises(ValueError, match="train.shard_size=3 does not divide"):
        plan(cfg("train.parallel=hsdp", "train.shard_size=3"), world=4)


def test_hsdp_keys_are_checked():
    from mmrl.compose import load_config
    from mmrl.parallel.distributed import _shard_size

    with pytest.raises(ValueError, match="train.shard_size=2 sets the shard group of train.parallel=hsdp"):
        load_config("configs/tiny/flow_smoke.yaml", ["train.parallel=fsdp", "train.shard_size=2"])
    with pytest.raises(ValueError, match="train.shard_size must be >= 0"):
        load_config("configs/tiny/flow_smoke.yaml", ["train.parallel=hsdp", "train.shard_size=-1"])
    assert (_shard_size("fsdp", 0, 8), _shard_size("ddp", 0, 8), _shard_size("hsdp", 4, 8)) == (8, 1, 4)
    os.environ["LOCAL_WORLD_SIZE"], before = "2", os.environ.get("LOCAL_WORLD_SIZE")
    try:
        assert _shard_size("hsdp", 0, 8) == 2  # a node: torchrun's processes per node
        with pytest.raises(ValueError, match="must divide the 8 processes"):
            _shard_size("hsdp", 3, 8)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE") if before is None else os.environ.update(LOCAL_WORLD_SIZE=before)


def test_tf32_follows_the_config_on_cuda_only(monkeypatch):
    from mmrl.devices import set_tf32

    class Flag:
        allow_tf32 = "untouched"

    matmul, cudnn = Flag(), Flag()
    monkeypatch.setattr(torch.backends.cuda, "matmul", matmul)
    monkeypatch.setattr(torch.backends, "cudnn", cudnn)
    set_tf32("cpu", True)
    assert (matmul.allow_tf32, cudnn.allow_tf32) == ("untouched", "untouched")
    set_tf32("cuda:1", True)
    assert (matmul.allow_tf32, cudnn.allow_tf32) == (True, True)
    set_tf32(torch.device("cuda"), False)
    assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)


def test_tf32_is_set_when_the_policy_is_built(monkeypatch, tiny_pixel_model, tmp_path):
    """compose.build_policy applies train.tf32 for model.device before the weights load (train, eval and sample)."""
    from mmrl import compose

    seen = []
    monkeypatch.setattr(compose, "set_tf32", lambda device, on: seen.append((device, on)))
    cfg = compose.load_config("configs/tiny/flow_smoke.yaml", [f"model.path={tiny_pixel_model}", "model.device=cpu",
                                                               "train.tf32=false", f"log.out_dir={tmp_path}"])
    compose.build_policy(cfg)
    assert seen == [("cpu", False)]
