"""Checkpoints: atomic folders, a trainer's sharded save / exact resume (on any world size), integrity, run folders
that every node must see.

checkpoints/iter-N/ holds
    state/               torch.distributed.checkpoint shards written by every rank (mmrl/checkpoint_state.py): the
                         raw trained weights, the EMA shadow and the optimizer state, keyed by parameter name, so a
                         resume reshards them to any world size and to one process, DDP or FSDP2
    trainer_state.json   iteration, elapsed minutes, RNG, timed evaluations, the start evaluation, metrics lines,
                         the writer's world size and parallelism (rank 0)
    config.json          the run's config
    policy/              the final checkpoint of a run only (not under FSDP2 full fine-tuning): the policy's
                         save_pretrained (diffusers / peft loadable), EMA weights when EMA is on, else the raw ones
    manifest.json        written last: every other file's size and sha256 (config.json aside: a record people
                         read and may edit); a policy/ built later is not in it

Where the trained tensors are: once raw and once as EMA (state/), in every checkpoint. A policy/ folder is an
export: the run's last save writes one, and `policy_folder` (what `mmrl eval`, `mmrl sample` and `mmrl export`
call) builds it from state/ and config.json the first time an earlier checkpoint is asked for, so an intermediate
checkpoint never stores a third copy. (The final checkpoint holds that third copy: what users load and ship.)

Nothing is gathered whole on one host during training: under FSDP2 the final save gathers LoRA adapters (one at a
time, onto rank 0) and no full fine-tuned weights; `build_policy_folder` assembles those later in one process
(which `mmrl eval` / `export` need whole anyway).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import shutil
import tempfile
import uuid

import torch

from mmrl import checkpoint_state as cs
from mmrl.config import SHARDED, to_dict
from mmrl.parallel.shards import unsharded
from mmrl.errors import ConfigError, DamagedCheckpoint, MissingFile

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
    share(tmp)
    old = None
    if os.path.exists(path):
        old = tempfile.mkdtemp(prefix="." + os.path.basename(path) + ".old-", dir=parent)
        os.replace(path, os.path.join(old, "x"))
    os.replace(tmp, path)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (os.umask sets it for a moment, when another
    thread's new file would get mode 0666)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1], 8) for ln in f if ln.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
        return mask


def share(folder: str) -> None:
    """Give every file and folder under `folder` (itself included) the permissions the user's umask allows (files
    0o666 & ~umask, folders 0o777 & ~umask; bits already set are kept): safetensors 0.8 writes its files owner-only
    (0600) and mkdtemp its folders 0700, whatever the umask, so teammates on a shared cluster could not read trained
    weights. Links are left alone (a hard link's other name may be a base model's file), and so is a file this
    process does not own (another node's rank wrote it: chmod is not allowed)."""
    mask = _umask()
    for root, dirs, files in os.walk(folder):
        paths = [(os.path.join(root, d), 0o777) for d in dirs] + [(os.path.join(root, f), 0o666) for f in files]
        for path, allowed in paths + ([(folder, 0o777)] if root == folder else []):
            st = os.lstat(path)
            want = st.st_mode & 0o7777 | allowed & ~mask
            if want == st.st_mode & 0o7777 or os.path.islink(path) or (st.st_nlink > 1 and not os.path.isdir(path)):
                continue
            try:
                os.chmod(path, want)
            except PermissionError:
                pass


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


def _last_save(tr) -> bool:
    """Whether this save ends the run (Trainer.fit's stop rule): it writes the policy/ export."""
    t = tr.cfg.train
    return tr.iteration >= t.iterations or (t.time_budget_min > 0 and tr.elapsed_min >= t.time_budget_min)


def save_trainer(tr) -> str:
    """checkpoints/iter-N of trainer `tr` (mmrl.trainer.Trainer); every rank calls it. Rank 0 makes the folder
    (atomically: it appears complete or not at all) and every rank writes its own shards into it, so the ranks of
    several nodes need a shared log.out_dir (`check_shared_run_dir`). Each rank hashes what it wrote; rank 0 writes
    the manifest last, then all check that their replicated parameters agree."""
    path = os.path.join(tr.cfg.log.out_dir, "checkpoints", f"iter-{tr.iteration:06d}")
    fsdp = tr.dist.world > 1 and tr.cfg.train.parallel in SHARDED
    main = tr.dist.main
    if main:
        remove_stale(os.path.dirname(path))
    tr.dist.reshard()  # FSDP2: parameters a forward left gathered (the root's) go back to their shards first
    with contextlib.ExitStack() as stack:
        tmp = tr.dist.broadcast_object(stack.enter_context(atomic_dir(path)) if main else None)
        cs.save_state(tr, os.path.join(tmp, cs.STATE))
        lora = getattr(tr.policy, "lora", False)
        if _last_save(tr) and (lora or not fsdp):  # the export: EMA weights when enabled. Under FSDP rank 0 gathers
            # the adapters one at a time (small); a fully fine-tuned model is never whole on one rank: its policy/ is
            # built from the shards in one process when first asked for (policy_folder)
            with tr.ema_weights(), unsharded(tr.policy.trainable_modules() if fsdp else [], main,
                                             lambda p: p.requires_grad):
                if main:
                    tr.policy.save_pretrained(os.path.join(tmp, "policy"))
        if main:
            state = {"iteration": tr.iteration, "elapsed_min": tr.elapsed_min, "timed_evals": tr.timed_evals,
                     "eval_start": tr.eval_start, "metrics_lines": tr.logger.lines, "world": tr.dist.world,
                     "parallel": tr.cfg.train.parallel, "ema": tr.ema is not None,
                     "torch_rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(state, f, indent=1)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(to_dict(tr.cfg), f, indent=2)
        tr.dist.barrier()  # every file is written before any is hashed
        entries = {}
        for part in tr.dist.gather_list([cs.hash_mine(tmp, tr.dist.rank, tr.dist.world)], every_rank=True):
            entries.update(part)
        if main:
            cs.write_manifest(tmp, entries)
    if main:
        prune(os.path.dirname(path), tr.cfg.log.keep_checkpoints)
    tr.dist.barrier()
    tr.dist.check_in_sync(tr.params)
    return path


def newest_intact(folder: str, dist=None, using: str = "resuming from") -> str | None:
    """The newest checkpoint under `folder` whose files match its manifest; a damaged newer one is skipped with a
    warning naming it, what is wrong, and the one used instead. None when there is no checkpoint; RuntimeError
    (DamagedCheckpoint) when none is intact. dist (mmrl.parallel.distributed.Distributed): every rank calls it, each verifies its share of the
    files and all get the same answer."""
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    if rank == 0:
        remove_stale(folder)
    found = checkpoints(folder)
    found = dist.broadcast_object(found) if dist is not None else found  # rank 0's listing: every rank tries the same
    failures = []
    for path in found:
        problems = cs.verify(path, rank, world)
        problems = dist.gather_list(problems, every_rank=True) if dist is not None else problems
        if not problems:
            if failures and rank == 0:
                log.warning("damaged checkpoint(s) skipped: %s; %s %s instead", "; ".join(failures), using, path)
            return path
        failures.append(f"{path}: {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    if failures:
        raise DamagedCheckpoint("no intact checkpoint to resume from: " + "; ".join(failures) + ". Start a new run "
                           "(--overwrite, or another log.out_dir)")
    return None


def resume_trainer(tr) -> bool:
    """Load the newest intact checkpoint in log.out_dir into trainer `tr` (weights, EMA, optimizer, RNG, iteration,
    elapsed minutes, the start evaluation), resharded to this run's processes and parallelism, and cut its logs
    back to that checkpoint; False when there is none."""
    path = newest_intact(os.path.join(tr.cfg.log.out_dir, "checkpoints"), tr.dist)
    if path is None:
        return False
    state = json.load(open(os.path.join(path, "trainer_state.json")))
    tr.dist.reshard()
    cs.load_state(tr, os.path.join(path, cs.STATE), ema=state["ema"] and tr.ema is not None)
    if tr.ema is not None and not state["ema"]:  # EMA switched on at resume: it starts from the weights
        with torch.no_grad():
            for e, p in zip(tr.ema.shadow, tr.params):
                e.copy_(p)
    rng = torch.frombuffer(bytearray(base64.b64decode(state["torch_rng"])), dtype=torch.uint8)
    torch.set_rng_state(rng)
    tr.iteration = state["iteration"]
    tr.elapsed_min = state["elapsed_min"]
    tr.timed_evals = state["timed_evals"]
    tr.eval_start = state["eval_start"]
    tr.reopen_logger(resume=(state["metrics_lines"], tr.iteration))
    log.info("resumed from %s at iteration %d (written by %d process(es), train.parallel=%s)", path, tr.iteration,
             state["world"], state["parallel"])
    return True


def read_trainer_state(path: str) -> dict:
    """A checkpoint's trainer state in one process, whole tensors: trainer_state.json's keys plus "params" and "ema"
    (lists in the optimizer's order; ema None without EMA) and "names". For tools and tests; resuming reshards."""
    state = json.load(open(os.path.join(path, "trainer_state.json")))
    folder = os.path.join(path, cs.STATE)
    raw = cs.read_tensors(folder, "model")
    state["names"] = list(raw)  # DCP's metadata keeps the save order: the optimizer's
    state["params"] = list(raw.values())
    state["ema"] = list(cs.read_tensors(folder, "ema").values()) if state["ema"] else None
    return state


# ----------------------------------------------------------------------------------- eval / sample / export
def policy_folder(checkpoint: str) -> str | None:
    """The policy folder (policy/ with mmrl_policy.json) of a run folder (its newest intact checkpoint), a trainer
    checkpoint or a policy folder; None for a plain model folder. A damaged checkpoint is refused with one line
    naming what is wrong and an intact one to use instead; a checkpoint without policy/ gets one, built from its
    state/ (EMA weights) and config.json. A checkpoint without manifest.json but with policy/ (written by mmrl
    before manifests, or by hand) is taken as it is."""
    runs = os.path.join(checkpoint, "checkpoints")
    newest = latest(runs)
    if newest is not None:
        manifest = os.path.isfile(os.path.join(newest, cs.MANIFEST))
        checkpoint = newest_intact(runs, using="using") if manifest else newest
    if not os.path.isdir(checkpoint):
        hint = " (a run folder: `mmrl train CONFIG` writes it there first)" if checkpoint.startswith("runs") else ""
        raise MissingFile(f"checkpoint {checkpoint!r} does not exist{hint}; give runs/NAME, runs/NAME/checkpoints/"
                          f"iter-N, its policy/ folder, or a model folder")
    if os.path.isfile(os.path.join(checkpoint, "mmrl_policy.json")):  # a policy folder: a checkpoint's, or alone
        parent = os.path.dirname(os.path.normpath(checkpoint))
        if os.path.basename(os.path.normpath(checkpoint)) == "policy" and os.path.isfile(
                os.path.join(parent, cs.MANIFEST)):
            _check_intact(parent)
        return checkpoint
    policy, state = os.path.join(checkpoint, "policy"), os.path.isdir(os.path.join(checkpoint, cs.STATE))
    if not state and not os.path.isfile(os.path.join(policy, "mmrl_policy.json")):
        return None  # a plain model folder
    if state or os.path.isfile(os.path.join(checkpoint, cs.MANIFEST)):
        _check_intact(checkpoint)
    if not os.path.isfile(os.path.join(policy, "mmrl_policy.json")):
        build_policy_folder(checkpoint)
    return policy


def _check_intact(checkpoint: str) -> None:
    problems = cs.verify(checkpoint)
    if problems:
        parent = os.path.dirname(os.path.normpath(checkpoint))
        try:
            other = newest_intact(parent)
        except DamagedCheckpoint:
            other = None
        instead = f"; {other} is intact" if other else "; no other checkpoint of this run is intact"
        raise DamagedCheckpoint(f"checkpoint {checkpoint} is damaged: {'; '.join(problems[:3])}{instead}")


def build_policy_folder(checkpoint: str) -> str:
    """Write checkpoint/policy/ (atomically) from its state/ and config.json: the policy that config builds, in one
    process, with the saved EMA weights (the raw ones without EMA). Loads the whole model on this host."""
    from mmrl import compose

    cfg = compose.load_config(os.path.join(checkpoint, "config.json"), ["train.parallel=none"])
    policy = compose.build_policy(cfg)
    cs.load_into_policy(policy, os.path.join(checkpoint, cs.STATE), "ema")
    log.info("writing %s/policy from its sharded state", checkpoint)
    with atomic_dir(os.path.join(checkpoint, "policy")) as tmp:
        policy.save_pretrained(tmp)
    return os.path.join(checkpoint, "policy")


# ------------------------------------------------------------------------------------------- several nodes
def check_shared_run_dir(out_dir: str, dist, multinode: bool | None = None) -> None:
    """Refuse a multi-node run whose log.out_dir is not one folder every rank sees: each rank writes its own
    checkpoint shards into the folder rank 0 made, so node-local folders would scatter a checkpoint over nodes.
    Rank 0 writes a token file, then every rank looks for it; all ranks raise together when any misses it.
    multinode: None decides by LOCAL_WORLD_SIZE < WORLD_SIZE (torchrun's variables); every rank must call it."""
    if multinode is None:
        multinode = int(os.environ.get("LOCAL_WORLD_SIZE", dist.world)) < dist.world
    if dist.world == 1 or not multinode:
        return
    token = None
    if dist.main:
        os.makedirs(out_dir, exist_ok=True)
        token = f".shared-check-{uuid.uuid4().hex}"
        with open(os.path.join(out_dir, token), "w") as f:
            f.write(token)
    token = dist.broadcast_object(token)
    dist.barrier()
    path = os.path.join(out_dir, token)
    sees = os.path.isfile(path) and open(path).read() == token
    blind = [r for r, ok in enumerate(dist.gather_list([sees], every_rank=True)) if not ok]
    if dist.main:
        os.remove(path)
    if blind:
        raise ConfigError(f"log.out_dir={out_dir!r} is not shared: rank(s) {blind} cannot see the file rank 0 wrote "
                           f"there. Each rank writes its own checkpoint shards into that folder, so a run on several "
                           f"nodes needs log.out_dir on a filesystem every node mounts (NFS, Lustre, a cloud volume) "
                           f"at the same path")
