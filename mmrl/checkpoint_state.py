"""A trainer's tensors in torch.distributed.checkpoint (DCP) form, and the manifest that proves a checkpoint whole.

Names. Every trained tensor is keyed by its parameter name in a ModuleList of the policy's trained modules without
their DDP wrappers (`trained_modules`): "0.transformer_blocks.1.attn.to_q.weight" (LoRA:
"...to_q.lora_A.default.weight"). FSDP2 shards in place and keeps the names, so the keys are the same under one
process, DDP and FSDP2, on any number of ranks: DCP reshards on load because the destination state dict (DTensors
laid out for this run, or plain tensors) says what each rank wants, and each rank reads only those byte ranges.

Layout of checkpoints/iter-N/state/ (DCP's FileSystemWriter: one __R_0.distcp per rank R, plus .metadata):
    model.NAME   the raw trained weights (once)
    ema.NAME     the EMA shadow (train.ema_decay > 0; once)
    sampling.NAME  the soft-updated sampling policy (train.sampling_ema; once)
    optim.*      AdamW's moments and steps by parameter name (get_optimizer_state_dict)

Integrity: manifest.json, written last, lists every file with its size and sha256. sha256 because hashlib's runs
at ~1.7 GB/s on the dev CPU (blake2b 0.8, md5 0.7; crc32 3.9 GB/s but only 32 bits; xxhash is not in the pinned
set) and `sha256sum` checks it by hand. Each rank hashes the shards it wrote, in parallel, so a save of S bytes on
W ranks costs ~S / W / 1.7 GB/s; verification splits the files over the ranks the same way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from mmrl.errors import ConfigError

MANIFEST = "manifest.json"
STATE = "state"  # the DCP folder inside a checkpoint
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # FileSystemWriter's per-rank shard files


@contextlib.contextmanager
def _one_process(alone: bool):
    """DCP warns on every single-process save / load that it assumes one process: that is the intent here."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def trained_modules(policy) -> torch.nn.ModuleList:
    """The policy's trained modules without DDP wrappers, in one ModuleList: the namespace of every DCP key."""
    from torch.nn.parallel import DistributedDataParallel

    return torch.nn.ModuleList([m.module if isinstance(m, DistributedDataParallel) else m
                                for m in policy.trainable_modules()])


def param_names(modules: torch.nn.Module, params: list[torch.Tensor]) -> list[str]:
    """The name of each of `params` (the optimizer's order) in `modules`."""
    names = {id(p): n for n, p in modules.named_parameters()}
    missing = [i for i, p in enumerate(params) if id(p) not in names]
    if missing:
        raise RuntimeError(f"trained parameters {missing[:5]} belong to no module of policy.trainable_modules(): "
                           f"every trainable parameter must live in one of them (checkpoints key tensors by name)")
    return [names[id(p)] for p in params]


def trainer_state_dict(tr, ema: bool, sampling: bool = False) -> dict:
    """The DCP state dict of trainer `tr`: its live tensors (local shards under FSDP2), so dcp.save writes them and
    dcp.load fills them in place. ema / sampling: include the EMA shadow / the sampling policy (train.sampling_ema)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    modules = trained_modules(tr.policy)
    names = param_names(modules, tr.params)
    sd = {"model": dict(zip(names, tr.params)), "optim": get_optimizer_state_dict(modules, tr.opt)}
    if ema:
        sd["ema"] = dict(zip(names, tr.ema.shadow))
    if sampling:
        sd["sampling"] = dict(zip(names, tr.sampling.shadow))
    return sd


def save_state(tr, folder: str) -> None:
    """Every rank writes its shards of `tr`'s weights, EMA and optimizer state to `folder` (DCP); collective."""
    with torch.no_grad(), _one_process(tr.dist.world == 1):
        dcp.save(trainer_state_dict(tr, tr.ema is not None, tr.sampling is not None),
                 storage_writer=FileSystemWriter(folder),
                 process_group=tr.dist.cpu_group, no_dist=tr.dist.world == 1)


