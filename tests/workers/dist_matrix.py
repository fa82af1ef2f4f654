"""Worker for tests/test_distributed.py's feature matrix: for each named feature set, a fresh trainer on a tiny flow
model runs k steps (3 prompts x 4 samples, 2 minibatches), in one process or under torchrun, and rank 0 writes
OUT/FEATURE.safetensors (the trained parameters, whole) and OUT/FEATURE.json (the last step's metrics), and prints
its optimizer steps and, under hsdp, the shard mesh and how many all-reduces crossed the replicas.

    python tests/workers/dist_matrix.py MODEL OUT --parallel none|ddp|fsdp|hsdp --features plain,micro,... [--steps K]
        [--set KEY=VALUE ...]   (overrides for every feature set)
        [--nccl-like]   (the default group made with init_process_group("cuda:gloo"): no CPU backend, as NCCL)

One launch runs every feature (a process group is set up once): the matrix costs three launches, not thirty.
"""

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

def count_all_reduces(counts: dict) -> None:
    """Count the all-reduces on each group (FSDP2 calls torch.distributed.all_reduce for HSDP's replicas)."""
    import torch.distributed as dist

    real = dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        counts[group] = counts.get(group, 0) + 1
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counted


class RefillReward:
    """A reward that makes DAPO dynamic sampling refill with fewer groups than ranks: every group of a round scores
    its images' mean brightness (spread within the group: informative) but the round's group 0, which scores 0.5
    (zero std). A round of 3 groups keeps 2, and each refill round asks for 1 group, which only one of 2 ranks holds:
    the other samples a padding copy."""

    needs_groups = True  # the reward runner passes the round's group ids

    def __call__(self, outputs, examples, group_id):  # outputs [n, 3, H, W], group_id [n]
        score = outputs.float().flatten(1).mean(1)                              # [n]
        return {"overall": torch.where(group_id == 0, torch.full_like(score, 0.5), score)}


REFILL = ["algo.dynamic_sampling=true", "algo.dynamic_sampling_tries=2", "reward.name=dist_matrix:RefillReward",
          "reward.kwargs={}", "reward.eval_name=shapes"]
PAIRWISE = ["reward.name=pairwise", "reward.kwargs={judge: score, judge_kwargs: {reward: shapes}}",
            "reward.eval_name=shapes"]
