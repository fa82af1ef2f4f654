"""Several processes, one training loop: data-parallel rollouts and DDP or FSDP2 training.

Launch any config on several processes (the README has the recipes):

    accelerate launch --multi_gpu --num_processes 8 -m mmrl.cli train CONFIG train.parallel=ddp
    torchrun --nproc_per_node 8 -m mmrl.cli train CONFIG train.parallel=fsdp

How the work is split. Every rank draws the same prompts (same seeds). The N = B * G rows of an iteration
are cut into `world` contiguous ranges; rank r samples rows [N r / world, N (r + 1) / world), so a group may
span ranks. A row's noise is seeded by its global index, so the rows are the ones a single process would
sample. Rewards are scored where the rows are, then all-gathered: advantages use whole groups on every rank.
Minibatches are the single-process minibatches (one global permutation), each rank training its rows of them;
losses are normalized by the global counts, and gradients are averaged across ranks by DDP (bucketed
all-reduce during backward) or FSDP2 (`fully_shard`: parameters, gradients and optimizer state sharded).

Process groups come from accelerate's `PartialState` (NCCL on GPUs, gloo on CPU with ACCELERATE_USE_CPU=true
or `accelerate launch --cpu` semantics). `check_in_sync` compares a parameter checksum across ranks and raises
when ranks drifted apart (a launcher that started processes without a process group trains them separately).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


class Distributed:
    """rank / world / device of this process, and the collectives the trainer needs. world == 1: no-ops."""

    def __init__(self, parallel: str = "none"):
        self.parallel = parallel
        self.rank, self.world = 0, 1
        self.device = torch.device("cpu")
        if parallel != "none" and launched():
            from accelerate import PartialState

            cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
            state = PartialState(cpu=cpu)
            if not dist.is_initialized() or dist.get_world_size() != int(os.environ["WORLD_SIZE"]):
                raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but no process group of that size: launch "
                                   f"with torchrun or `accelerate launch --multi_gpu` (on CPU set ACCELERATE_USE_CPU=true)")
            self.rank, self.world, self.device = state.process_index, state.num_processes, state.device
        elif launched():
            raise RuntimeError(f"started as one of WORLD_SIZE={os.environ['WORLD_SIZE']} processes with "
                               f"train.parallel=none: every process would train alone. Set train.parallel=ddp or fsdp")
        elif parallel != "none":
            log.warning("train.parallel=%s in a single process: nothing to parallelize", parallel)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def rows(self, n: int) -> torch.Tensor:
        """This rank's contiguous share of n rows."""
        return torch.arange(n * self.rank // self.world, n * (self.rank + 1) // self.world)

    def check_config(self, cfg) -> None:
        """Refuse what several processes do not support yet, naming the fix."""
        from mmrl.algorithms import REWARD_SHAPINGS

        contrast = getattr(REWARD_SHAPINGS[cfg.algo.reward_shaping], "needs_contrast", False)
        if cfg.algo.dynamic_sampling or cfg.reward.workers or cfg.tree.split_steps or cfg.train.micro_batch or contrast:
            # micro-batches: ranks would run different numbers of backward passes (DDP / FSDP collectives hang)
            raise ValueError("several processes do not support algo.dynamic_sampling, reward.workers, tree "
                             "rollouts, train.micro_batch or contrast shapings (tgrpo) yet: turn them off, or run "
                             "in one process")
        n = cfg.train.prompts_per_iter * cfg.train.group_size
        if n < self.world:
            raise ValueError(f"prompts_per_iter * group_size = {n} rows for {self.world} processes")

    def sample(self, policy, examples: list[dict], group_size: int, gen: torch.Generator):
        """One group per example; with several processes, this rank's share: its contiguous range of the B * G
        rows (policies that sample by row) or of the B groups (global group ids either way)."""
        if self.world == 1:
            return policy.sample(examples, group_size, gen)
        if policy.samples_rows:
            return policy.sample(examples, group_size, gen, rows=self.rows(len(examples) * group_size))
        share = self.rows(len(examples))
        ro = policy.sample([examples[i] for i in share.tolist()], group_size, gen)
        ro.group_id = ro.group_id + int(share[0]) if len(share) else ro.group_id
        return ro

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate [n_r, ...] tensors of every rank in rank order (n_r may differ)."""
        return x if self.world == 1 else torch.cat(self.gather_list([x.cpu()])).to(x.device)

    def gather_list(self, items: list) -> list:
        """Concatenate every rank's list (picklable items) in rank order."""
        if self.world == 1:
            return items
        parts = [None] * self.world
        dist.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    def gather_rows(self, rollout, rewards: dict, valid: torch.Tensor):
        """Every rank's rows (rank order), as the advantages and the reward metrics read them: a Rollout of
        group ids, off-policy flags and categories (no actions), the rewards [N] and the valid mask [N]; and this
        rank's global rows [n] and every row's trained-action count [N] (the loss normalization)."""
        from mmrl.data import Rollout

        off = sum(self.gather(torch.tensor([len(rollout)])).tolist()[:self.rank])
        local_rows = torch.arange(off, off + len(rollout))
        row_actions = self.gather((rollout.action_mask & valid.unsqueeze(-1)).sum(-1))   # [N]
        n = row_actions.shape[0]
        everyone = Rollout(group_id=self.gather(rollout.group_id), old_log_prob=torch.zeros(n, 0),
                           action_mask=torch.zeros(n, 0, dtype=torch.bool),
                           examples=[{"category": c} for c in self.gather_list([e.get("category") for e in rollout.examples])],
                           outputs=None, is_offpolicy=self.gather(rollout.is_offpolicy))
        return everyone, {k: self.gather(v) for k, v in rewards.items()}, self.gather(valid), local_rows, row_actions

    def wrap(self, module: torch.nn.Module, mixed_precision: str = "no") -> torch.nn.Module:
        """DDP: the module wrapped (attributes still reach it); FSDP2: the module sharded in place."""
        if self.world == 1 or self.parallel == "none":
            return module
        if self.parallel == "ddp":
            return _DDP(module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                        forward_sync_buffers=False)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if mixed_precision == "bf16" else MixedPrecisionPolicy()
        for blk in _blocks(module):  # each transformer block its own unit: params all-gathered one block at a time
            fully_shard(blk, mp_policy=mp)
        fully_shard(module, mp_policy=mp)
        return module

    def check_in_sync(self, params: list[torch.Tensor], what: str = "parameters") -> None:
        """Raise if this rank's parameters differ from rank 0's (checksum and a weighted checksum)."""
        if self.world == 1:
            return
        with torch.no_grad():
            flat = [full(p).double().flatten() for p in params]
            v = torch.stack([sum(f.sum() for f in flat), sum((f * torch.arange(1, f.numel() + 1, dtype=f.dtype)
                                                              .remainder(97)).sum() for f in flat)])
        ref = v.clone()
        dist.broadcast(ref, 0)
        bad = torch.tensor([float(not torch.allclose(v, ref, rtol=1e-9, atol=1e-9))])
        dist.all_reduce(bad)
        if bad.item():
            raise RuntimeError(f"ranks are out of sync: {what} differ from rank 0's on {int(bad.item())} rank(s). "
                               f"Gradients are not being averaged: check train.parallel and the launcher")

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    @contextlib.contextmanager
    def main_first(self):
        """Rank 0 runs the block first (e.g. writes a dataset or world to disk), then the others."""
        if not self.main:
            self.barrier()
        yield
        if self.main:
            self.barrier()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def autocast(self, mixed_precision: str, policy):
        """train.mixed_precision=bf16: the training forward under bf16 autocast (FSDP2 instead computes in bf16
        through its MixedPrecisionPolicy); log-probs and the loss are computed in fp32 from its outputs."""
        if mixed_precision != "bf16" or (self.parallel == "fsdp" and self.world > 1):
            return contextlib.nullcontext()
        return torch.autocast(torch.device(policy.device).type, dtype=torch.bfloat16)

    def close(self) -> None:
        """End of a run: every rank waits for the others, then the process group is destroyed (a rank that exits
        while another still talks to it can abort the whole job at teardown)."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


@contextlib.contextmanager
def unsharded(modules: list[torch.nn.Module]):
    """Within the block, the FSDP2-sharded parameters of `modules` are replaced by plain full tensors (all ranks
    must enter: each is all-gathered, in the same order everywhere), so save_pretrained writes whole tensors;
    the sharded parameters are put back afterwards."""
    sharded = [(sub, name, p) for mod in modules for sub in mod.modules()
               for name, p in list(sub._parameters.items()) if p is not None and hasattr(p, "full_tensor")]
    with torch.no_grad():
        whole = [torch.nn.Parameter(p.full_tensor().detach().clone(), requires_grad=p.requires_grad)
                 for _, _, p in sharded]
    for (sub, name, _), w in zip(sharded, whole):
        sub._parameters[name] = w
    try:
        yield
    finally:
        for sub, name, p in sharded:
            sub._parameters[name] = p


_BLOCK_LISTS = ("layers", "blocks", "transformer_blocks", "single_transformer_blocks")


def _blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a model: the items of its outermost ModuleLists named like layers / blocks
    (diffusers transformer_blocks, transformers model.layers, vision blocks ...)."""
    found, taken = [], []
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in _BLOCK_LISTS:
            if not any(name.startswith(t + ".") for t in taken):
                taken.append(name)
                found.extend(m)
    return found


def shard_like(full_tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full_tensor` laid out like `like`: this rank's shard when `like` is an FSDP2 DTensor, else itself."""
    if hasattr(like, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full_tensor.to(like.dtype), like.device_mesh, like.placements)
    return full_tensor


def local_state(opt_state: dict) -> dict:
    """An optimizer state dict with each DTensor replaced by this rank's local shard (plain tensors load with
    weights_only=True); `from_local_state` reverses it."""
    return {**opt_state, "state": {i: {k: v.to_local() if hasattr(v, "to_local") else v for k, v in st.items()}
                                   for i, st in opt_state["state"].items()}}


def from_local_state(opt_state: dict, params: list[torch.Tensor]) -> dict:
    """Local shards back into DTensors laid out like their parameters (optimizer state ids = param order)."""
    from torch.distributed.tensor import DTensor

    def wrap(v, p):
        if hasattr(p, "device_mesh") and isinstance(v, torch.Tensor) and v.shape == p.to_local().shape and v.dim() > 0:
            return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
        return v

    return {**opt_state, "state": {i: {k: wrap(v, params[int(i)]) for k, v in st.items()}
                                   for i, st in opt_state["state"].items()}}


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP2-sharded DTensor) parameter."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


class _DDP(torch.nn.parallel.DistributedDataParallel):
    """DDP whose unknown attributes (config, adapters, save_pretrained ...) are the wrapped module's."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)
