"""`mmrl eval CONFIG CHECKPOINT... [key=value ...]`: score models on the config's held-out benchmark.

The task of the config gives the held-out examples (`task.eval_examples()`), its reward (`reward.eval_name`,
else `reward.name`) scores them, and each policy generates deterministically (`policy.evaluate`: ODE samples
for generators, greedy answers for token policies; example i uses seed `--seed + i`, by default the trainer's
evaluation seed, so `mmrl eval` reproduces the eval/ figures of a run). The base model of the
config (`model.path`) is scored first, then every CHECKPOINT, then the task's own baselines (e.g. the blind
constant answer for grounding). A CHECKPOINT is a run folder (runs/NAME: its newest checkpoint), a trainer
checkpoint (runs/NAME/checkpoints/iter-N), its policy/ folder, or a model folder (then it replaces model.path).

Prints a table (one row per model; the reward's keys as columns, then per category) and one JSON object on
the last line: {"task", "n", "seed", "draws", "results": {name: {key: mean, ..., "per_category": {...}}}}.

One evaluation of a generator is one noise draw per example: a checkpoint's figure moves between draws by more
than its standard error over examples suggests (shapes: up to 5 points of strict accuracy between noise seeds).
`--draws K` scores each model under seeds SEED, SEED + 1, ... SEED + K - 1 and reports the mean, with each
draw's figure beside it ("draws" in the JSON, the last column of the table), so a peak or a turn can be told from
the draw. Without `--draws` the config's `log.eval_draws` is used, the draws the trainer's own evaluations take.
Token policies answer greedily: their draws are identical.
"""

from __future__ import annotations

import dataclasses
import json
import time

from mmrl import compose
from mmrl.config import sample_chunk
from mmrl.errors import UserError
from mmrl.evaluation import EVAL_SEED, NOT_METRICS, evaluate_outputs
from mmrl.reward import RewardRunner


def policy_folder(checkpoint: str) -> str | None:
    """The saved policy folder of a trainer checkpoint, a policy folder or a run folder (log.out_dir: its newest
    intact checkpoint); None for a plain model folder (mmrl.checkpoint.policy_folder: integrity, sharded state)."""
    from mmrl.checkpoint import policy_folder as resolve

    return resolve(checkpoint)


def evaluate_checkpoints(cfg, checkpoints: list[str], seed: int = EVAL_SEED, base: bool = True,
                         progress: bool = True, draws: int = 1) -> dict:
    """{name: metrics} for the base model, each checkpoint and the task's baselines (see the module docstring).
    draws > 1 scores each model under noise seeds seed, seed + 1, ... (mmrl.evaluation.evaluate_outputs)."""
    if draws < 1:
        raise UserError(f"--draws {draws}: score each model at least once (--draws 1 or more)")
    folders = [policy_folder(ck) for ck in checkpoints]  # a missing checkpoint fails before anything is loaded
    task = compose.build_task(cfg.task)
    name = cfg.reward.eval_name or cfg.reward.name
    kwargs = cfg.reward.eval_kwargs if cfg.reward.eval_name else cfg.reward.kwargs
    runner = RewardRunner(compose.build_reward(name, kwargs, "reward.eval"), "skip", sample_chunk(cfg.train))
    examples = task.eval_examples()
    results: dict[str, dict] = {}

    def score(label: str, policy) -> None:
        t0 = time.time()
        res = evaluate_outputs(policy.evaluate, examples, lambda o, e: runner(o, e)[0], seed=seed, progress=progress,
                               draws=draws)
        res["seconds"] = round(time.time() - t0, 1)
        results[label] = res

    policy = None
    if base:
        policy = compose.build_policy(cfg)
        score(f"base ({cfg.model.path})", policy)
    for ck, folder in zip(checkpoints, folders):
        if folder is None:  # a model folder: it is the model
            score(ck, compose.build_policy(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=ck))))
            continue
        if policy is None:
            policy = compose.build_policy(cfg)
        policy.load_trainable_state(folder)
        score(ck, policy)
    for label, res in (task.baselines() if hasattr(task, "baselines") else {}).items():
        results[label] = res
    return results


def format_table(results: dict[str, dict]) -> str:
    """One row per model: every metric key (reward keys), then the first key per category."""
    keys = [k for k in next(iter(results.values())) if k not in NOT_METRICS]
    keys += sorted({k for r in results.values() for k in r if k not in keys and k not in NOT_METRICS})
    cats = sorted({c for r in results.values() for c in r.get("per_category", {})})
    head = keys[0] if keys else "overall"
    per_draw = any("draws" in r for r in results.values())
    cols = keys + [f"{c}:{head}" for c in cats] + ["n"] + ([f"{head} per draw"] if per_draw else [])
    width = max(len(m) for m in results) + 2
    lines = ["model".ljust(width) + " ".join(c.rjust(max(8, len(c))) for c in cols)]
    for model, r in results.items():
        vals = [r.get(k) for k in keys] + [r.get("per_category", {}).get(c, {}).get(head) for c in cats] + [r.get("n")]
        vals += [r.get("draws", {}).get(head)] if per_draw else []
        lines.append(model.ljust(width) + " ".join(_fmt(v).rjust(max(8, len(c))) for c, v in zip(cols, vals)))
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4f}"
    return str(v) if not isinstance(v, list) else ",".join(f"{x:g}" for x in v)


def eval_main(args, cfg) -> int:
    """args: checkpoints, seed, no_base, draws (mmrl/cli.py); cfg: the loaded config."""
    draws = cfg.log.eval_draws if args.draws is None else args.draws
    results = evaluate_checkpoints(cfg, args.checkpoints, args.seed, not args.no_base, cfg.log.progress, draws)
    n = next((r["n"] for r in results.values() if "n" in r), 0)
    if getattr(args, "json", False):
        print(json.dumps({"task": cfg.task.name, "n": n, "seed": args.seed, "draws": draws, "results": results}))
    else:
        print(format_table(results))
    return 0
