"""Flow RL methods side by side at equal wall time on an embedded world (shapes, or motion with --world motion): for each seed, one training run per
method starts at the same moment (each `mmrl train CONFIG` in its own process, train.threads=1), all with the same
time budget and a held-out evaluation halfway and at the end (`log.eval_every_min`, which counts in the budget).

    python scripts/compare_flow_rl.py --minutes 16 --seeds 0 1 2           # grpo, nft, awm, flash; 504 prompts
    python scripts/compare_flow_rl.py --methods grpo flash_random awm_ema_kl  # random window; AWM + KL to its EMA
    python scripts/compare_flow_rl.py --quick              # 1 minute, 1 seed, grpo, nft and control, 24 prompts

Matched on iterations instead (`--iterations N`, independent of how loaded the machine is): every method runs N RL
iterations (no time budget) and is evaluated every `--eval-every-it` iterations, a fixed grid; the control runs
`--minutes` of pretraining (set it to the methods' expected wall time: the report prints every arm's measured wall
minutes beside it) and is evaluated at its `--eval-every-min` saves. The machine's load (1-minute load average,
sampled every 30 s while the runs go) and each arm's iterations and wall minutes are recorded with the results.

    python scripts/compare_flow_rl.py --iterations 200 --eval-every-it 20 --methods nft grpo control --seeds 0 1 2 \
        --minutes 40 --eval-every-min 8

The `control` arm is continued pretraining of the same base for the same minutes, launched with the seed's methods
(`scripts/pretrain_world.py --world shapes --init tasks/assets/shapes-base --threads 1`, the recipe that made the
base: lr 1e-3, batch 64, EMA 0.999, 500 warm-up steps, the lr cooled down linearly to 0 over the last 20 % of the
minutes). At the methods' evaluation minutes it saves (`--keep-saves` keeps every save) and evaluates itself on the
same held-out prompts (so it pays the same evaluation time); once every seed's runs are over, each save is scored
with exactly the methods' metric: the folder loaded and evaluated by the trainer's code (seed 10000, 16 ODE steps).

    python scripts/compare_flow_rl.py --methods nft grpo awm control --seeds 0 1 2 --minutes 16 --eval-every-min 4
    python scripts/compare_flow_rl.py --world motion --methods nft flash control --seeds 0 1 2 --minutes 16

On motion the control continues the recipe that made the motion base (`--coordinates`, lr 3e-4, batch 32, logit
mean 1.5, with the same cooldown), and the metric is motion accuracy (the reward's `correct`) on 256 held-out prompts.

Prints a table of the held-out metric (shapes: strict accuracy) (mean over seeds, and per seed) at half and full time, the base's
accuracy, and the gains; with a control, the control's row and the best method (highest mean at full time) minus
the control, per seed and in the mean with its standard error over seeds; with evaluations more often than at half
time, every run's curve. The last line is one JSON object. Gains are over the base at the trainer's eval seed.
"""

import argparse
import glob
import json
import math
import os
import statistics
import shutil
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class World:
    """An embedded world's arms: method -> (config, overrides); its committed base; the control's pretraining recipe
    (the flags that made the base); the held-out metric (the reward's key); the default number of held-out prompts."""
    methods: dict
    base: str
    pretrain: tuple
    metric: str
    eval_prompts: int


WORLDS = {
    "shapes": World(
        methods={"grpo": ("configs/t2i/shapes_grpo.yaml", []), "nft": ("configs/t2i/shapes_nft.yaml", []),
                 "nft_no_kl": ("configs/t2i/shapes_nft.yaml", ["algo.kl_coef=0"]),  # before issue 46's fix
                 "awm": ("configs/t2i/shapes_awm.yaml", []), "flash": ("configs/t2i/shapes_mixgrpo_flash.yaml", []),
                 "dgpo": ("configs/t2i/shapes_dgpo.yaml", []),
                 "flow_dppo": ("configs/t2i/shapes_flow_dppo.yaml", []),
                 "flash_random": ("configs/t2i/shapes_mixgrpo_flash.yaml", ["sampler.window_schedule=random"]),
                 "awm_ema_kl": ("configs/t2i/shapes_awm.yaml", ["algo.kl_coef=0.1", "algo.kl=flow_velocity",
                                                                 "algo.kl_reference=ema", "train.ema_decay=0.9"]),
                 "awm_anchored": ("configs/t2i/shapes_awm_anchored.yaml", [])},
        base="tasks/assets/shapes-base", pretrain=("--lr", "1e-3", "--batch", "64"), metric="strict", eval_prompts=504),
    "motion": World(
        methods={"grpo": ("configs/t2v/motion_grpo.yaml", []), "grpo_ema": ("configs/t2v/motion_grpo_ema.yaml", []),
                 "nft": ("configs/t2v/motion_nft.yaml", []),
                 "flash": ("configs/t2v/motion_mixgrpo_flash.yaml", [])},
        base="tasks/assets/motion-base", metric="correct", eval_prompts=256,
        pretrain=("--coordinates", "--lr", "3e-4", "--batch", "32", "--logit-mean", "1.5")),
}
CONTROL = "control"  # continued pretraining of the base (not a method: reported as the baseline)


