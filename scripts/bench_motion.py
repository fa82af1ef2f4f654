"""Benchmark a motion-world model or checkpoint on held-out prompts (ODE sampling, fixed seeds).

    python scripts/bench_motion.py runs/motion_grpo/checkpoints/iter-000050/policy tasks/assets/motion-base
    python scripts/bench_motion.py tasks/assets/motion-base --quick

Prints motion accuracy (the tracker's `correct`: the object found in >= 75% of frames and moved >= 1/4 of the
frame in the asked direction) and the reward components overall and per direction; the last line is one JSON
object. The prompts are `tasks.motion.balanced_prompts("heldout", n, seed=1234)`: texts GRPO never trains on.
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
    p.add_argument("--n", type=int, default=256, help="held-out prompts (default 256 = 64 per direction)")
    p.add_argument("--quick", action="store_true", help="32 prompts")
    p.add_argument("--steps", type=int, default=16, help="ODE steps (benchmark protocol: 16)")
    p.add_argument("--cfg", type=float, default=1.0, help="CFG scale (benchmark protocol: 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmrl.policy.flow import load_policy_checkpoint
    from tasks import motion

    n = 32 if args.quick else args.n
    prompts = motion.balanced_prompts("heldout", n, seed=1234)
    results = {}
    for ck in args.checkpoints:
        t0 = time.time()
        res = motion.evaluate(load_policy_checkpoint(ck), prompts, seed=args.seed, num_steps=args.steps,
                              cfg_scale=args.cfg, progress=False)
        res["seconds"] = round(time.time() - t0, 1)
        results[ck] = res
        dirs = " ".join(f"{d}={r['correct']:.3f}" for d, r in res["per_category"].items())
        print(f"{ck}: motion accuracy {res['correct']:.4f} overall reward {res['overall']:.4f} (n={res['n']}) | {dirs}")
    print(json.dumps({"n_prompts": n, "distinct_texts": len({p.text for p in prompts}), "results": results}))


if __name__ == "__main__":
    main()
