"""The training phase of a flow iteration (mmrl's Trainer.step, its "train" timer: the passes' forwards, backwards,
losses, statistics and optimizer steps), two checkouts side by side on the same model, config and seeds.

Each (checkout, micro-batch) arm runs in its own process with PYTHONPATH at its checkout: one warm-up iteration, then
--iters iterations, the median of their training phases reported. Arms alternate in the order given, so a noisy
machine slows both alike. Model: a StableDiffusion3Pipeline folder from mmrl's tiny SD3 (--size tiny, 1 layer), or
the same pipeline with an SD3 transformer of ~120 M parameters (--size 100m: 12 layers, 10 heads x 64, 16 x 16
latents), CFG 4.5 with cfg_grad=cond, 6 steps, 2 prompts x 4 rows.

    python benchmarks/bench_train_phase.py --before /tmp/before              # this checkout against an older one
    python benchmarks/bench_train_phase.py --before /tmp/before --quick      # tiny SD3 only, micro-batch 4
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(folder: str, size: str) -> None:
    import torch

    from mmrl.models.tiny_pipelines import build_tiny

    pipe = build_tiny("sd3")
    if size == "100m":
        from diffusers import SD3Transformer2DModel

        torch.manual_seed(0)
        pipe.transformer = SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=12, attention_head_dim=64,
            num_attention_heads=10, joint_attention_dim=32, caption_projection_dim=640, pooled_projection_dim=64,
            pos_embed_max_size=16)
    pipe.save_pretrained(folder)


def arm(folder: str, size: str, micro_batch: int, iters: int) -> dict:
    """One arm, in this process: the training phases of `iters` iterations after a warm-up one."""
    import torch

    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    torch.set_num_threads(1)
    out = tempfile.mkdtemp()
    cfg = load_config(os.path.join(HERE, "configs/tiny/flow_smoke.yaml"), [
        f"model.path={folder}", f"model.sample_size={16 if size == '100m' else 8}", "sampler.num_steps=6",
        "sampler.cfg_scale=4.5", "sampler.cfg_grad=cond", "train.prompts_per_iter=2", "train.group_size=4",
        "train.minibatches=1", f"train.micro_batch={micro_batch}", "model.lora.enabled=false", f"log.out_dir={out}",
        "log.tensorboard=false", "log.save_every=0", "log.eval_at_start=false"])
    tr = Trainer(cfg)
    times = []
    for it in range(iters + 1):
        m = tr.step(it)
        times.append(m["time/train"])
    params = sum(p.numel() for p in tr.policy.transformer.parameters())
    return {"train_s": statistics.median(times[1:]), "params": params}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="an older checkout of mmrl (e.g. a git worktree) to compare with")
    ap.add_argument("--quick", action="store_true", help="the tiny SD3 only, micro-batch 4, 2 iterations per arm")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--arm", nargs=4, help=argparse.SUPPRESS)  # folder size micro_batch iters (a child process)
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(arm(args.arm[0], args.arm[1], int(args.arm[2]), int(args.arm[3]))))
        return
    sizes, batches = (["tiny"], [4]) if args.quick else (["tiny", "100m"], [4, 0])
    iters = 2 if args.quick else args.iters
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            folder = os.path.join(tmp, size)
            build(folder, size)
            for mb in batches:
                row = {}
                for name, root in (("before", os.path.abspath(args.before)), ("now", HERE)):
                    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
                    run = subprocess.run([sys.executable, os.path.join(HERE, "benchmarks/bench_train_phase.py"),
                                          "--before", root, "--arm", folder, size, str(mb), str(iters)],
                                         env=env, cwd=root, capture_output=True, text=True)
                    if run.returncode:
                        raise SystemExit(f"{name} arm failed:\n{run.stderr[-3000:]}")
                    row[name] = json.loads(run.stdout.strip().splitlines()[-1])
                key = f"{size}_mb{mb}"
                result[key] = {"params": row["now"]["params"], "before_s": row["before"]["train_s"],
                               "now_s": row["now"]["train_s"], "ratio": row["now"]["train_s"] / row["before"]["train_s"]}
                print(f"{key}: {row['now']['params'] / 1e6:.1f} M params, training phase before "
                      f"{row['before']['train_s']:.2f} s, now {row['now']['train_s']:.2f} s "
                      f"({result[key]['ratio']:.2f}x)", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
