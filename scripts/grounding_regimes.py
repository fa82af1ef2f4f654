"""The grounding regimes of the pre-registered protocol (docs/results.md, "Where RL should beat supervised training"):
for each seed, the arms of one comparison start at the same moment, side by side at 1 thread each (as
scripts/compare_flow_rl.py runs the flow methods), with the same wall-time budget; then every result is scored by one
`mmrl eval` on the fixed held-out splits of the OOD world (id, long, novel, crowded).

    A  scarce labels   per pool (256, 1,024 queries, pool seed 0): SFT on the pool, GRPO on the pool, SFT-then-GRPO
                       (half the budget each) on the pool
    B  noisy labels    30% of the training spans replaced (noise seed 0): SFT and GRPO on the same noisy spans
    C  reward only     GRPO with the one-bit reward, GRPO with the bucketed IoU (no span injection, no anchor), against
                       rejection-sampling fine-tuning (sft_grounding.py --rft) and DPO on own best / worst (--dpo)
    D  after plateau   SFT from the base until its held-out id mIoU (200 queries, every 2 min) has not risen for 3
                       evaluations (once, reused); the difficulty filter of that model (8 samples per training query,
                       kept when 0 < success rate < 1); then SFT against GRPO on the kept queries, both from it

    python scripts/grounding_regimes.py --regime A --seeds 0 1 2 --minutes 6        # the protocol (base: --base)
    python scripts/grounding_regimes.py --regime C --quick                          # tiny world and base, ~1-2 min
    python scripts/grounding_regimes.py --difficulty-filter MODEL --filter-out ids.json [--world W]

Prints a table (per arm, mean over seeds: mIoU / R1@0.5 / R1@0.7 per split, the OOD mean = mean mIoU of long, novel
and crowded, and the OOD mean per seed), the protocol's decision for each RL arm against the best equal-time
baseline of its comparison (wins when the mean paired OOD-mean difference is >= 0.03 and the difference minus one
standard error over the seeds is > 0), and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_CONFIG = "configs/grounding/ood_grpo.yaml"
CONFIGS = {"A": "configs/grounding/regime_a_grpo.yaml", "B": "configs/grounding/regime_b_grpo.yaml",
           "C_bit": "configs/grounding/regime_c_bit.yaml", "C_bucket": "configs/grounding/regime_c_bucket.yaml",
           "D": "configs/grounding/regime_d_grpo.yaml"}
SPLITS = ("id", "long", "novel", "crowded")
OOD = ("long", "novel", "crowded")
MARGIN = 0.03  # the protocol's margin on the OOD-mean mIoU
QUICK_WORLD = {"train": 12, "test": 3, "long": 3, "novel": 3, "crowded": 3}


# ------------------------------------------------------------------ the difficulty filter (regime D)
def success_rates(policy, examples: list[dict], samples: int = 8, threshold: float = 0.5, seed: int = 0,
                  chunk: int = 16) -> dict[str, float]:
    """{qid: share of `samples` completions (the policy's sampler) whose tIoU >= threshold}; a query the policy
    cannot read (a broken video, skipped by the policy) has no entry."""
    import torch

    from rewards.grounding import GroundingReward

    reward, gen, rates = GroundingReward(), torch.Generator().manual_seed(seed), {}
    for i in range(0, len(examples), chunk):
        part = examples[i:i + chunk]
        ro = policy.sample(part, samples, gen)
        ok = (reward(ro.outputs, ro.examples)["iou"] >= threshold).float()
        gid = torch.as_tensor(ro.group_id)
        for g in torch.unique(gid).tolist():
            rates[part[g]["qid"]] = float(ok[gid == g].mean())
    return rates


def difficulty_filter(policy, examples: list[dict], samples: int = 8, threshold: float = 0.5,
                      seed: int = 0) -> tuple[list[str], dict[str, float]]:
    """(ids of the queries the policy neither always nor never gets right, {qid: success rate})."""
    rates = success_rates(policy, examples, samples, threshold, seed)
    return [ex["qid"] for ex in examples if 0.0 < rates.get(ex["qid"], 0.0) < 1.0], rates


def write_difficulty_filter(model: str, out: str, world: str, samples: int = 8, threshold: float = 0.5,
                            seed: int = 0, allow_empty: bool = False, threads: int = 1) -> dict:
    """Sample the model folder on every training query of the world (the GRPO config's sampler and video options),
    write the kept ids as a JSON list to `out` (the rates beside it, OUT.rates.json); returns a summary."""
    import torch

    from mmrl import compose

    torch.set_num_threads(threads)

    cfg = compose.load_config(os.path.join(ROOT, CONFIGS["D"]), [f"model.path={model}", f"task.kwargs.root={world}",
                                                                 "task.kwargs.difficulty_filter=null",
                                                                 "task.eval_prompts=1"])
    task, policy = compose.build_task(cfg.task), compose.build_policy(cfg)
    t0 = time.time()
    keep, rates = difficulty_filter(policy, task.train, samples, threshold, seed)
    if not keep and not allow_empty:
        raise SystemExit(f"the difficulty filter of {model} keeps no training query (every success rate is 0 or 1)")
    summary = {"model": model, "world": world, "samples": samples, "threshold": threshold, "queries": len(rates),
               "kept": len(keep), "never": sum(r == 0 for r in rates.values()),
               "always": sum(r == 1 for r in rates.values()), "seconds": round(time.time() - t0, 1)}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w") as f:
        json.dump(keep, f)
    os.replace(out + ".tmp", out)
    with open(os.path.splitext(out)[0] + ".rates.json", "w") as f:
        json.dump({"summary": summary, "rates": rates}, f)
    return summary


# ------------------------------------------------------------------ the decision rule
def decide(rl: list[float], baseline: list[float], margin: float = MARGIN) -> dict:
    """The protocol's rule on paired per-seed OOD means: "rl wins" when mean(d) >= margin and mean(d) - se > 0,
    "baseline ahead" by the mirror rule, else "tie"; se = stdev(d) / sqrt(n) (undecided with one seed)."""
    d = [a - b for a, b in zip(rl, baseline)]
    mean = statistics.mean(d)
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None
    if se is None:
        verdict = "undecided (1 seed)"
    elif mean >= margin and mean - se > 0:
        verdict = "rl wins"
    elif mean <= -margin and mean + se < 0:
        verdict = "baseline ahead"
    else:
        verdict = "tie"
    return {"mean_diff": round(mean, 4), "se": None if se is None else round(se, 4), "verdict": verdict}


def split_metrics(res: dict) -> dict:
    """mmrl eval's result of one model -> {split: {mIoU, R1@0.5, R1@0.7}, "ood_mean"}."""
    cats = res.get("per_category", {})
    out = {s: {"mIoU": cats[s]["iou"], "R1@0.5": 100 * cats[s]["r1@0.5"], "R1@0.7": 100 * cats[s]["r1@0.7"]}
           for s in SPLITS if s in cats}
    out["ood_mean"] = statistics.mean(out[s]["mIoU"] for s in OOD) if all(s in out for s in OOD) else None
    return out


# ------------------------------------------------------------------ arms
class Arm:
    """One arm of one seed: its commands, run one after another (SFT-then-GRPO has two), and the model or run
    folder that is scored. kind: "rl" or "baseline"; comparison: the arms it is decided against."""

    def __init__(self, name: str, seed: int, kind: str, comparison: str, steps: list[list[str]], result: str):
        self.name, self.seed, self.kind, self.comparison, self.steps, self.result = \
            name, seed, kind, comparison, steps, result


def sft_cmd(args, init: str, out: str, minutes: float, seed: int, extra=()) -> list[str]:
    return [sys.executable, "scripts/sft_grounding.py", "--ood", "--world", args.world, "--init", init,
            "--minutes", f"{minutes:g}", "--lr", f"{args.sft_lr:g}", "--threads", "1", "--seed", str(seed),
            "--out", out, "--eval-every", "100000", "--eval-n", str(args.train_eval_n), *extra]


def grpo_cmd(args, config: str, init: str, out: str, minutes: float, seed: int, extra=()) -> list[str]:
    return [sys.executable, "-m", "mmrl.cli", "train", config, "--overwrite", f"model.path={init}",
            f"task.kwargs.root={args.world}", f"train.seed={seed}", f"train.time_budget_min={minutes:g}",
            "train.iterations=100000", "train.threads=1", f"log.out_dir={out}", "log.eval_at_start=false",
            "log.eval_every=0", "log.progress=false", "log.image_every=0", "log.tensorboard=false",
            f"task.eval_prompts={args.train_eval_n}", *args.grpo_overrides, *extra]


def arms_for(args, seed: int, base: str, filter_path: str | None = None) -> list[Arm]:
    m, out = args.minutes, args.out

    def p(name):
        return os.path.join(out, f"{name}_s{seed}")

    arms = []
    if args.regime == "A":
        for n in args.pools:
            pool = ["--label-pool", str(n), "--pool-seed", "0"]
            kw = [f"task.kwargs.label_pool={n}", "task.kwargs.pool_seed=0"]
            arms += [Arm(f"sft@{n}", seed, "baseline", f"pool {n}", [sft_cmd(args, base, p(f"sft{n}"), m, seed, pool)],
                         p(f"sft{n}")),
                     Arm(f"grpo@{n}", seed, "rl", f"pool {n}",
                         [grpo_cmd(args, CONFIGS["A"], base, p(f"grpo{n}"), m, seed, kw)], p(f"grpo{n}")),
                     Arm(f"sft_grpo@{n}", seed, "rl", f"pool {n}",
                         [sft_cmd(args, base, p(f"sft_half{n}"), m / 2, seed, pool),
                          grpo_cmd(args, CONFIGS["A"], p(f"sft_half{n}"), p(f"sft_grpo{n}"), m / 2, seed, kw)],
                         p(f"sft_grpo{n}"))]
    elif args.regime == "B":
        noise = ["--label-noise", f"{args.noise:g}", "--noise-seed", "0"]
        kw = [f"task.kwargs.label_noise={args.noise:g}", "task.kwargs.noise_seed=0"]
        arms += [Arm("sft", seed, "baseline", "B", [sft_cmd(args, base, p("sft"), m, seed, noise)], p("sft")),
                 Arm("grpo", seed, "rl", "B", [grpo_cmd(args, CONFIGS["B"], base, p("grpo"), m, seed, kw)], p("grpo"))]
    elif args.regime == "C":
        arms += [Arm("grpo_bit", seed, "rl", "C", [grpo_cmd(args, CONFIGS["C_bit"], base, p("grpo_bit"), m, seed)],
                     p("grpo_bit")),
                 Arm("grpo_bucket", seed, "rl", "C",
                     [grpo_cmd(args, CONFIGS["C_bucket"], base, p("grpo_bucket"), m, seed)], p("grpo_bucket")),
                 Arm("rft", seed, "baseline", "C", [sft_cmd(args, base, p("rft"), m, seed, ["--rft"])], p("rft"))]
        if not args.no_dpo:
            arms.append(Arm("dpo", seed, "baseline", "C", [sft_cmd(args, base, p("dpo"), m, seed, ["--dpo"])],
                            p("dpo")))
    else:  # D: both from the plateaued model
        arms += [Arm("sft", seed, "baseline", "D", [sft_cmd(args, base, p("sft"), m, seed)], p("sft")),
                 Arm("grpo", seed, "rl", "D", [grpo_cmd(args, CONFIGS["D"], base, p("grpo"), m, seed,
                                                        [f"task.kwargs.difficulty_filter={filter_path}"])],
                     p("grpo"))]
    return arms


def run_steps(steps: list[list[str]], log_path: str, status: dict, key) -> None:
    with open(log_path, "w") as log:
        for cmd in steps:
            log.write("$ " + " ".join(cmd) + "\n")
            log.flush()
            rc = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            if rc != 0:
                status[key] = rc
                return
    status[key] = 0


def run_side_by_side(arms: list[Arm]) -> None:
    """Start every arm at once (a thread each drives its commands); fail naming the log of a failed arm."""
    status, threads = {}, []
    for a in arms:
        t = threading.Thread(target=run_steps, args=(a.steps, f"{a.result}.arm.log", status, a.name))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    failed = [a for a in arms if status.get(a.name) != 0]
    if failed:
        sys.exit("failed: " + ", ".join(f"{a.name} seed {a.seed} (see {a.result}.arm.log)" for a in failed))


def score(args, base: str, models: list[str]) -> dict:
    """One `mmrl eval` of the eval config on every held-out query of the fixed splits: {label: result}."""
    cmd = [sys.executable, "-m", "mmrl.cli", "eval", EVAL_CONFIG, f"model.path={base}",
           f"task.kwargs.root={args.world}", f"task.eval_prompts={args.eval_prompts}", "log.progress=false", *models]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(args.eval_threads)})
    if r.returncode != 0:
        sys.exit(f"mmrl eval failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])["results"]


def summarize(arms: list[Arm], results: dict, extra_rows: dict[str, str]) -> dict:
    """{"arms": {name: {"mean": metrics, "per_seed": {seed: metrics}}}, "rows": {label: metrics},
    "decisions": [...]} from mmrl eval's results."""
    table = {}
    for a in arms:
        table.setdefault(a.name, {"kind": a.kind, "comparison": a.comparison, "per_seed": {}})
        table[a.name]["per_seed"][a.seed] = split_metrics(results[a.result])
    for row in table.values():
        seeds = list(row["per_seed"].values())
        row["mean"] = {s: {k: statistics.mean(m[s][k] for m in seeds) for k in seeds[0][s]}
                       for s in SPLITS if s in seeds[0]}
        oods = [m["ood_mean"] for m in seeds if m["ood_mean"] is not None]
        row["mean"]["ood_mean"] = statistics.mean(oods) if oods else None
    decisions = []
    for comp in dict.fromkeys(r["comparison"] for r in table.values()):
        names = [n for n, r in table.items() if r["comparison"] == comp]
        baselines = [n for n in names if table[n]["kind"] == "baseline"]
        best = max(baselines, key=lambda n: table[n]["mean"]["ood_mean"] or -1) if baselines else None
        for n in names:
            if table[n]["kind"] != "rl" or best is None:
                continue
            seeds = sorted(set(table[n]["per_seed"]) & set(table[best]["per_seed"]))
            d = decide([table[n]["per_seed"][s]["ood_mean"] for s in seeds],
                       [table[best]["per_seed"][s]["ood_mean"] for s in seeds])
            decisions.append({"comparison": comp, "rl": n, "baseline": best, **d})
    rows = {label: split_metrics(results[path]) for label, path in extra_rows.items() if path in results}
    rows.update({"base" if k.startswith("base (") else k: split_metrics(v) for k, v in results.items()
                 if k.startswith(("base (", "constant answer"))})
    return {"arms": table, "rows": rows, "decisions": decisions}


def print_table(summary: dict) -> None:
    cols = [f"{s}" for s in SPLITS]
    print(f"{'arm':24s} " + " ".join(f"{c + ' mIoU/R1@.5/R1@.7':>26s}" for c in cols) + f" {'OOD mean':>9s}  per seed")

    def cells(m):
        return " ".join(f"{m[s]['mIoU']:.3f} / {m[s]['R1@0.5']:5.1f} / {m[s]['R1@0.7']:5.1f}".rjust(26)
                        if s in m else f"{'-':>26s}" for s in SPLITS)

    for label, m in summary["rows"].items():
        ood = f"{m['ood_mean']:.3f}" if m["ood_mean"] is not None else "-"
        print(f"{label[:24]:24s} {cells(m)} {ood:>9s}")
    for name, row in summary["arms"].items():
        m = row["mean"]
        ood = f"{m['ood_mean']:.3f}" if m["ood_mean"] is not None else "-"
        per = " ".join(f"s{s}:{v['ood_mean']:.3f}" for s, v in row["per_seed"].items() if v["ood_mean"] is not None)
        print(f"{name[:24]:24s} {cells(m)} {ood:>9s}  {per}")
    for d in summary["decisions"]:
        se = "-" if d["se"] is None else f"{d['se']:.3f}"
        print(f"[{d['comparison']}] {d['rl']} vs {d['baseline']}: OOD mean diff {d['mean_diff']:+.3f} (se {se}) "
              f"-> {d['verdict']}")


# ------------------------------------------------------------------ quick mode: a tiny world and base
def quick_setup(args) -> str:
    """A tiny OOD world and a tiny SFT base under --out; returns the base folder."""
    from tasks.grounding_world import build_world

    args.world = os.path.join(args.out, "world")
    build_world(args.world, QUICK_WORLD, ood=True)
    base = os.path.join(args.out, "base")
    if not os.path.isfile(os.path.join(base, "sft_info.json")):
        cmd = [sys.executable, "scripts/sft_grounding.py", "--ood", "--world", args.world, "--size", "tiny",
               "--minutes", "0.05", "--threads", "1", "--batch", "8", "--eval-every", "100000", "--eval-n", "2",
               "--out", base]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode != 0:
            sys.exit(f"quick base failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return base


def plateau_model(args, base: str) -> str:
    """Regime D's starting point: SFT from the base until its id mIoU has not risen for --patience evaluations
    (made once under --out and reused)."""
    out = os.path.join(args.out, "plateau")
    if os.path.isfile(os.path.join(out, "plateau.json")):
        print(f"reusing the plateau model {out}: {json.load(open(os.path.join(out, 'plateau.json')))['stopped']}")
        return out
    cmd = sft_cmd(args, base, out, args.plateau_cap, 0, ["--until-plateau", "--patience", str(args.patience)])
    cmd[cmd.index("--eval-every") + 1] = f"{args.plateau_eval_every:g}"
    cmd[cmd.index("--eval-n") + 1] = str(args.plateau_eval_n)
    with open(out + ".arm.log", "w") as log:
        if subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}) != 0:
            sys.exit(f"the plateau run failed (see {out}.arm.log)")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regime", choices=["A", "B", "C", "D"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--minutes", type=float, default=6.0, help="wall-time budget of every arm")
    ap.add_argument("--quick", action="store_true", help="a tiny world and base, 1 seed, tiny evals, "
                    "at most 0.25 min per arm (less with --minutes)")
    ap.add_argument("--base", default="runs/grounding-ood-sft", help="the SFT base every arm starts from")
    ap.add_argument("--world", default="runs/grounding_ood")
    ap.add_argument("--out", default=None, help="default runs/grounding_regimes/REGIME")
    ap.add_argument("--pools", nargs="+", type=int, default=[256, 1024], help="A: the label pools")
    ap.add_argument("--noise", type=float, default=0.3, help="B: the fraction of training spans replaced")
    ap.add_argument("--no-dpo", action="store_true", help="C: leave out the DPO baseline")
    ap.add_argument("--sft-lr", type=float, default=1e-3, help="the SFT arms' lr (sft_grounding.py's default)")
    ap.add_argument("--patience", type=int, default=3, help="D: evaluations without a rise before the plateau")
    ap.add_argument("--plateau-eval-every", type=float, default=2.0, help="D: minutes between plateau evaluations")
    ap.add_argument("--plateau-eval-n", type=int, default=200, help="D: id queries the plateau is judged on")
    ap.add_argument("--plateau-cap", type=float, default=90.0, help="D: the plateau run's cap in minutes")
    ap.add_argument("--filter-samples", type=int, default=8, help="D: samples per training query in the filter")
    ap.add_argument("--eval-prompts", type=int, default=1000, help="held-out queries per split in the final mmrl eval")
    ap.add_argument("--eval-threads", type=int, default=2)
    ap.add_argument("--train-eval-n", type=int, default=20, help="queries per split of each arm's own end-of-run eval "
                                                                   "(after its budget; mmrl eval scores the results)")
    ap.add_argument("--grpo-overrides", nargs="*", default=[], help="more key=value overrides of every GRPO arm")
    ap.add_argument("--difficulty-filter", metavar="MODEL", help="only write MODEL's difficulty filter (--filter-out)")
    ap.add_argument("--filter-out", help="--difficulty-filter: the JSON list to write")
    args = ap.parse_args(argv)
    if args.difficulty_filter:
        if not args.filter_out:
            ap.error("--difficulty-filter needs --filter-out PATH")
        print(json.dumps(write_difficulty_filter(args.difficulty_filter, args.filter_out, args.world,
                                                 args.filter_samples, threads=args.eval_threads)))
        return
    if not args.regime:
        ap.error("--regime A|B|C|D is required (or --difficulty-filter MODEL)")
    args.out = os.path.abspath(args.out or os.path.join("runs", "grounding_regimes",
                                                        args.regime + ("_quick" if args.quick else "")))
    args.world, args.base = os.path.abspath(args.world), os.path.abspath(args.base)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    base = args.base
    if args.quick:
        args.minutes, args.seeds, args.eval_prompts, args.train_eval_n = min(args.minutes, 0.25), args.seeds[:1], 4, 2
        args.pools = [8]
        args.plateau_eval_every, args.plateau_eval_n, args.plateau_cap, args.patience = 0.05, 4, 0.3, 1
        args.grpo_overrides = ["train.prompts_per_iter=2", "train.group_size=4", "train.minibatches=1",
                               *args.grpo_overrides]
        base = quick_setup(args)
    extra_rows, filter_path, filter_summary = {}, None, None
    if args.regime == "D":
        base = plateau_model(args, base)
        extra_rows["plateau"] = base
        filter_path = os.path.join(args.out, "filter.json")
        if not os.path.isfile(filter_path):
            filter_summary = write_difficulty_filter(base, filter_path, args.world, args.filter_samples,
                                                     allow_empty=args.quick, threads=args.eval_threads)
            if args.quick and not filter_summary["kept"]:  # a tiny base gets everything wrong: keep all (smoke only)
                from mmrl import compose

                cfg = compose.load_config(os.path.join(ROOT, EVAL_CONFIG), [f"task.kwargs.root={args.world}",
                                                                            "task.eval_prompts=1"])
                json.dump([ex["qid"] for ex in compose.build_task(cfg.task).train], open(filter_path, "w"))
            print(f"difficulty filter: {json.dumps(filter_summary)}")
    arms = []
    for seed in args.seeds:  # the arms of one comparison and seed start together: they share the machine equally
        seed_arms = arms_for(args, seed, base, filter_path)
        for comp in dict.fromkeys(a.comparison for a in seed_arms):
            group = [a for a in seed_arms if a.comparison == comp]
            print(f"seed {seed} [{comp}]: {', '.join(a.name for a in group)} side by side, {args.minutes:g} min each",
                  flush=True)
            run_side_by_side(group)
        arms += seed_arms
    results = score(args, os.path.join(args.out, "base") if args.quick else args.base,
                    list(extra_rows.values()) + [a.result for a in arms])
    summary = summarize(arms, results, extra_rows)
    print_table(summary)
    print(json.dumps({"regime": args.regime, "minutes": args.minutes, "seeds": args.seeds, "base": base,
                      "world": args.world, "eval_prompts": args.eval_prompts, "filter": filter_summary,
                      "wall_minutes": round((time.time() - t0) / 60, 2), **summary}))


if __name__ == "__main__":
    main()
