"""Checkpoints: atomic folders, and a trainer's save / exact resume.

checkpoints/iter-N/ holds policy/ (the policy's save_pretrained: loadable on its own), trainer_state.pt (raw
trainable weights, EMA, optimizer, RNG, iteration, elapsed minutes; weights_only-loadable), config.json, and
under FSDP one optimizer-rankR.pt per rank.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile

import torch

from mmrl.config import to_dict
from mmrl.distributed import from_local_state, gather_to, local_state, shard_like, unsharded

log = logging.getLogger(__name__)


@contextlib.contextmanager
def atomic_dir(path: str):
    """Yield a temporary folder beside `path`; on success it replaces `path` (old version removed only after
    the new one is complete), on error it is deleted and `path` is left untouched."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".tmp-", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700: the usual permissions, so teammates can read runs
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".old-", dir=parent)
        os.replace(path, os.path.join(old, "x"))
    os.replace(tmp, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale(folder: str) -> None:
    """Delete what a save killed half-way left in `folder` (its hidden .NAME.tmp-* / .NAME.old-* folders)."""
    if os.path.isdir(folder):
        for d in os.listdir(folder):
            if d.startswith(".") and (".tmp-" in d or ".old-" in d):
                shutil.rmtree(os.path.join(folder, d), ignore_errors=True)


def checkpoints(folder: str) -> list[str]:
    """The `iter-N` checkpoint folders under `folder`, newest (highest N) first."""
    if not os.path.isdir(folder):
        return []
    names = [d for d in os.listdir(folder) if d.startswith("iter-") and d[5:].isdigit()]
    return [os.path.join(folder, d) for d in sorted(names, key=lambda d: -int(d[5:]))]


def latest(folder: str) -> str | None:
    """The checkpoint folder with the highest iteration number under `folder` (names `iter-NNNNNN`)."""
    if not os.path.isdir(folder):
        return None
    names = [d for d in os.listdir(folder) if d.startswith("iter-") and d[5:].isdigit()]
    return os.path.join(folder, max(names, key=lambda d: int(d[5:]))) if names else None


def prune(folder: str, keep: int) -> None:
    """Delete all but the `keep` newest `iter-N` checkpoints in `folder` (keep <= 0 keeps all)."""
    if keep <= 0 or not os.path.isdir(folder):
        return
    names = sorted((d for d in os.listdir(folder) if d.startswith("iter-") and d[5:].isdigit()), key=lambda d: int(d[5:]))
    for d in names[:-keep]:
        shutil.rmtree(os.path.join(folder, d), ignore_errors=True)


def save_trainer(tr) -> str:
    """checkpoints/iter-N of trainer `tr` (mmrl.trainer.Trainer). Rank 0 writes (atomically); every rank takes part
    in gathering sharded weights (FSDP: each rank also writes its optimizer shard into the same folder, which
    needs a filesystem all ranks share), then all check that their parameters agree."""
    path = os.path.join(tr.cfg.log.out_dir, "checkpoints", f"iter-{tr.iteration:06d}")
    fsdp = tr.dist.world > 1 and tr.cfg.train.parallel == "fsdp"
    main = tr.dist.main
    if main:
        remove_stale(os.path.dirname(path))
    tr.dist.reshard()  # FSDP2: parameters a forward left gathered (the root's) go back to their shards first
    params = gather_to(main, tr.params)     # whole CPU copies on rank 0 only (all-gathers under FSDP: every rank)
    ema = gather_to(main, tr.ema.shadow) if tr.ema is not None else None
    # the saved policy is the EMA one when enabled; raw weights go to trainer_state. Under FSDP rank 0 gathers what
    # save_pretrained writes: the trained tensors (LoRA: the adapters), never a frozen base
    saved = (lambda p: p.requires_grad) if getattr(tr.policy, "lora", False) else (lambda p: True)
    # the saved values were gathered just above: rank 0 reuses them instead of holding a second copy (the same
    # keys on every rank, so every rank skips the same gathers; the values exist on rank 0 only)
    known = {id(p): v for p, v in zip(tr.params, ema if ema is not None else params)}
    with tr.ema_weights(), unsharded(tr.policy.trainable_modules() if fsdp else [], main, saved, known), \
            contextlib.ExitStack() as stack:
        tmp = stack.enter_context(atomic_dir(path)) if tr.dist.main else None
        tmp = tr.dist.broadcast_object(tmp)
        if fsdp:  # optimizer state is sharded like the parameters: one file per rank
            torch.save(local_state(tr.opt.state_dict()), os.path.join(tmp, f"optimizer-rank{tr.dist.rank}.pt"))
        tr.dist.barrier()  # every shard is in the folder before rank 0 publishes it
        if tr.dist.main:
            tr.policy.save_pretrained(os.path.join(tmp, "policy"))
            state = {"iteration": tr.iteration, "optimizer": None if fsdp else tr.opt.state_dict(),
                     "params": params, "ema": ema, "torch_rng": torch.get_rng_state(),
                     "elapsed_min": tr.elapsed_min, "timed_evals": json.dumps(tr.timed_evals),
                     "eval_start": json.dumps(tr.eval_start), "metrics_lines": tr.logger.lines,
                     "world": tr.dist.world, "parallel": tr.cfg.train.parallel}
            torch.save(state, os.path.join(tmp, "trainer_state.pt"))
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(to_dict(tr.cfg), f, indent=2)
    if tr.dist.main:
        prune(os.path.dirname(path), tr.cfg.log.keep_checkpoints)
    tr.dist.barrier()
    tr.dist.check_in_sync(tr.params)
    return path


def load_state(folder: str) -> tuple[str, dict] | None:
    """(path, trainer state) of the newest intact checkpoint under `folder`: one whose trainer_state.pt and
    policy/ load is skipped with a warning naming it and the one used instead; None when there is no checkpoint.
    Raises when every checkpoint is damaged, naming each and why."""
    remove_stale(folder)
    failures = []
    for path in checkpoints(folder):
        try:
            if not os.path.isfile(os.path.join(path, "policy", "mmrl_policy.json")):
                raise FileNotFoundError("policy/mmrl_policy.json is missing")
            state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
        except Exception as e:  # a truncated / missing file: try the previous checkpoint
            failures.append(f"{path}: {type(e).__name__}: {e}")
            continue
        if failures:
            log.warning("damaged checkpoint(s) skipped: %s; resuming from %s instead", "; ".join(failures), path)
        return path, state
    if failures:
        raise RuntimeError("no intact checkpoint to resume from: " + "; ".join(failures) + ". Start a new run "
                           "(--overwrite, or another log.out_dir)")
    return None


def resume_trainer(tr) -> bool:
    """Load the newest intact checkpoint in log.out_dir into trainer `tr` (weights, EMA, optimizer, RNG, iteration,
    elapsed minutes, the start evaluation) and cut its logs back to that checkpoint; False when there is none."""
    found = load_state(os.path.join(tr.cfg.log.out_dir, "checkpoints")) if tr.dist.main else None
    path = tr.dist.broadcast_object(found[0] if found else None)  # rank 0 picks: every rank resumes from one
    if path is None:
        return False
    state = found[1] if found else torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
    sharded = state["optimizer"] is None
    if sharded and (state.get("world") != tr.dist.world or tr.cfg.train.parallel != "fsdp"):
        raise ValueError(f"{path} was written by an FSDP run on {state.get('world')} processes; its optimizer "
                         f"state is sharded: resume it with train.parallel=fsdp on as many processes")
    with torch.no_grad():
        for p, v in zip(tr.params, state["params"]):
            p.copy_(shard_like(v, p))
        if state["ema"] is not None and tr.ema is not None:
            for e, v in zip(tr.ema.shadow, state["ema"]):
                e.copy_(shard_like(v, e))
    if sharded:
        opt = torch.load(os.path.join(path, f"optimizer-rank{tr.dist.rank}.pt"), weights_only=True)
        tr.opt.load_state_dict(from_local_state(opt, tr.params))
    else:
        tr.opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    tr.iteration = state["iteration"]
    tr.elapsed_min = state.get("elapsed_min", 0.0)
    tr.timed_evals = json.loads(state.get("timed_evals", "[]"))
    tr.eval_start = json.loads(state.get("eval_start", "null"))
    tr.reopen_logger(resume=(state.get("metrics_lines"), tr.iteration))
    log.info("resumed from %s at iteration %d", path, tr.iteration)
    return True
