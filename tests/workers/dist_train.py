"""Worker for tests/test_distributed.py: k trainer steps on a tiny flow model, in one process or under torchrun.

    python tests/workers/dist_train.py MODEL OUT --parallel none|ddp|fsdp --steps K [--desync]

Rank 0 writes OUT (safetensors): the full trained parameters. --desync perturbs rank 1's weights before the
final sync check, which must then raise (exit code 3).
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def completion_length(outputs, examples):
    """A reward with signal on an untrained tiny VLM (the grounding reward is 0 on its random text): characters."""
    return [float(len(o)) for o in outputs]


def count_scoring_prefills(policy) -> list[int]:
    """Counts the prompt passes of shared-prefix scoring (the engine keeps its own reference to prefill)."""
    calls, prefill = [0], policy.prefill

    def counted(*a, **kw):
        calls[0] += 1
        return prefill(*a, **kw)

    policy.prefill = counted
    return calls


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--parallel", default="none")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--desync", action="store_true")
    p.add_argument("--save", action="store_true", help="also write a checkpoint (gathers FSDP shards)")
    p.add_argument("--resume-at", type=int, default=0, help="save after this many steps, resume in a new trainer")
    p.add_argument("--world", default=None, help="token policy: MODEL is a tiny Qwen-VL, WORLD a grounding world")
    p.add_argument("--set", nargs="*", default=[], help="more config overrides (section.key=value)")
    p.add_argument("--nccl-like", action="store_true", help="default process group without a CPU backend, as NCCL")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.nccl_like:
        import torch.distributed as dist

        dist.init_process_group("cuda:gloo")
    from safetensors.torch import save_file

    from mmrl.compose import load_config
    from mmrl.parallel.shards import full
    from mmrl.trainer import Trainer

    common = [f"model.path={args.model}", f"log.out_dir={os.path.dirname(args.out)}/run-{args.parallel}{'-resume' if args.resume_at else ''}",
              "log.tensorboard=false", "log.eval_at_start=false", f"train.parallel={args.parallel}",
              "model.reference=none", "train.minibatches=2", *args.set]
    if args.world:
        cfg = load_config(os.path.join(ROOT, "configs/tiny/vlm_smoke.yaml"), common + [f"task.kwargs.root={args.world}"])
    else:
        cfg = load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"),
                          common + ["train.prompts_per_iter=3", "train.group_size=4"])
    tr = Trainer(cfg)
    prefills = count_scoring_prefills(tr.policy) if args.world else [0]
    for it in range(args.resume_at or args.steps):
        tr.iteration = it  # as Trainer.fit does
        m = tr.step(it)
    if args.resume_at:  # a checkpoint, then a fresh trainer that resumes from it and finishes the run
        tr.iteration = args.resume_at
        tr.save()
        tr = Trainer(cfg)
        assert tr.resume() and tr.iteration == args.resume_at
        for it in range(args.resume_at, args.steps):
            tr.iteration = it
            m = tr.step(it)
    if args.save:
        tr.iteration = args.steps
        tr.save()
    if args.desync and tr.dist.rank == 1:
        with torch.no_grad():
            tr.params[0].add_(1e-3)
    try:
        tr.dist.check_in_sync(tr.params)
    except RuntimeError as e:
        print(f"rank {tr.dist.rank}: {e}", flush=True)
        sys.exit(3)
    params = {f"p{i}": full(q).detach().clone().contiguous() for i, q in enumerate(tr.params)}
    if tr.dist.main:
        save_file(params, args.out)
        print(f"world {tr.dist.world} reward {m['reward/overall_mean']:.4f} loss {m['train/loss']:.6f} "
              f"scoring prefills {prefills[0]}", flush=True)
    tr.dist.close()


if __name__ == "__main__":
    main()
