"""Benchmark a motion-world model or checkpoint on held-out prompts (ODE sampling, fixed seeds).

    python scripts/bench_motion.py runs/motion_grpo/checkpoints/iter-000050/policy tasks/assets/motion-base
    python scripts/bench_motion.py tasks/assets/motion-base --quick

Prints motion accuracy (the tracker's `correct`: the object found in >= 75% of frames and moved >= 1/4 of the
frame in the asked direction), the mean displacement along the asked direction (0 when the direction word does
not steer the motion, 0.5 on rendered clips) and the reward components overall and per direction; the last line is
one JSON object. The prompts are `tasks.motion.balanced_prompts("heldout", n, seed=1234)`: texts GRPO never trains on.
"""

from mmrl.evaluation import flow_bench_main


def describe(res: dict) -> str:
    dirs = " ".join(f"{d}={r['correct']:.3f}" for d, r in res["per_category"].items())
    return (f"motion accuracy {res['correct']:.4f} overall reward {res['overall']:.4f} displacement along the asked "
            f"direction {res['along']:+.3f} of the frame (n={res['n']}) | {dirs}")


def main(argv=None):
    from functools import partial

    from rewards.motion import evaluate
    from tasks import motion

    flow_bench_main(argv, __doc__, 256, 32, motion.balanced_prompts, partial(evaluate, progress=False), describe)


if __name__ == "__main__":
    main()
