"""Worker for benchmarks/bench_scale.py: `Trainer.step`s of each rollout kind on a pixel flow model, in one process or
under torchrun (train.parallel=ddp), timed per iteration; every rank writes OUT/rank{R}.json ({kind: [iteration]}).

    python benchmarks/_scale_worker.py MODEL OUT --kinds chain,tree,nft --prompts B [--parallel ddp] ...

One launch runs every kind (a fresh trainer each; the process group is set up once).

Per iteration and rank: wall time (from a barrier to the end of the step: a step ends in gradient all-reduces, so
the slowest rank sets it), the trainer's time/rollout and time/train, and the transformer rows this rank ran in
sampling (no grad; classifier-free guidance doubles them) and in training (with grad: a forward and a backward).
"""

import argparse
import json
import os
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KINDS = {
    "chain": [],                                                                       # Flow-GRPO
    "tree": ["tree.split_steps=[1,2]", "tree.branch=2", "algo.loss_agg=token_mean"],   # BranchGRPO: 4 leaves
    "nft": ["algo.objective.name=nft", "sampler.kind=ode"],                               # DiffusionNFT
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--kinds", default="chain,tree,nft", help=f"comma-separated, of {sorted(KINDS)}")
    p.add_argument("--parallel", default="none", choices=["none", "ddp", "fsdp"])
    p.add_argument("--prompts", type=int, required=True, help="prompts (groups) per iteration, all ranks together")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="sampler steps")
    p.add_argument("--minibatches", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="measured iterations")
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    kinds = args.kinds.split(",")
    if set(kinds) - set(KINDS):
        raise ValueError(f"unknown rollout kinds {sorted(set(kinds) - set(KINDS))}; valid: {sorted(KINDS)}")
    os.makedirs(args.out, exist_ok=True)
    results, tr = {}, None
    for kind in kinds:
        cfg = load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"), [
            f"model.path={args.model}", f"log.out_dir={args.out}/run-{kind}", "log.tensorboard=false",
            "log.eval_at_start=false", "log.progress=false", "log.image_every=0", "model.reference=none",
            "train.threads=1", f"train.parallel={args.parallel}", f"train.prompts_per_iter={args.prompts}",
            f"train.group_size={args.group_size}", f"train.minibatches={args.minibatches}",
            f"sampler.num_steps={args.steps}", *KINDS[kind]])
        tr = Trainer(cfg)
        results[kind] = measure(tr, args.warmup, args.iters)
    with open(os.path.join(args.out, f"rank{tr.dist.rank}.json"), "w") as f:
        json.dump({"rank": tr.dist.rank, "world": tr.dist.world, "kinds": results}, f)
    tr.dist.close()


def measure(tr, warmup: int, iters: int) -> list[dict]:
    """`warmup + iters` steps of `tr`; the measured ones' wall time, phase times and this rank's transformer rows."""
    rows = {"sample": 0, "train": 0}

    def count(module, a, kwargs):
        rows["train" if torch.is_grad_enabled() else "sample"] += kwargs["hidden_states"].shape[0]

    transformer = tr.policy.transformer
    getattr(transformer, "module", transformer).register_forward_pre_hook(count, with_kwargs=True)  # inside DDP
    out = []
    for it in range(warmup + iters):
        tr.iteration = it  # as Trainer.fit does
        rows.update(sample=0, train=0)
        tr.dist.barrier()
        t0 = time.perf_counter()
        m = tr.step(it)
        wall = time.perf_counter() - t0
        if it >= warmup:
            out.append({"wall": wall, "rollout": m.get("time/rollout", 0.0), "train": m.get("time/train", 0.0),
                        "sample_rows": rows["sample"], "train_rows": rows["train"]})
    tr.dist.check_in_sync(tr.params)
    return out

if __name__ == "__main__":
    main()
