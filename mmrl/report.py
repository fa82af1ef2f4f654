"""What a run tells people: the evaluation line, and at its end a short table (held-out figures before / after per
category with the standard error of the change, a plain verdict, time, iterations, where everything went).

The verdict is a paired test over prompts: the trainer scores the same held-out prompts with the same seeds
(evaluation.EVAL_SEED) before and after training, so the change of prompt i is after_i - before_i and its mean has
the standard error sd(after_i - before_i) / sqrt(n). A change beyond 2 standard errors is "a real gain" (or "a real
drop"); anything closer to 0 is "too few iterations to tell", with the command that trains longer. A run whose
iterations fall short of half its train.iterations (a time budget cut it) says so: its figures are not the config's.

results.json gets the summary (results["summary"]); stdout gets the table, or the whole JSON with `mmrl train
--json`; under torchrun only rank 0 prints (`emit`)."""

from __future__ import annotations

import json
import logging
import math
import os
import sys

from mmrl.evaluation import NOT_METRICS, standard_error

log = logging.getLogger(__name__)
SHORT = 0.5  # iterations done below this fraction of train.iterations: the end of the run says so


def metric_keys(res: dict) -> list[str]:
    """The reward keys of an evaluation result, "overall" first."""
    keys = [k for k in res if k not in NOT_METRICS]
    return sorted(keys, key=lambda k: (k != "overall", keys.index(k)))


def eval_line(step: int, res: dict) -> str:
    """'eval at iteration 30: overall 0.412 ± 0.021, strict 0.300 (n=504) | single_object 0.80, counting 0.31'."""
    keys = metric_keys(res)
    se = res.get("se", {})
    head = ", ".join(f"{k} {res[k]:.3f}" + (f" ± {se[k]:.3f}" if k in se and i == 0 else "")
                     for i, k in enumerate(keys))
    cats = ", ".join(f"{c} {d[keys[0]]:.2f}" for c, d in res.get("per_category", {}).items() if keys and keys[0] in d)
    return f"eval at iteration {step}: {head or 'no scores'} (n={res.get('n', 0)})" + (f" | {cats}" if cats else "")


def log_evaluation(logger, step: int, res: dict, main: bool = True) -> None:
    """A held-out evaluation at `step` (iterations done) into `logger` (metrics.Logger): eval/* and
    eval_by_category/<category>/* scalars, and on the main process one readable line in the log (`eval_line`)."""
    flat = {f"eval/{k}": v for k, v in res.items() if k not in NOT_METRICS}
    for c, d in res["per_category"].items():
        flat.update({f"eval_by_category/{c}/{k}": v for k, v in d.items() if k != "n"})
    logger.scalars(step, flat)  # a no-op on the other ranks
    if main:
        log.info(eval_line(step, res))


def verdict(before: dict | None, after: dict, key: str = "overall") -> dict:
    """{key, before, after, change, se, paired, verdict}: the change of `key` between two evaluations and the
    standard error of that change (paired over examples when both hold the same number of per-example scores,
    else from the two standard errors); verdict "a real gain" / "a real drop" beyond 2 se, else "too few"."""
    if before is None or key not in before or key not in after:
        return {"key": key, "after": after.get(key), "verdict": "no evaluation before training"}
    a, b = before.get("scores", {}).get(key), after.get("scores", {}).get(key)
    paired = a is not None and b is not None and len(a) == len(b) > 1
    if paired:
        se = standard_error([y - x for x, y in zip(a, b)])
    else:  # independent samples (an old results.json without per-example scores)
        se = math.hypot(before.get("se", {}).get(key, 0.0), after.get("se", {}).get(key, 0.0))
    change = after[key] - before[key]
    word = "a real gain" if change > 2 * se else "a real drop" if change < -2 * se else "too few iterations to tell"
    return {"key": key, "before": before[key], "after": after[key], "change": round(change, 4), "se": round(se, 4),
            "paired": paired, "verdict": word}


