"""Worker for tests/test_checkpoint.py: a tiny flow run that saves a sharded checkpoint, or resumes one on another
number of processes / another parallelism, in one process or under torchrun.

    python tests/workers/reshard.py MODEL RUN OUT --parallel none|ddp|fsdp --steps K --save-at S [--resume]
    python tests/workers/reshard.py RUN0 RUN1 --shared-check    (2 processes: each rank gets its own folder)

Without --resume: K steps, a checkpoint after S (RUN/checkpoints/iter-S), the last K - S steps. --resume: a new
trainer resumes RUN's newest checkpoint and runs to K. Rank 0 writes OUT (safetensors): the whole trained
parameters and EMA shadow (p0.., e0..). --shared-check: check_shared_run_dir on a folder per rank (a node-local
log.out_dir), which must refuse on every rank (exit code 3).
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def shared_check(run0: str, run1: str) -> None:
    from mmrl.checkpoint import check_shared_run_dir
    from mmrl.parallel.distributed import Distributed
    from mmrl.errors import ConfigError

    d = Distributed("ddp")
    try:  # one node pretending to be two: each rank its own "node-local" folder
        check_shared_run_dir([run0, run1][d.rank], d, multinode=True)
    except ConfigError as e:
        print(f"rank {d.rank}: {e}", flush=True)
        d.close()
        sys.exit(3)
    check_shared_run_dir(run0, d, multinode=True)  # one folder both see: passes
    d.close()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("run")
    p.add_argument("out", nargs="?")
    p.add_argument("--parallel", default="none")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-at", type=int, default=2)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--shared-check", action="store_true")
    p.add_argument("--set", nargs="*", default=[], help="more config overrides (section.key=value)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.shared_check:
        return shared_check(args.model, args.run)
    from safetensors.torch import save_file

    from mmrl.compose import load_config
    from mmrl.parallel.shards import full
    from mmrl.trainer import Trainer

    cfg = load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"), [
        f"model.path={args.model}", f"log.out_dir={args.run}", "log.tensorboard=false", "log.eval_at_start=false",
        f"train.parallel={args.parallel}", "model.reference=none", "train.minibatches=2", "train.ema_decay=0.9",
        "train.prompts_per_iter=3", "train.group_size=4", f"train.iterations={args.steps}", *args.set])
    tr = Trainer(cfg)
    start = 0
    if args.resume:
        assert tr.resume() and tr.iteration == args.save_at, tr.iteration
        start = args.save_at
    for it in range(start, args.steps):
        tr.iteration = it  # as Trainer.fit does
        tr.step(it)
        if it + 1 == args.save_at and not args.resume:
            tr.iteration = it + 1
            tr.save()
    params = {f"p{i}": full(q).detach().clone().contiguous() for i, q in enumerate(tr.params)}
    params.update({f"e{i}": full(q).detach().clone().contiguous() for i, q in enumerate(tr.ema.shadow)})
    if tr.dist.main:
        save_file(params, args.out)
        print(f"world {tr.dist.world} parallel {args.parallel} iteration {args.steps}", flush=True)
    tr.dist.close()


if __name__ == "__main__":
    main()
