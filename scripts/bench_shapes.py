"""Benchmark a shapes-world model or checkpoint on the fixed held-out prompt set (ODE sampling, fixed seeds).

    python scripts/bench_shapes.py runs/shapes_grpo/checkpoints/iter-000060/policy
    python scripts/bench_shapes.py tasks/assets/shapes-base --quick

Prints overall and per-category strict / partial accuracy; the last line is one JSON object.
The prompts are `tasks.shapes.balanced_prompts("heldout", n, seed=1234)`: texts that GRPO never trains on,
categories equally represented.
"""

from mmrl.evaluation import flow_bench_main


def describe(res: dict) -> str:
    cats = " ".join(f"{c}={d['strict']:.3f}" for c, d in res["per_category"].items())
    return f"strict {res['strict']:.4f} partial {res['partial']:.4f} (n={res['n']}) | {cats}"


def main(argv=None):
    from rewards.shapes import evaluate
    from tasks import shapes

    flow_bench_main(argv, __doc__, 504, 60, shapes.balanced_prompts, evaluate, describe)


if __name__ == "__main__":
    main()
