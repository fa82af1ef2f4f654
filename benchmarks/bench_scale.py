"""Weak scaling of a training iteration on CPU: 1 process vs 2 processes (torchrun, train.parallel=ddp, 1 thread
each), the 2-process run with twice the prompts per iteration (the same rows per rank), for three rollout kinds on
a pixel SD3 flow model built here (mmrl/models/pixel_t2i.py, no hub):

- chain: Flow-GRPO (an SDE chain per image, every step trained);
- tree: BranchGRPO (tree.split_steps=[1,2], tree.branch=2: 4 leaves per prompt, algo.loss_agg=token_mean);
- nft: DiffusionNFT (algo.objective.name=nft, sampler.kind=ode).

    python benchmarks/bench_scale.py                 # small transformer, 8 steps, 2 prompts x 4 per rank, 3 iterations
    python benchmarks/bench_scale.py --quick         # tiny transformer, 4 steps, 1 prompt x 4 per rank, 1 iteration

Each arm is one launch of benchmarks/_scale_worker.py running every kind (full `Trainer.step`s: rollout, reward,
gathers, advantages, training with DDP's all-reduce). Iteration time: the median over the measured iterations
(after warm-up ones) of the slowest rank's wall time. Rows per rank: transformer rows one rank runs per iteration,
in sampling (no grad; classifier-free guidance doubles them) and in training (forward + backward). Weak-scaling
efficiency = t_1 / t_2 (1.0: a second process adds its rows for free). On a machine with as many cores as
processes, the two processes also share memory bandwidth and caches, and anything else running competes for the
cores: the load average is recorded around each arm. The last line is one JSON object.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks/_scale_worker.py")


def build_model(path: str, size: str, sample_size: int) -> None:
    """A random-init pixel model folder with the shapes world's vocabulary (as tests/conftest.py's tiny model)."""
    import torch

    from mmrl.models.pixel_t2i import build_pipeline_parts, save_pipeline_parts
    from tasks import shapes

    torch.manual_seed(0)
    words = sorted({w for p in shapes.all_prompts() for w in p.text.split()})
    save_pipeline_parts(build_pipeline_parts(words, size, sample_size), path)


def run_arm(procs: int, model: str, out: str, prompts: int, worker_args: list[str]) -> dict:
    """One launch on `procs` processes; returns {kind: per-rank lists of iterations} and the load averages."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
        if procs > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    load_before = os.getloadavg()[0]
    r = subprocess.run([*launch, WORKER, model, out, "--parallel", "ddp" if procs > 1 else "none",
                        "--prompts", str(prompts), *worker_args], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{procs}-process arm failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    ranks = [json.load(open(os.path.join(out, f"rank{i}.json"))) for i in range(procs)]
    kinds = {k: [rk["kinds"][k] for rk in ranks] for k in ranks[0]["kinds"]}
    return {"kinds": kinds, "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}


def summarize(per_rank: list[list[dict]]) -> dict:
    """per_rank[r][i]: rank r's measured iteration i. Times: median over iterations of the slowest rank; rows: the
    busiest rank's median."""
    def slowest(key):
        return statistics.median(max(rk[i][key] for rk in per_rank) for i in range(len(per_rank[0])))

    def rows(key):
        return max(statistics.median(it[key] for it in rk) for rk in per_rank)

    return {"iter_s": round(slowest("wall"), 4), "rollout_s": round(slowest("rollout"), 4),
            "train_s": round(slowest("train"), 4), "sample_rows_per_rank": rows("sample_rows"),
            "train_rows_per_rank": rows("train_rows")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny transformer, 4 steps, 1 prompt per rank, 1 iteration")
    p.add_argument("--size", default="small", choices=["tiny", "small"], help="transformer size (pixel_t2i sizes)")
    p.add_argument("--sample-size", type=int, default=36, help="image side in pixels")
    p.add_argument("--model", default=None, help="an existing pixel model folder (skips building one)")
    p.add_argument("--prompts", type=int, default=2, help="prompts (groups) per rank per iteration")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="sampler steps")
    p.add_argument("--iters", type=int, default=3, help="measured iterations per kind and arm")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured iterations first")
    p.add_argument("--kinds", default="chain,tree,nft")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.sample_size, args.steps, args.prompts, args.iters = "tiny", 24, 4, 1, 1
    worker_args = ["--kinds", args.kinds, "--group-size", str(args.group_size), "--steps", str(args.steps),
                   "--iters", str(args.iters), "--warmup", str(args.warmup)]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or os.path.join(tmp, f"{args.size}-pixel")
        if not args.model:
            build_model(model, args.size, args.sample_size)
        arms = {n: run_arm(n, model, os.path.join(tmp, f"procs{n}"), n * args.prompts, worker_args) for n in (1, 2)}
    results = {}
    for kind in args.kinds.split(","):
        one, two = (summarize(arms[n]["kinds"][kind]) for n in (1, 2))
        results[kind] = {"procs1": one, "procs2": two, "efficiency": round(one["iter_s"] / two["iter_s"], 3),
                         "rollout_efficiency": round(one["rollout_s"] / two["rollout_s"], 3),
                         "train_efficiency": round(one["train_s"] / two["train_s"], 3)}
        for n, r in (("1 proc ", one), ("2 procs", two)):
            print(f"{kind:6s} {n}: iter {r['iter_s']:.3f}s (rollout {r['rollout_s']:.3f}s, train {r['train_s']:.3f}s) "
                  f"rows/rank sample {r['sample_rows_per_rank']} train {r['train_rows_per_rank']}", flush=True)
        print(f"{kind:6s} weak-scaling efficiency t1/t2 = {results[kind]['efficiency']:.3f} (rollout "
              f"{results[kind]['rollout_efficiency']:.3f}, train {results[kind]['train_efficiency']:.3f})", flush=True)
    cores = os.cpu_count()
    note = (f"{cores} CPU cores, 1 thread per process; load average (1 min) before/after: 1 process "
            f"{arms[1]['loadavg_1min']}, 2 processes {arms[2]['loadavg_1min']}. With only {cores} cores the 2-process "
            f"arm has no spare core and competes with anything else running: a floor, not a GPU-cluster estimate.")
    print(note)
    print(json.dumps({"size": args.size, "sample_size": args.sample_size, "steps": args.steps,
                      "group_size": args.group_size, "prompts_per_rank": args.prompts, "iters": args.iters,
                      "warmup": args.warmup, "cpu_cores": cores,
                      "loadavg_1min": {str(n): arms[n]["loadavg_1min"] for n in (1, 2)}, "note": note,
                      "results": results}))


if __name__ == "__main__":
    main()
