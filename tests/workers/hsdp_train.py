"""Worker for tests/test_hsdp.py: dist_matrix's feature sets (a tiny flow model, 4 prompts x 4 samples, 2 minibatches,
k steps) in one process or under torchrun with train.parallel=hsdp; rank 0 writes OUT/FEATURE.safetensors (the
trained parameters, whole) and prints the shard mesh and how many gradient all-reduces crossed the replicas.

    python tests/workers/hsdp_train.py MODEL OUT --parallel none|hsdp --features plain,micro,... [--steps K]
        [--set KEY=VALUE ...] [--save] [--nccl-like]   (the default group without a CPU backend, as NCCL)
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def count_all_reduces(counts: dict) -> None:
    """Count the all-reduces on each group (FSDP2 calls torch.distributed.all_reduce for HSDP's replicas)."""
    real = dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        counts[group] = counts.get(group, 0) + 1
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counted


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--parallel", default="none")
    p.add_argument("--features", default="plain")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--save", action="store_true")
    p.add_argument("--nccl-like", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.nccl_like:
        dist.init_process_group("cuda:gloo")
    from dist_matrix import FEATURES
    from safetensors.torch import save_file

    from mmrl.compose import load_config
    from mmrl.shards import gather_to
    from mmrl.trainer import Trainer

    os.makedirs(args.out, exist_ok=True)
    counts: dict = {}
    count_all_reduces(counts)
    tr = None
    for name in args.features.split(","):
        cfg = load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"), [
            f"model.path={args.model}", f"log.out_dir={args.out}/run-{name}-{args.parallel}", "log.tensorboard=false",
            "log.eval_at_start=false", f"train.parallel={args.parallel}", "model.reference=none",
            "train.minibatches=2", "train.prompts_per_iter=4", "train.group_size=4", *FEATURES[name], *args.set])
        tr = Trainer(cfg)
        counts.clear()
        steps = 0
        for it in range(args.steps):
            tr.iteration = it  # as Trainer.fit does
            m = tr.step(it)
            steps += m["train/optimizer_steps"]
        if args.save:
            tr.iteration = args.steps
            tr.save()
        tr.dist.check_in_sync(tr.params)
        mesh = tr.dist.shard_mesh() if tr.dist.world > 1 else None
        replicate = mesh["replicate"].get_group() if mesh is not None else None
        params = gather_to(tr.dist.main, tr.params)
        if tr.dist.main:
            save_file({f"p{i}": q.contiguous() for i, q in enumerate(params)}, os.path.join(args.out, f"{name}.safetensors"))
            layout = f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} " if mesh is not None else ""
            print(f"{name}: world {tr.dist.world} {layout}optimizer steps {steps} replica all-reduces "
                  f"{counts.get(replicate, 0) if mesh is not None else 0} loss {m['train/loss']:.6f}", flush=True)
    tr.dist.close()


if __name__ == "__main__":
    main()