FEATURES = {
    "plain": [],
    "micro": ["train.micro_batch=2"],                                     # transitions per training forward
    "tree": ["tree.split_steps=[1,2]", "tree.branch=2", "algo.loss_agg=token_mean"],  # BranchGRPO: 4 leaves
    "tree_pruned": ["tree.split_steps=[1,2]", "tree.branch=2", "tree.width_prune=1", "algo.loss_agg=token_mean"],
    # TempFlow per-step branching: a trunk per prompt, 2 children at each of 2 window steps (4 rows a prompt)
    "step_branch": ["sampler.branch_children=2", "sampler.sde_window_size=2", "sampler.sde_window_range=[0,2]",
                    "algo.weighting=tempflow", "algo.tempflow_constant=2.25"],
    "dynamic": REFILL,                                                    # refill rounds of 1 group on 2 ranks
    # the same with reward overlap workers (a chunk of 1 group: one rank has none) and micro-batches
    "refill": [*REFILL, "reward.workers=1", "reward.overlap_chunks=2", "train.micro_batch=2"],
    "workers": ["reward.workers=1", "reward.overlap_chunks=2"],
    "pairwise": PAIRWISE,
    "nft": ["algo.objective.name=nft", "sampler.cfg_scale=1.0", "sampler.kind=ode"],
    "awm": ["algo.objective.name=awm", "sampler.cfg_scale=1.0"],
    "flash": ["sampler.sde_window_size=2", "sampler.sde_window_range=[0,2]", "sampler.window_schedule=sliding",
              "sampler.ode_solver=dpm2m", "sampler.ode_stride=2"],
    "ema_kl": ["train.ema_decay=0.5", "algo.kl_coef=0.1", "algo.kl_reference=ema", "model.reference=auto"],
    # anchored AWM: the EMA anchors its negative branch, the frozen base is the KL's reference (two forwards)
    "awm_ema_anchor": ["algo.objective.name=awm_anchored", "sampler.cfg_scale=1.0", "sampler.kind=ode", "algo.objective.kwargs={anchor: ema}",
                       "train.ema_decay=0.5", "algo.kl_coef=0.1", "algo.kl=flow_velocity", "model.reference=auto"],
    "lora": ["model.lora.enabled=true", "model.lora.rank=4"],
    "kl_base": ["algo.kl_coef=0.1", "model.reference=auto"],              # a frozen copy of the base as reference
    # every feature at once, in the two combinations the config allows (trees sample in one pass: no reward workers)
    "all_tree": ["train.micro_batch=2", "tree.split_steps=[1,2]", "tree.branch=2", "algo.loss_agg=token_mean",
                 "algo.dynamic_sampling=true", "algo.dynamic_sampling_tries=2", *PAIRWISE, "train.ema_decay=0.5",
                 "algo.kl_coef=0.1", "algo.kl_reference=ema", "model.reference=auto", "model.lora.enabled=true",
                 "model.lora.rank=4"],
    "all_chain": ["train.micro_batch=2", "algo.dynamic_sampling=true", "algo.dynamic_sampling_tries=2",
                  "reward.workers=1", "reward.overlap_chunks=2", *PAIRWISE, "train.ema_decay=0.5", "algo.kl_coef=0.1",
                  "algo.kl_reference=ema", "model.reference=auto", "model.lora.enabled=true", "model.lora.rank=4"],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--parallel", default="none")
    p.add_argument("--features", default="plain")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--set", nargs="*", action="extend", default=[],
                   help="overrides for every feature set (e.g. another model / task); repeated --set add up")
    p.add_argument("--eval", action="store_true", help="then the held-out evaluation (sharded over the ranks)")
    p.add_argument("--save", action="store_true", help="then a checkpoint (FSDP: gathered on rank 0)")
    p.add_argument("--nccl-like", action="store_true", help="the default process group has no CPU backend, as NCCL: "
                                                            "a collective on a CPU tensor outside mmrl's own groups fails")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.nccl_like:
        import torch.distributed as dist

        dist.init_process_group("cuda:gloo")
        try:
            dist.all_reduce(torch.zeros(1))
            raise SystemExit("the cuda:gloo group accepted a CPU tensor: it does not stand for NCCL")
        except RuntimeError as e:
            assert "No backend type associated with device type cpu" in str(e), e
    from safetensors.torch import save_file

    from mmrl.compose import load_config
    from mmrl.parallel.shards import gather_to
    from mmrl.trainer import Trainer

    os.makedirs(args.out, exist_ok=True)
    counts: dict = {}
    count_all_reduces(counts)
    tr = None
    for name in args.features.split(","):
        cfg = load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"), [
            f"model.path={args.model}", f"log.out_dir={args.out}/run-{name}-{args.parallel}", "log.tensorboard=false",
            "log.eval_at_start=false", f"train.parallel={args.parallel}", "model.reference=none",
            "train.minibatches=2", "train.prompts_per_iter=3", "train.group_size=4", *FEATURES[name], *args.set])
        tr = Trainer(cfg)
        counts.clear()
        steps = 0
        for it in range(args.steps):
            tr.iteration = it  # as Trainer.fit does
            m = tr.step(it)
            steps += m["train/optimizer_steps"]
        if args.eval:
            m = {**m, **{f"eval/{k}": v for k, v in tr.evaluate(args.steps).items() if k != "per_category"}}
        if args.save:
            tr.iteration = args.steps
            tr.save()
        tr.dist.check_in_sync(tr.params)
        mesh = tr.dist.shard_mesh() if tr.dist.world > 1 and args.parallel == "hsdp" else None
        layout = "" if mesh is None else (f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} replica all-reduces "
                                          f"{counts.get(mesh['replicate'].get_group(), 0)} ")
        params = gather_to(tr.dist.main, tr.params)
        if tr.dist.main:
            save_file({f"p{i}": q.contiguous() for i, q in enumerate(params)}, os.path.join(args.out, f"{name}.safetensors"))
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(m, f)
            print(f"{name}: world {tr.dist.world} {layout}optimizer steps {steps} reward {m['reward/overall_mean']:.4f} "
                  f"loss {m['train/loss']:.6f}", flush=True)
    tr.dist.close()


if __name__ == "__main__":
    main()
