"""Benchmark evaluation shared by the trainer and the scripts: generate deterministically, score with the
task's reward, average every reward key overall and per example category."""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from typing import Callable

import torch
from tqdm import tqdm

from mmrl.metrics import Pulse

EVAL_BATCH = 64  # prompts per held-out evaluation batch (the trainer's, mmrl eval's and mmrl sample's)

log = logging.getLogger(__name__)

EVAL_SEED = 10_000  # held-out example i is generated with seed EVAL_SEED + i (trainer and `mmrl eval` alike)
PROGRESS_S = 5.0  # without a bar (a log file), a progress line at least this often (the first one at once)
NOT_METRICS = ("per_category", "n", "se", "scores", "seconds", "draws")  # result keys that are not a reward key's mean


@torch.no_grad()
def evaluate_outputs(generate: Callable[[list[dict], int], object], examples: list[dict], reward: Callable,
                     seed: int = 0, batch_size: int = EVAL_BATCH, progress: bool | None = True, dist=None,
                     draws: int = 1) -> dict:
    """generate(examples_chunk, first_seed) -> outputs; example i uses seed `seed + i` (batch-size invariant).
    batch_size examples are generated and scored per call (the policy's own micro-batching applies within).

    dist (mmrl.parallel.distributed.Distributed): with several processes each rank evaluates a contiguous share of the
    examples and the scores are gathered, so every rank returns the single-process figures. Shares are padded
    to one length (the padding is scored and dropped), so every rank runs the same forwards (FSDP all-gathers).

    progress: True a tqdm bar; False a log line `evaluating: 120/504` at once and at least every PROGRESS_S
    seconds (a log file stays alive through a long evaluation); None nothing (the other ranks).

    Returns {key: mean, ..., "n": int, "se": {key: standard error of the mean over examples}, "scores": {key:
    [per-example value, in example order]}, "per_category": {cat: {key: mean, ..., "n": int}}} for every key the
    reward returns ("overall", "strict", ...); categories come from example["category"] when present. "scores"
    lets two evaluations of the same examples and seeds be compared pair by pair (mmrl/report.py: the verdict).

    draws > 1 evaluates the examples again under seeds seed + 1, ... seed + draws - 1 (other noise draws of a
    generator): each example's value is its mean over draws, and "draws" {key: [each draw's mean]} is added.
    """
    world = dist.data_world if dist is not None else 1  # the ranks of a cp group evaluate the same share
    share = dist.share(len(examples)) if world > 1 else range(len(examples))
    width = -(-len(examples) // world)
    mine = list(share) + [share.stop - 1 if len(share) else 0] * (width - len(share))   # example indices
    runs = []  # per draw: [(example index, {key: value})] in example order
    for draw in range(draws):
        scores = []  # (example index, {key: value}) of this rank's real examples
        with Heartbeat(len(examples), world, enabled=progress is False) as beat:
            for i in tqdm(range(0, len(mine), batch_size), desc="eval", disable=not progress):
                idx = mine[i:i + batch_size]
                chunk = [examples[j] for j in idx]
                r = reward(generate(chunk, seed + draw + idx[0]), chunk)
                scores += [(j, {k: float(v[c]) for k, v in r.items()}) for c, j in enumerate(idx) if i + c < len(share)]
                beat.done = i + len(idx)
        runs.append(sorted(dist.gather_list(scores) if world > 1 else scores, key=lambda x: x[0]))
    scores = [(j, {k: sum(run[e][1][k] for run in runs) / draws for k in r}) for e, (j, r) in enumerate(runs[0])]
    sums: dict = defaultdict(lambda: defaultdict(float))
    for j, r in scores:  # in example order
        for cat in ("all", examples[j].get("category")):
            if cat is None:
                continue
            sums[cat]["n"] += 1
            for k, v in r.items():
                sums[cat][k] += v

    def means(d):
        return {k: (round(v / d["n"], 4) if k != "n" else int(v)) for k, v in d.items()}

    out = means(sums.pop("all")) if "all" in sums else {"n": 0}
    per = defaultdict(list)  # key -> [value of example 0, 1, ...]
    for _, r in scores:
        for k, v in r.items():
            per[k].append(round(v, 4))
    out["se"] = {k: round(standard_error(v), 4) for k, v in per.items()}
    out["scores"] = dict(per)
    out["per_category"] = {c: means(d) for c, d in sums.items()}
    if draws > 1:
        out["draws"] = {k: [round(sum(r[k] for _, r in run) / len(run), 4) for run in runs] for k in per}
    return out


class Heartbeat(Pulse):
    """`evaluating: done/total (s)` through logging at once and every PROGRESS_S seconds (a Pulse), so a batch that
    takes minutes still shows a pulse in a log file; `done` counts this rank's examples (x world)."""

    def __init__(self, total: int, world: int = 1, enabled: bool = True):
        super().__init__(self.line, PROGRESS_S, enabled)
        self.total, self.world, self.done, self.t0 = total, world, 0, time.monotonic()

    def line(self) -> None:
        log.info("evaluating: %d/%d (%.0f s)", min(self.done * self.world, self.total), self.total,
                 time.monotonic() - self.t0)

    def __enter__(self):
        if self.enabled:
            self.line()
        return super().__enter__()


def standard_error(xs: list[float]) -> float:
    """The standard error of the mean of xs: sample standard deviation / sqrt(n); 0 for fewer than 2 values."""
    n = len(xs)
    if n < 2:
        return 0.0
    m = sum(xs) / n
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def evaluate_generator(model, examples: list[dict], reward: Callable, seed: int = 0, num_steps: int = 16,
                       cfg_scale: float = 1.0, batch_size: int = EVAL_BATCH, progress: bool = True) -> dict:
    """evaluate_outputs of a FlowModel's ODE samples (`model.generate`): example i uses noise seed seed + i."""

    def generate(chunk, first_seed):
        return model.generate([ex["prompt"] for ex in chunk], [first_seed + j for j in range(len(chunk))],
                              num_steps, cfg_scale)

    return evaluate_outputs(generate, examples, reward, seed, batch_size, progress)


def flow_bench_main(argv, doc: str, default_n: int, quick_n: int, balanced_prompts: Callable, evaluate: Callable,
                    describe: Callable[[dict], str]) -> None:
    """The command line of an embedded flow world's benchmark script (scripts/bench_shapes.py, bench_motion.py):
    every checkpoint scored on `balanced_prompts("heldout", n, seed=1234)` by `evaluate(model, prompts, seed=,
    num_steps=, cfg_scale=)`, one `describe(result)` line each, then one JSON object on the last line."""
    import argparse
    import json
    import time

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="+", help="policy checkpoint folders (…/policy) or model folders")
    p.add_argument("--n", type=int, default=default_n, help=f"held-out prompts (default {default_n})")
    p.add_argument("--quick", action="store_true", help=f"{quick_n} prompts")
    p.add_argument("--steps", type=int, default=16, help="ODE steps (benchmark protocol: 16)")
    p.add_argument("--cfg", type=float, default=1.0, help="CFG scale (benchmark protocol: 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmrl.policy.flow import load_policy_checkpoint

    n = quick_n if args.quick else args.n
    prompts = balanced_prompts("heldout", n, seed=1234)
    results = {}
    for ck in args.checkpoints:
        t0 = time.time()
        res = evaluate(load_policy_checkpoint(ck), prompts, seed=args.seed, num_steps=args.steps, cfg_scale=args.cfg)
        res["seconds"] = round(time.time() - t0, 1)
        results[ck] = res
        print(f"{ck}: {describe(res)}", flush=True)
    print(json.dumps({"n_prompts": n, "distinct_texts": len({p.text for p in prompts}), "results": results}))