def load_state(tr, folder: str, ema: bool) -> None:
    """Fill `tr`'s weights, optimizer state and (ema: saved and wanted) EMA shadow from the DCP `folder`, resharded
    to this run's layout; collective. The sampling policy (train.sampling_ema) is loaded when saved, else it starts
    from the loaded weights."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    sampling = tr.sampling is not None and any(k.startswith("sampling.") for k in keys)
    sd = trainer_state_dict(tr, ema, sampling)
    # a parameter that never had a gradient before the save (Qwen-Image's last block: its text stream's output is
    # discarded) has no optimizer state there, but torch gives every parameter one here: leave it stateless, as the
    # uninterrupted run has it (Adam starts it at its first gradient)
    saved = {k[len("optim.state."):].rsplit(".", 1)[0] for k in keys if k.startswith("optim.state.")}
    sd["optim"]["state"] = {n: v for n, v in sd["optim"]["state"].items() if n in saved}
    with torch.no_grad(), _one_process(tr.dist.world == 1):
        dcp.load(sd, storage_reader=FileSystemReader(folder), process_group=tr.dist.cpu_group,
                 no_dist=tr.dist.world == 1)
    set_optimizer_state_dict(trained_modules(tr.policy), tr.opt, sd["optim"], options=StateDictOptions(strict=False))
    if tr.sampling is not None and not sampling:
        for s, p in zip(tr.sampling.shadow, tr.params):
            s.copy_(p.detach())


def read_tensors(folder: str, prefix: str) -> dict[str, torch.Tensor]:
    """{name: whole tensor} of every tensor saved under `prefix` ("model", "ema") in the DCP `folder`, read in this
    process alone (no process group): for tools, tests and building a policy/ folder, not for resuming."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(folder).read_metadata().state_dict_metadata
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
          if k.startswith(prefix + ".") and isinstance(m, TensorStorageMetadata)}
    if not sd:
        raise ValueError(f"{folder} holds no '{prefix}' tensors")
    with _one_process(True):
        dcp.load(sd, storage_reader=FileSystemReader(folder), no_dist=True)
    return {k[len(prefix) + 1:]: v for k, v in sd.items()}


def load_into_policy(policy, folder: str, which: str = "ema") -> None:
    """Copy the saved `which` weights ("ema", else "model" when the run had no EMA) into a single-process policy
    built from the checkpoint's config (its trainable parameters, by name)."""
    modules = trained_modules(policy)
    params = list(policy.trainable_parameters())
    names = param_names(modules, params)
    try:
        saved = read_tensors(folder, which)
    except ValueError:
        saved = read_tensors(folder, "model")
    missing = [n for n in names if n not in saved]
    if missing:
        raise ConfigError(f"{folder}: no saved weights for {missing[:3]} ...: the checkpoint was trained with another "
                          f"model or model.lora settings than its config.json builds")
    with torch.no_grad():
        for n, p in zip(names, params):
            p.copy_(saved[n])


# --------------------------------------------------------------------------------------------- integrity
def sha256(path: str, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def files(folder: str) -> list[str]:
    """Every file under `folder` (relative paths, sorted) but the manifest and config.json: the run's config is a
    record people read and may edit (a key renamed by a newer mmrl); resuming takes the config it is given."""
    out = [os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs]
    return sorted(f for f in out if f not in (MANIFEST, "config.json"))


def hash_mine(folder: str, rank: int, world: int) -> dict[str, dict]:
    """{relative path: {size, sha256}} of the files rank `rank` hashes: the DCP shards it wrote, and on rank 0 every
    other file (DCP's .metadata, trainer_state.json, config.json, policy/)."""
    out = {}
    for rel in files(folder):
        m = _RANK_FILE.search(rel)
        if (int(m.group(1)) if m else 0) % world == rank:
            path = os.path.join(folder, rel)
            out[rel] = {"size": os.path.getsize(path), "sha256": sha256(path)}
    return out


def write_manifest(folder: str, entries: dict[str, dict]) -> None:
    """manifest.json: the last file of a save (a checkpoint without it never finished)."""
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump({"hash": "sha256", "files": entries}, f, indent=1, sort_keys=True)


def verify(folder: str, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with checkpoint `folder` against its manifest (empty: intact): missing, resized or altered
    files. Rank r checks every world-th file from r, so a collective check reads each file once."""
    try:
        listed = json.load(open(os.path.join(folder, MANIFEST)))["files"]
    except FileNotFoundError:
        return [f"{MANIFEST} is missing (the save did not finish, or mmrl before sharded checkpoints wrote it)"]
    except (ValueError, KeyError) as e:
        return [f"{MANIFEST} does not parse ({e})"]
    problems = []
    for rel in sorted(listed)[rank::world]:
        want, path = listed[rel], os.path.join(folder, rel)
        if not os.path.isfile(path):
            problems.append(f"{rel} is missing")
        elif os.path.getsize(path) != want["size"]:
            problems.append(f"{rel} is {os.path.getsize(path)} bytes, the manifest says {want['size']}")
        elif sha256(path) != want["sha256"]:
            problems.append(f"{rel} does not match its sha256 in the manifest")
    return problems