def summary(results: dict, cfg, seconds: float, train_min: float, checkpoint: str | None,
            command: str | None = None) -> dict:
    """The end of a run in words and numbers (results["summary"]); `command` is the line that started the run
    (without --resume / --overwrite), used to say how to train longer."""
    out, t = cfg.log.out_dir, cfg.train
    after = results["eval_end"]
    keys = metric_keys(after)
    v = verdict(results.get("eval_start"), after, keys[0] if keys else "overall")
    done = results["iterations"]
    command = " ".join(w for w in (command or f"mmrl train CONFIG log.out_dir={out}").split()
                       if not w.startswith(("train.iterations=", "train.time_budget_min=")))
    more = f"{command} --resume train.iterations={max(2 * done, done + 10)}" + \
           (" train.time_budget_min=0" if t.time_budget_min else "")
    if v["verdict"] == "too few iterations to tell":
        v["longer"] = more
    s = {"iterations": done, "iterations_planned": t.iterations, "seconds": round(seconds, 1),
         "train_minutes": round(train_min, 2), "verdict": v, "out_dir": out,
         "checkpoints": os.path.join(out, "checkpoints"), "newest_checkpoint": checkpoint,
         "metrics": os.path.join(out, "metrics.jsonl"), "results": os.path.join(out, "results.json"),
         "tensorboard": os.path.join(out, "tb") if cfg.log.tensorboard else None,
         "image_every": cfg.log.image_every, "report_to": list(cfg.log.report_to or [])}
    if done < SHORT * t.iterations:
        why = f"train.time_budget_min={t.time_budget_min} ran out" if t.time_budget_min else "the run was stopped"
        s["short"] = (f"only {done} of train.iterations={t.iterations} iterations ran ({why}): these figures are not "
                      f"what the config is for; continue with `{more}`")
    return s


def _duration(s: float) -> str:
    m, s = divmod(int(round(s)), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def format_table(results: dict) -> str:
    """The end-of-run table for people, from results (with results["summary"])."""
    s, after, before = results["summary"], results["eval_end"], results.get("eval_start")
    v, keys = s["verdict"], metric_keys(after)
    # seconds: this command's wall time; train_minutes: the run's training in all (a resumed run's included)
    lines = [f"{s['iterations']} iterations (train.iterations={s['iterations_planned']}): {s['train_minutes']:.1f} min "
             f"of training in all; this command took {_duration(s['seconds'])}"]
    if s.get("short"):
        lines.append(f"NOTE: {s['short']}")
    rows = [(k, before.get(k) if before else None, after[k]) for k in keys]
    head = keys[0] if keys else "overall"
    for c, d in after.get("per_category", {}).items():
        b = (before or {}).get("per_category", {}).get(c, {}).get(head)
        rows.append((f"  {c} ({head}, n={d.get('n', 0)})", b, d.get(head)))
    width = max([len(r[0]) for r in rows] + [len("held-out")]) + 2
    lines.append(f"{'held-out':<{width}}{'before':>8}{'after':>8}   (n={after.get('n', 0)} prompts, same seeds)")
    fmt = lambda x: f"{x:8.3f}" if isinstance(x, (int, float)) else f"{'-':>8}"  # noqa: E731
    for name, b, a in rows:
        lines.append(f"{name:<{width}}{fmt(b)}{fmt(a)}")
    if "change" in v:
        lines.append(f"verdict: {v['verdict']}: {v['key']} {v['before']:.3f} -> {v['after']:.3f}, change "
                     f"{v['change']:+.3f} ± {v['se']:.3f} (standard error{', paired over prompts' if v['paired'] else ''};"
                     f" a real change is beyond 2 standard errors)")
    else:
        lines.append(f"verdict: {v['verdict']}")
    if v.get("longer"):
        lines.append(f"  train longer: {v['longer']}")
    ck = s["newest_checkpoint"]
    lines.append(f"checkpoints: {s['checkpoints']}" + (f" (newest {os.path.basename(ck)})" if ck else " (none)"))
    lines.append(f"logs: {s['metrics']}" + (f"; tensorboard --logdir {s['tensorboard']}" if s["tensorboard"] else ""))
    where = [x for x in ([s["tensorboard"] and "TensorBoard (Images)"] + s["report_to"]) if x]
    lines.append(f"samples: image grids every {s['image_every']} iterations in {', '.join(where)}"
                 if s["image_every"] and where else "samples: none logged (log.image_every, log.tensorboard)")
    lines.append(f"results: {s['results']} (mmrl train --json prints it)")
    return "\n".join(lines)


def emit(results: dict, as_json: bool = False, main: bool | None = None, file=None) -> None:
    """Print the end of a run: the table, or the JSON with `as_json`; only on the main process (`main`, default:
    the RANK environment variable is 0), so torchrun's ranks do not print it once each."""
    if main is None:
        main = int(os.environ.get("RANK", "0")) == 0
    if not main:
        return
    print(json.dumps(results, default=str) if as_json else format_table(results), file=file or sys.stdout,
          flush=True)
