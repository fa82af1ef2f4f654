"""Run folders (log.out_dir): one run per folder, never mixed, never lost; `train` runs a config in one.

Before a run loads any weights, `prepare_run_dir` decides what happens to its folder:
- empty or new: the run starts there;
- it holds a run and neither --resume nor --overwrite is given: refused, naming both ways forward;
- --overwrite: the old run is deleted first (rank 0);
- --resume: the new config is compared with the saved one (the newest checkpoint's config.json, else the
  folder's): a change that breaks the saved state (the model, its LoRA, the policy, the algorithm) is refused,
  listing every changed key; any other change is listed in a warning. Nothing is written before this check.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from mmrl.checkpoint import checkpoints, latest
from mmrl.config import Config, flat as config_flat, to_dict
from mmrl.config_files import upgrade_saved
from mmrl.errors import UserError
from mmrl.preemption import restarted

log = logging.getLogger(__name__)

RUN_FILES = ("metrics.jsonl", "results.json", "config.json", "checkpoints", "tb")
# keys whose change makes the saved weights / optimizer state another experiment's: refused on --resume
BREAKING = ("model.", "algo.objective.name", "algo.advantage", "algo.ratio", "algo.loss_agg", "algo.credit",
            "train.ema_decay", "tree.")
NOT_BREAKING = ("model.offload", "model.text_cache")
QUIET = ("log.", "train.iterations", "train.time_budget_min")  # extending or relogging a run: no warning


class RunDirError(UserError, ValueError):
    """A run folder that cannot be used as asked (mmrl prints it as one message, no traceback)."""


def holds_run(out_dir: str) -> bool:
    return os.path.isdir(out_dir) and any(os.path.exists(os.path.join(out_dir, f)) for f in RUN_FILES)


def flat(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1} (dict-valued leaves such as reward.kwargs are compared whole)."""
    return config_flat(d, prefix, whole=("kwargs", "eval_kwargs", "vllm"))


def config_changes(saved: dict, cfg: Config) -> list[tuple[str, object, object]]:
    """(key, saved value, new value) of every key that differs (keys only one side has count as changed)."""
    defaults = flat(to_dict(Config()))  # a key added to mmrl after the run was saved: its default
    old, new = {**defaults, **flat(saved)}, flat(to_dict(cfg))
    return [(k, old.get(k, "<absent>"), new.get(k, "<absent>")) for k in sorted(set(old) | set(new))
            if old.get(k, "<absent>") != new.get(k, "<absent>")]


def saved_config(out_dir: str) -> tuple[str, dict] | None:
    """(file, config) the run in out_dir last saved: its newest checkpoint's config.json, else out_dir's."""
    for path in [os.path.join(c, "config.json") for c in checkpoints(os.path.join(out_dir, "checkpoints"))] + \
            [os.path.join(out_dir, "config.json")]:
        try:
            with open(path) as f:
                return path, upgrade_saved(json.load(f), path)  # an older mmrl's keys in their new places
        except (OSError, ValueError):
            continue
    return None


def prepare_run_dir(cfg: Config, resume: bool = False, overwrite: bool = False, main: bool = True) -> None:
    """Check (every rank) and prepare (rank 0: `main`) cfg.log.out_dir for a run; see the module docstring."""
    out = cfg.log.out_dir
    if resume and overwrite:
        raise RunDirError("--resume continues the run in log.out_dir and --overwrite deletes it: give one")
    if not holds_run(out):
        return
    if overwrite:
        if main:
            log.warning("--overwrite: deleting the run in %s", out)
            for f in RUN_FILES:
                p = os.path.join(out, f)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p) if os.path.exists(p) else None
        return
    if not resume:
        raise RunDirError(f"log.out_dir={out!r} already holds a run ({describe(out)}). Continue it with --resume, "
                          f"start over with --overwrite (deletes it), or set log.out_dir=NEW_FOLDER")
    found = saved_config(out)
    if found is None:
        return
    where, saved = found
    changes = config_changes(saved, cfg)
    breaking = [c for c in changes if c[0].startswith(BREAKING) and not c[0].startswith(NOT_BREAKING)]
    show = lambda cs: "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in cs)  # noqa: E731
    if breaking:
        raise RunDirError(f"--resume with a config that changes the saved state ({where}): {show(breaking)}. "
                          f"Resume with the saved values, or start a new run (set log.out_dir=NEW_FOLDER; "
                          f"model.path=<a checkpoint's policy/ folder> starts from its weights)")
    loud = [c for c in changes if not c[0].startswith(QUIET)]
    if loud:
        log.warning("--resume with a changed config (saved: %s): %s", where, show(loud))


