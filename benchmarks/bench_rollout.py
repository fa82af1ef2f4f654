"""Rollout + training cost per iteration: chain Flow-GRPO vs BranchGRPO, BranchGRPO pruned, BranchGRPO-Mix, a
MixGRPO window chain and MixGRPO-Flash (the window + DPM-Solver++(2M) over every 3rd sigma outside it), side by side
in one process, on the same small SD3 transformer (the shapes world's SD3Transformer2DModel).

    python benchmarks/bench_rollout.py --threads 2            # 20 steps, splits 0,3,6,9, 16 leaves, 2 prompts
    python benchmarks/bench_rollout.py --quick                # 8 steps, splits 0,1,2,3, 1 prompt, 1 iteration

Every variant makes 16 final images per prompt and runs full `Trainer.step`s (rollout, reward, advantages,
one epoch of training). Counted per iteration: transformer rows in sampling (no grad) and in training (with
grad; each costs a forward and a backward), and wall time (median over the measured iterations, after one
warm-up). The chain trains every SDE step (SDE on all trainable steps, as the BranchGRPO paper's baseline).
Ratios are against the chain. The last line is one JSON object.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def variants(steps: int, splits: list[int], mix_window: int, width_ratio: float, prune: list[int],
             flash_stride: int) -> dict:
    tree = [f"tree.split_steps={splits}", "algo.loss_agg=token_mean"]
    window = [f"sampler.sde_window_size={mix_window}", f"sampler.sde_window_range=[0,{steps // 2}]"]
    return {
        "chain": [],
        "branch": tree,
        "branch_pruned": tree + ["tree.width_prune=1", f"tree.width_ratio={width_ratio}", f"tree.prune_steps={prune}"],
        "branch_mix": tree + [f"sampler.sde_window_size={mix_window}"],
        "chain_window": window,  # MixGRPO: SDE (and training) on a window, Euler ODE elsewhere
        "mixgrpo_flash": window + ["sampler.ode_solver=dpm2m", f"sampler.ode_stride={flash_stride}",
                                   "sampler.window_schedule=sliding"],
    }


def run_variant(items: list[str], iters: int, warmup: int, out_dir: str) -> dict:
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    cfg = load_config(os.path.join(ROOT, "configs/t2i/shapes_grpo.yaml"), items + [f"log.out_dir={out_dir}"])
    tr = Trainer(cfg)
    rows = {"sample": 0, "train": 0}

    def count(module, args, kwargs):
        rows["train" if torch.is_grad_enabled() else "sample"] += kwargs["hidden_states"].shape[0]

    tr.policy.transformer.register_forward_pre_hook(count, with_kwargs=True)
    per_iter = []
    for it in range(warmup + iters):
        rows.update(sample=0, train=0)
        t0 = time.perf_counter()
        m = tr.step(it)
        wall = time.perf_counter() - t0
        if it >= warmup:
            per_iter.append({"wall": wall, "rollout": m.get("time/rollout", 0.0), "train": m.get("time/train", 0.0),
                             "sample_rows": rows["sample"], "train_rows": rows["train"],
                             "trained_transitions": m.get("tree/trained_transitions", float(rows["train"]))})
    med = lambda k: statistics.median(p[k] for p in per_iter)  # noqa: E731
    return {k: round(med(k), 3) for k in per_iter[0]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="8 steps, splits 0,1,2,3, 1 prompt, 1 iteration, no warm-up")
    p.add_argument("--prompts", type=int, default=2, help="prompts per iteration (16 images each)")
    p.add_argument("--iters", type=int, default=2, help="measured iterations per variant")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--minibatches", type=int, default=4, help="training minibatches per iteration (every variant)")
    p.add_argument("--mix-window", type=int, default=4, help="BranchGRPO-Mix SDE window (plus the split steps)")
    p.add_argument("--width-ratio", type=float, default=0.25, help="pruned: share of post-split steps kept")
    p.add_argument("--flash-stride", type=int, default=3, help="MixGRPO-Flash: ODE over every k-th sigma")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        steps, splits, prompts, iters, warmup = 8, [0, 1, 2, 3], 1, 1, 0
    else:
        steps, splits, prompts, iters, warmup = 20, [0, 3, 6, 9], args.prompts, args.iters, 1
    prune = [steps - 2]  # depth pruning: the last trainable step (lowest noise) is not trained
    common = [f"sampler.num_steps={steps}", "sampler.sde_window_size=0", "sampler.shared_noise=true",
              f"train.prompts_per_iter={prompts}", "train.group_size=16", f"train.minibatches={args.minibatches}",
              "log.tensorboard=false", "log.progress=false", "log.image_every=0", f"train.threads={args.threads}"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, items in variants(steps, splits, args.mix_window, args.width_ratio, prune, args.flash_stride).items():
            results[name] = run_variant(common + items, iters, warmup, os.path.join(tmp, name))
            print(f"{name:14s} " + " ".join(f"{k}={v}" for k, v in results[name].items()), flush=True)
    chain = results["chain"]
    for name, r in results.items():
        r["wall_vs_chain"] = round(r["wall"] / chain["wall"], 3)
        r["rows_vs_chain"] = round((r["sample_rows"] + 3 * r["train_rows"]) /
                                   (chain["sample_rows"] + 3 * chain["train_rows"]), 3)
    w = results["chain_window"]
    flash = results["mixgrpo_flash"]
    flash["vs_chain_window"] = {"sample_rows": round(flash["sample_rows"] / w["sample_rows"], 3),
                                "rows": round((flash["sample_rows"] + 3 * flash["train_rows"]) /
                                              (w["sample_rows"] + 3 * w["train_rows"]), 3),
                                "wall": round(flash["wall"] / w["wall"], 3)}
    print("ratios vs chain (wall; rows with a training row = forward + backward = 3 forwards): " +
          ", ".join(f"{k} {r['wall_vs_chain']} / {r['rows_vs_chain']}" for k, r in results.items()))
    print("mixgrpo_flash vs chain_window (the same SDE window): " +
          ", ".join(f"{k} {v}" for k, v in flash["vs_chain_window"].items()))
    print(json.dumps({"steps": steps, "splits": splits, "images_per_prompt": 16, "prompts": prompts,
                      "threads": args.threads, "minibatches": args.minibatches, "results": results}))


if __name__ == "__main__":
    main()
