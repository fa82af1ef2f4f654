"""Flow RL methods side by side at equal wall time on the embedded shapes world: for each seed, one training run per
method starts at the same moment (each `mmrl train CONFIG` in its own process, train.threads=1), all with the same
time budget and a held-out evaluation halfway and at the end (`log.eval_every_min`, which counts in the budget).

    python scripts/compare_flow_rl.py --minutes 16 --seeds 0 1 2           # grpo, nft, awm, flash; 504 prompts
    python scripts/compare_flow_rl.py --methods grpo flash_random awm_ema_kl  # random window; AWM + KL to its EMA
    python scripts/compare_flow_rl.py --quick                              # 1 minute, 1 seed, 2 methods, 24 prompts

Prints a table of held-out strict accuracy (mean over seeds, and per seed) at half and full time, the base's
accuracy, and the gains; the last line is one JSON object. Gains are over the base at the trainer's eval seed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# method -> (config, overrides)
METHODS = {"grpo": ("configs/t2i/shapes_grpo.yaml", []), "nft": ("configs/t2i/shapes_nft.yaml", []),
           "awm": ("configs/t2i/shapes_awm.yaml", []), "flash": ("configs/t2i/shapes_mixgrpo_flash.yaml", []),
           "dgpo": ("configs/t2i/shapes_dgpo.yaml", []), "flow_dppo": ("configs/t2i/shapes_flow_dppo.yaml", []),
           "flash_random": ("configs/t2i/shapes_mixgrpo_flash.yaml", ["sampler.window_schedule=random"]),
           "awm_ema_kl": ("configs/t2i/shapes_awm.yaml", ["algo.kl_coef=0.1", "algo.kl=flow_velocity",
                                                           "algo.kl_reference=ema", "train.ema_decay=0.9"])}


def launch(method: str, seed: int, minutes: float, out: str, extra: list[str]) -> subprocess.Popen:
    items = [f"train.seed={seed}", f"train.time_budget_min={minutes}", f"log.eval_every_min={minutes / 2}",
             "train.iterations=100000", "train.threads=1", "log.eval_at_start=false", "log.progress=false",
             f"log.out_dir={out}", "log.image_every=0", *extra]
    log = open(os.path.join(out + ".log"), "w")
    config, overrides = METHODS[method]
    return subprocess.Popen([sys.executable, "-m", "mmrl.cli", "train", config, "--overwrite", *overrides, *items], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def base_accuracy(eval_prompts: int) -> float:
    """The committed base at the trainer's evaluation seed (10000), as every run's eval_start would give."""
    from mmrl.compose import build_policy, build_reward, build_task, load_config
    from mmrl.evaluation import evaluate_outputs

    cfg = load_config(os.path.join(ROOT, METHODS["grpo"][0]), [f"task.eval_prompts={eval_prompts}", "log.progress=false"])
    reward = build_reward(cfg.reward.name, cfg.reward.kwargs)
    res = evaluate_outputs(build_policy(cfg).evaluate, build_task(cfg.task).eval_examples(),
                           lambda o, e: reward(o, e), seed=10_000)
    return res["strict"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["grpo", "nft", "awm", "flash"], choices=list(METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, default=16.0, help="wall-time budget of every run")
    ap.add_argument("--eval-prompts", type=int, default=504)
    ap.add_argument("--out", default="runs/compare_flow_rl")
    ap.add_argument("--quick", action="store_true", help="1 minute, seed 0, grpo and nft, 24 held-out prompts")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.seeds, args.methods, args.eval_prompts = 1.0, [0], ["grpo", "nft"], 24
    extra = [f"task.eval_prompts={args.eval_prompts}"] + (["train.prompts_per_iter=4", "train.group_size=4"]
                                                          if args.quick else [])
    os.makedirs(args.out, exist_ok=True)
    runs = {}
    for seed in args.seeds:  # the methods of one seed run at the same time, so they share the machine's load
        procs = {m: launch(m, seed, args.minutes, os.path.join(args.out, f"{m}_s{seed}"), extra) for m in args.methods}
        for m, p in procs.items():
            if p.wait() != 0:
                sys.exit(f"{m} seed {seed} failed; see {os.path.join(args.out, f'{m}_s{seed}.log')}")
            res = json.load(open(os.path.join(args.out, f"{m}_s{seed}", "results.json")))
            half = res["eval_timed"][0] if res["eval_timed"] else None
            runs[(m, seed)] = {"half": half["strict"] if half else None, "half_minutes": half and half["minutes"],
                               "full": res["eval_end"]["strict"], "iterations": res["iterations"]}
    base = base_accuracy(args.eval_prompts)
    table = {}
    print(f"base {100 * base:.2f}% strict on {args.eval_prompts} held-out prompts; {args.minutes} min per run")
    print(f"{'method':8s} {'half':>8s} {'full':>8s} {'gain half':>10s} {'gain full':>10s}  per seed (half / full, iterations)")
    for m in args.methods:
        rs = [runs[(m, s)] for s in args.seeds]
        half = [r["half"] for r in rs if r["half"] is not None]
        row = {"half": statistics.mean(half) if half else None, "full": statistics.mean(r["full"] for r in rs),
               "per_seed": rs}
        row["gain_half"] = row["half"] - base if half else None
        row["gain_full"] = row["full"] - base
        table[m] = row
        fmt = lambda v: f"{100 * v:8.2f}" if v is not None else f"{'-':>8s}"  # noqa: E731
        seeds = "  ".join(f"{fmt(r['half']).strip()}/{100 * r['full']:.2f} ({r['iterations']})" for r in rs)
        print(f"{m:8s} {fmt(row['half'])} {fmt(row['full'])} {fmt(row['gain_half']):>10s} {fmt(row['gain_full']):>10s}  {seeds}")
    print(json.dumps({"base": base, "minutes": args.minutes, "seeds": args.seeds, "eval_prompts": args.eval_prompts,
                      "methods": table}))


if __name__ == "__main__":
    main()