def finished(cfg: Config) -> dict | None:
    """results.json of the run in log.out_dir when it has done train.iterations (its newest checkpoint, intact, is
    the last iteration's), else None (a damaged newest checkpoint: the resume falls back and trains again)."""
    from mmrl.checkpoint_state import verify

    path, ck = os.path.join(cfg.log.out_dir, "results.json"), latest(os.path.join(cfg.log.out_dir, "checkpoints"))
    if not (os.path.isfile(path) and ck) or verify(ck):
        return None
    results = json.load(open(path))
    step = int(os.path.basename(ck.rstrip("/")).rpartition("-")[2])
    return results if step >= cfg.train.iterations and results.get("iterations", 0) >= cfg.train.iterations else None


def describe(out_dir: str) -> str:
    cks = checkpoints(os.path.join(out_dir, "checkpoints"))
    return f"{len(cks)} checkpoint(s), newest {os.path.basename(cks[0])}" if cks else "logs, no checkpoint"


def train(cfg: Config, resume: bool = False, overwrite: bool = False, command: str | None = None) -> dict:
    """Run `cfg` in log.out_dir: a folder that holds a run needs `resume` (continue it; the config is checked
    against the saved one) or `overwrite` (delete it); mmrl/runs.py. Nothing is written before those checks.
    Returns results.json's content, with results["summary"] (mmrl/report.py: before / after, verdict, where
    things went); `command` (the line that started the run) names how to train longer."""
    from mmrl.report import summary
    from mmrl.trainer import Trainer

    t0 = time.time()
    if restarted():  # torchrun --max-restarts brought the workers back: continue the run (--overwrite was for the
        # first start: the run it began is the one to continue)
        log.warning("torchrun restart %d: resuming from the newest intact checkpoint in %s", restarted(),
                    cfg.log.out_dir)
        resume, overwrite = resume or holds_run(cfg.log.out_dir), False
    prepare_run_dir(cfg, resume, overwrite, main=int(os.environ.get("RANK", "0")) == 0)
    done = finished(cfg) if resume else None
    if done is not None:  # nothing to continue: the run's files stay as they are
        log.warning("%s is finished (%d of train.iterations=%d done): nothing to do. Train it longer with a larger "
                    "train.iterations and --resume", cfg.log.out_dir, done["iterations"], cfg.train.iterations)
        return done
    trainer = Trainer(cfg)
    if resume and not trainer.resume():
        log.warning("--resume: no checkpoint in %s/checkpoints; starting from scratch", cfg.log.out_dir)
        trainer.reopen_logger((0, 0))  # what a run killed before its first save logged goes
    if trainer.dist.main:  # one writer
        with open(os.path.join(cfg.log.out_dir, "config.json"), "w") as f:
            json.dump(to_dict(cfg), f, indent=2)
    results = trainer.fit()
    trainer.dist.close()
    out = cfg.log.out_dir
    results["summary"] = summary(results, cfg, time.time() - t0, trainer.elapsed_min,
                                 latest(os.path.join(out, "checkpoints")), command)
    if results["summary"].get("short"):
        log.warning(results["summary"]["short"])
    if trainer.dist.main:  # results.json again, with the summary
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
    return results
