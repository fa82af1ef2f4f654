"""Benchmark a shapes-world model or checkpoint on the fixed held-out prompt set (ODE sampling, fixed seeds).

    python scripts/bench_shapes.py runs/shapes_grpo/checkpoints/iter-000060/policy
    python scripts/bench_shapes.py tasks/assets/shapes-base --quick

Prints overall and per-category strict / partial accuracy; the last line is one JSON object.
The prompts are `tasks.shapes.balanced_prompts("heldout", n, seed=1234)`: texts that GRPO never trains on,
categories equally represented.
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", help="policy checkpoint folders (…/policy) or model folders")
    p.add_argument("--n", type=int, default=504, help="held-out prompts (default 504 = 84 per category)")
    p.add_argument("--quick", action="store_true", help="60 prompts")
    p.add_argument("--steps", type=int, default=16, help="ODE steps (benchmark protocol: 16)")
    p.add_argument("--cfg", type=float, default=1.0, help="CFG scale (benchmark protocol: 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmrl.policy.flow import load_policy_checkpoint
    from tasks import shapes
    from tasks.shapes_eval import evaluate

    n = 60 if args.quick else args.n
    prompts = shapes.balanced_prompts("heldout", n, seed=1234)
    results = {}
    for ck in args.checkpoints:
        t0 = time.time()
        res = evaluate(load_policy_checkpoint(ck), prompts, seed=args.seed, num_steps=args.steps, cfg_scale=args.cfg)
        res["seconds"] = round(time.time() - t0, 1)
        results[ck] = res
        cats = " ".join(f"{c}={d['strict']:.3f}" for c, d in res["per_category"].items())
        print(f"{ck}: strict {res['strict']:.4f} partial {res['partial']:.4f} (n={res['n']}) | {cats}")
    print(json.dumps({"n_prompts": n, "distinct_texts": len({p.text for p in prompts}), "results": results}))


if __name__ == "__main__":
    main()