def launch(world: World, method: str, seed: int, minutes: float, out: str, extra: list[str],
           eval_every: float, iterations: int = 0, eval_every_it: int = 0) -> subprocess.Popen:
    if iterations:  # matched on iterations: a fixed evaluation grid, no clock
        budget = ["train.time_budget_min=0", f"train.iterations={iterations}", "log.eval_every_min=0",
                  f"log.eval_every={eval_every_it}"]
    else:  # matched on wall time: only the timed evaluations, as the control's (every arm pays the same)
        budget = [f"train.time_budget_min={minutes}", f"log.eval_every_min={eval_every}", "train.iterations=100000",
                  "log.eval_every=0"]
    items = [f"train.seed={seed}", *budget, "train.threads=1", "log.eval_at_start=false", "log.progress=false",
             f"log.out_dir={out}", "log.image_every=0", *extra]
    log = open(os.path.join(out + ".log"), "w")
    config, overrides = world.methods[method]
    return subprocess.Popen([sys.executable, "-m", "mmrl.cli", "train", config, "--overwrite", *overrides, *items], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def launch_control(world: World, name: str, seed: int, minutes: float, out: str, eval_every: float,
                   eval_prompts: int, quick: bool = False) -> subprocess.Popen:
    """Continued pretraining of the base (the pretraining recipe with its cooldown), saved at the methods' evaluation
    minutes; its own evaluation runs on as many held-out prompts as theirs, so it pays the same time for it."""
    for old in glob.glob(out + ".step*"):  # a previous run's saves in this folder
        shutil.rmtree(old)
    for old in (out + ".log.jsonl", out + ".train_state.pt", out + ".scores.json"):
        if os.path.exists(old):
            os.remove(old)
    recipe = [*world.pretrain, *(["--batch", "16"] if quick else [])]  # the last --batch wins
    cmd = [sys.executable, "scripts/pretrain_world.py", "--world", name, "--init", world.base, "--minutes", str(minutes),
           "--threads", "1", "--seed", str(seed), "--cooldown", "0.2", *recipe,
           "--eval-every", str(eval_every), "--eval-n", str(eval_prompts), "--keep-saves", "--out", out]
    log = open(out + ".log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def held_out_accuracy(world: World, eval_prompts: int, model_path: str) -> float:
    """A saved model folder scored exactly as every run's trainer evaluation: the world's first method's config with
    model.path=model_path, its held-out prompts, noise seed 10000, its ODE steps; the world's metric."""
    from mmrl.compose import build_policy, build_reward, build_task, load_config
    from mmrl.evaluation import evaluate_outputs

    config = next(iter(world.methods.values()))[0]
    cfg = load_config(os.path.join(ROOT, config), [f"task.eval_prompts={eval_prompts}", "log.progress=false",
                                                   f"model.path={model_path}"])
    reward = build_reward(cfg.reward.name, cfg.reward.kwargs)
    res = evaluate_outputs(build_policy(cfg).evaluate, build_task(cfg.task).eval_examples(),
                           lambda o, e: reward(o, e), seed=10_000, progress=False)
    return res[world.metric]


def method_run(world: World, out: str, minutes: float, iterations: int = 0) -> dict:
    """A trainer run's figures: the timed evaluations and the end (at the budget's minutes); matched on iterations,
    the evaluations of the grid (metrics.jsonl's eval/* lines) at their iterations, and the run's wall minutes."""
    res = json.load(open(os.path.join(out, "results.json")))
    if iterations:
        evals, first, last = {}, None, None
        with open(os.path.join(out, "metrics.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                first = rec["time"] if first is None else first
                last = rec["time"]
                if f"eval/{world.metric}" in rec:
                    evals[rec["step"]] = rec[f"eval/{world.metric}"]
        evals[res["iterations"]] = res["eval_end"][world.metric]
        return {"curve": sorted(evals.items()), "iterations": res["iterations"],
                "wall_min": round((last - first) / 60, 2)}
    curve = ([(e["minutes"], e[world.metric]) for e in res["eval_timed"]]
             + [(minutes, res["eval_end"][world.metric])])
    return {"curve": curve, "iterations": res["iterations"]}


class LoadMonitor:
    """The machine's 1-minute load average, sampled every `every` seconds in a thread while runs go."""

    def __init__(self, every: float = 30.0):
        import threading

        self.samples, self.stop = [], threading.Event()
        self.thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self.thread.start()

    def _run(self, every: float) -> None:
        while not self.stop.wait(every if self.samples else 0):
            self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict:
        self.stop.set()
        xs = sorted(self.samples) or [float("nan")]
        return {"load_min": xs[0], "load_median": xs[len(xs) // 2], "load_max": xs[-1], "load_samples": len(self.samples)}


def control_run(world: World, out: str, eval_prompts: int, rescore: str = "all") -> dict:
    """The control's kept saves, at the save's minutes; "iterations" are its optimizer steps. rescore: which saves
    are scored afterwards from their folders by the trainer's evaluation code, the methods' metric ("all", "last",
    "none"); the table uses that figure where there is one, else the control's own evaluation (the same prompts,
    noise seeds and steps, but of the in-memory model, which does not give the same samples as the saved folder
    loaded as the trainer loads it: `rescore_minus_own` lists the differences)."""
    saves = sorted(glob.glob(out + ".step*"))
    if not saves:
        raise RuntimeError(f"the control {out} kept no save; see {out}.log")
    own = {}
    with open(out + ".log.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            own[rec["step"]] = rec[world.metric]
    cache_path = out + ".scores.json"  # {save folder name: metric} of saves scored before (--score-only)
    cache = json.load(open(cache_path)) if os.path.exists(cache_path) else {}
    curve, checks = [], []
    for k, path in enumerate(saves):
        info = json.load(open(os.path.join(path, "pretrain_info.json")))
        acc = own.get(info["step"])
        if rescore == "all" or (rescore == "last" and k == len(saves) - 1) or acc is None:
            name = f"{os.path.basename(path)}@{eval_prompts}"
            if name not in cache:
                cache[name] = held_out_accuracy(world, eval_prompts, path)
                with open(cache_path, "w") as f:
                    json.dump(cache, f, indent=1)
            if acc is not None:
                checks.append(round(cache[name] - acc, 4))
            acc = cache[name]
        curve.append((info["minutes"], acc))
    return {"curve": curve, "iterations": info["step"], "rescore_minus_own": checks}


def summarize(run: dict, minutes: float) -> dict:
    """half: the first evaluation at or after half the budget (the trainer's timed one; matched on iterations: half
    the iterations), full: the last; peak: the best evaluation and where it was (minutes, or iteration)."""
    curve, span = run["curve"], (run["iterations"] if "wall_min" in run else minutes)
    half = next(((m, a) for m, a in curve[:-1] if m >= span / 2 * 0.999), None)
    peak = max(curve, key=lambda ma: ma[1])
    return {"half": half[1] if half else None, "half_at": half[0] if half else None, "full": curve[-1][1],
            "peak": peak[1], "peak_at": peak[0], "iterations": run["iterations"],
            "curve": [[round(m, 2), a] for m, a in curve],
            **{k: run[k] for k in ("rescore_minus_own", "wall_min") if k in run}}


def mean_se(xs: list[float]) -> tuple[float, float | None]:
    return statistics.mean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", default="shapes", choices=list(WORLDS))
    ap.add_argument("--methods", nargs="+", default=None,  # the world's grpo, nft, awm, flash
                    choices=sorted({m for w in WORLDS.values() for m in w.methods} | {CONTROL}),
                    help=f"'{CONTROL}': continued pretraining of the base, the baseline every method is compared to")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, default=16.0, help="wall-time budget of every run (with --iterations: "
                    "of the control only)")
    ap.add_argument("--iterations", type=int, default=0,
                    help="match the methods on iterations: each runs this many, evaluated every --eval-every-it")
    ap.add_argument("--eval-every-it", type=int, default=20, help="with --iterations: the evaluation grid's step")
    ap.add_argument("--eval-every-min", type=float, default=None,
                    help="evaluate every run this often (default: half of --minutes, i.e. at half time and the end)")
    ap.add_argument("--eval-prompts", type=int, default=None, help="default: shapes 504, motion 256")
    ap.add_argument("--out", default="runs/compare_flow_rl")
    ap.add_argument("--quick", action="store_true", help="1 minute, seed 0, grpo, nft and the control, 24 held-out prompts")
    ap.add_argument("--parallel-seeds", action="store_true",
                    help="start every seed's runs at once (default: the seeds one after another)")
    ap.add_argument("--score-only", action="store_true",
                    help="only score the finished control saves of --seeds in --out (1 thread; cached for the report), "
                    "e.g. one seed's while the next seed's runs go on")
    ap.add_argument("--report-only", action="store_true",
                    help="launch nothing: score and tabulate the finished runs already in --out")
    args = ap.parse_args()
    world = WORLDS[args.world]
    args.methods = args.methods or [m for m in ("grpo", "nft", "awm", "flash") if m in world.methods]
    args.eval_prompts = args.eval_prompts or world.eval_prompts
    if args.quick:  # --methods given with --quick are kept
        args.minutes, args.seeds, args.eval_prompts = 1.0, [0], 24
        args.methods = args.methods if "--methods" in sys.argv else ["grpo", "nft", CONTROL]
        args.eval_every_min = None
    unknown = [m for m in args.methods if m != CONTROL and m not in world.methods]
    if unknown:
        ap.error(f"{args.world} has no method {unknown}; choose from {sorted(world.methods)} or {CONTROL}")
    eval_every = args.eval_every_min or args.minutes / 2
    extra = [f"task.eval_prompts={args.eval_prompts}"] + (["train.prompts_per_iter=4", "train.group_size=4"]
                                                          if args.quick else [])
    os.makedirs(args.out, exist_ok=True)
    if args.score_only:
        import torch

        torch.set_num_threads(1)
        for seed in args.seeds:
            run = control_run(world, os.path.join(args.out, f"{CONTROL}_s{seed}"), args.eval_prompts)
            print(json.dumps({"seed": seed, **run}), flush=True)
        return
    batches = [args.seeds] if args.parallel_seeds else [[seed] for seed in args.seeds]
    for seeds in ([] if args.report_only else batches):  # a seed's runs start together and share the machine
        procs = {(m, seed): (launch_control(world, args.world, seed, args.minutes, os.path.join(args.out, f"{m}_s{seed}"),
                                            eval_every, args.eval_prompts, args.quick) if m == CONTROL else
                             launch(world, m, seed, args.minutes, os.path.join(args.out, f"{m}_s{seed}"), extra,
                                    eval_every, args.iterations, args.eval_every_it))
                 for seed in seeds for m in args.methods}
        monitor = LoadMonitor()
        for (m, seed), p in procs.items():
            if p.wait() != 0:  # reported as failed; the other runs go on
                print(f"{m} seed {seed} failed; see {os.path.join(args.out, f'{m}_s{seed}.log')}", file=sys.stderr)
        load = monitor.summary()
        for seed in seeds:  # kept beside the runs, for the report
            with open(os.path.join(args.out, f"load_s{seed}.json"), "w") as f:
                json.dump(load, f)
        print(f"seeds {seeds} done; load {load}", file=sys.stderr, flush=True)
    runs = {}  # the control's saves are scored once every seed's runs are over: nothing else loads the machine then
    for seed in args.seeds:
        for m in args.methods:
            out = os.path.join(args.out, f"{m}_s{seed}")
            try:
                run = (control_run(world, out, args.eval_prompts) if m == CONTROL
                       else method_run(world, out, args.minutes, args.iterations))
            except (OSError, RuntimeError, KeyError, IndexError) as e:  # no results: a failed run
                print(f"{m} seed {seed}: no results ({e}); reported as failed", file=sys.stderr)
                runs[(m, seed)] = None
                continue
            runs[(m, seed)] = summarize(run, args.minutes)
    report(world, runs, args, eval_every)
    if any(r is None for r in runs.values()):
        sys.exit(1)


def report(world: World, runs: dict, args, eval_every: float) -> None:
    base = held_out_accuracy(world, args.eval_prompts, world.base)
    table = {}
    fmt = lambda v: f"{100 * v:8.2f}" if v is not None else f"{'-':>8s}"  # noqa: E731
    print(f"{args.world}: base {100 * base:.2f}% {world.metric} on {args.eval_prompts} held-out prompts; "
          f"{args.minutes} min per run")
    unit = "iterations" if args.iterations else "min"
    print(f"{'method':12s} {'half':>8s} {'full':>8s} {'gain half':>10s} {'gain full':>10s}  per seed (half / full, iterations)"
          f"  [half / full in {unit}]")
    for m in args.methods:
        rs = [runs[(m, s)] for s in args.seeds if runs[(m, s)] is not None]
        if not rs:
            print(f"{m:12s} failed on every seed")
            continue
        half = [r["half"] for r in rs if r["half"] is not None]
        row = {"half": statistics.mean(half) if half else None, "full": statistics.mean(r["full"] for r in rs),
               "full_se": mean_se([r["full"] for r in rs])[1], "per_seed": [runs[(m, s)] for s in args.seeds]}
        row["gain_half"] = row["half"] - base if half else None
        row["gain_full"] = row["full"] - base
        table[m] = row
        seeds = "  ".join("failed" if r is None else f"{fmt(r['half']).strip()}/{100 * r['full']:.2f} ({r['iterations']})"
                          for r in (runs[(m, s)] for s in args.seeds))
        print(f"{m:12s} {fmt(row['half'])} {fmt(row['full'])} {fmt(row['gain_half']):>10s} {fmt(row['gain_full']):>10s}  "
              f"{seeds}" + ("  <- pretraining steps" if m == CONTROL else ""))
    if any(r is not None and len(r["curve"]) > 2 for r in runs.values()):
        print(f"curves, {world.metric} % at {unit} (mean over seeds at each evaluation; per seed):")
        for m in table:
            rs = [runs[(m, s)] for s in args.seeds if runs[(m, s)] is not None]
            n = min(len(r["curve"]) for r in rs)
            at = [(statistics.mean(r["curve"][i][0] for r in rs), statistics.mean(r["curve"][i][1] for r in rs))
                  for i in range(n)]
            mean = "  ".join(f"{minutes:.1f}{unit[0]} {100 * acc:.2f}" for minutes, acc in at)
            print(f"  {m:12s} {mean}   | " + " | ".join(" ".join(f"{100 * a:.2f}" for _, a in r["curve"]) for r in rs))
    loads = {s: json.load(open(p)) for s in args.seeds
             if os.path.exists(p := os.path.join(args.out, f"load_s{s}.json"))}
    if loads:
        print("machine load (1-min average) per seed: " + "; ".join(
            f"seed {s} median {v['load_median']:.1f} (min {v['load_min']:.1f}, max {v['load_max']:.1f})"
            for s, v in loads.items()))
    if args.iterations:
        print(f"peaks (mean over seeds of each run's best, and where; value at {args.iterations}; wall minutes):")
        for m, row in table.items():
            rs = [r for r in row["per_seed"] if r is not None]
            peak, peak_se = mean_se([r["peak"] for r in rs])
            print(f"  {m:12s} peak {100 * peak:.2f}" + (f" (s.e. {100 * peak_se:.2f})" if peak_se else "")
                  + f" at {[r['peak_at'] for r in rs]}, at the end {100 * row['full']:.2f}"
                  + (f" (s.e. {100 * row['full_se']:.2f})" if row["full_se"] else "")
                  + f", wall min {[r.get('wall_min') for r in rs]}")
            row["peak"], row["peak_se"] = peak, peak_se
    out = {"world": args.world, "metric": world.metric, "base": base, "minutes": args.minutes,
           "iterations": args.iterations, "eval_every": args.eval_every_it if args.iterations else eval_every,
           "seeds": args.seeds, "load": loads,
           "eval_prompts": args.eval_prompts, "methods": {m: r for m, r in table.items() if m != CONTROL},
           "failed": [f"{m}_s{s}" for (m, s), r in runs.items() if r is None]}
    if CONTROL in table:
        out["control"] = table[CONTROL]
        methods = [m for m in table if m != CONTROL]
        if methods:
            best = max(methods, key=lambda m: table[m]["full"])
            gap = {}
            for key in ("half", "full"):
                per = [runs[(best, s)][key] - runs[(CONTROL, s)][key] for s in args.seeds
                       if runs[(best, s)] and runs[(CONTROL, s)] and runs[(best, s)][key] is not None
                       and runs[(CONTROL, s)][key] is not None]
                mean, se = mean_se(per) if per else (None, None)
                gap[key] = {"mean": mean, "se": se, "per_seed": per}
            out["best_minus_control"] = {"method": best, **gap}
            se = gap["full"]["se"]
            print(f"best method {best} minus the control at {args.minutes:g} min: {100 * gap['full']['mean']:+.2f} points"
                  + (f" (s.e. {100 * se:.2f})" if se is not None else "") + ", per seed "
                  + " ".join(f"{100 * d:+.2f}" for d in gap["full"]["per_seed"])
                  + (f"; at half time {100 * gap['half']['mean']:+.2f}" if gap["half"]["mean"] is not None else ""))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
