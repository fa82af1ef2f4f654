"""Several processes, one training loop: data-parallel rollouts and DDP, FSDP2 or HSDP training.

Launch any config on several processes (docs/scale-out.md has the recipes, multi-node included):

    torchrun --nproc_per_node 8 -m mmrl.cli train CONFIG train.parallel=ddp      # or fsdp, hsdp
    accelerate launch --multi_gpu --num_processes 8 -m mmrl.cli train CONFIG train.parallel=fsdp

How the work is split: by whole groups. Every rank draws the same prompts (same seeds). The B groups of an
iteration are cut into `world` contiguous ranges; rank r samples groups [B r / world, B (r + 1) / world) whole, so
whatever needs a group (advantages' statistics, pairwise tournaments, trees, contrast rollouts) finds it on one
rank. A row's noise is seeded by its global index, so the rows are the ones a single process samples. Rewards
are scored where the rows are, then all-gathered with their global group ids and put in the single-process
order: advantages and decisions (dynamic sampling) are computed from the same numbers on every rank.
Minibatches are the single-process minibatches (stratified by group: a rank holds the same share of each), each
rank training its rows of them; losses are normalized by the global counts, and gradients are averaged across
ranks by DDP or FSDP2 (`fully_shard`; hsdp: sharded within a node, replicated across nodes). Every rank runs the same number of forwards and backwards (the most any rank
needs, padded with zero-weight passes of one micro-batch), and gradients are synchronized only at the last backward
of an optimizer step (`no_sync` / `set_requires_gradient_sync(False)`).

Collectives. Tensors of the trained networks travel on the device group (`self.group`: NCCL on GPUs, gloo on CPU)
on the process's device. Bookkeeping (rewards, group ids, statistics, decisions, checksums) travels on an
explicit CPU gloo group (`self.cpu_group`): it is small, and NCCL has no CPU backend. No mmrl code calls a
collective on the default group with a CPU tensor (tests/test_distributed.py runs the trainer under a default
group without a CPU backend, as NCCL is).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os

import torch
import torch.distributed as dist

from mmrl.config import SHARDED
from mmrl.errors import ConfigError
from mmrl.parallel.shards import transformer_blocks

log = logging.getLogger(__name__)


def launched() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_parallel_config(cfg, world: int, folder: bool = True) -> None:
    """Refuse, before any weight loads, what `world` processes cannot run, naming the key and the fix (also run
    by `mmrl validate CONFIG --nproc N`). folder: also read model.path's configs (context parallelism)."""
    from mmrl.policy.kinds import kind_of

    t, kind = cfg.train, kind_of(cfg.model.policy)
    cp = t.context_parallel
    if cp > 1:
        from mmrl.parallel.context_parallel import check_cp, check_model_folder

        if world < cp:
            raise ConfigError(f"train.context_parallel={cp} splits each forward over {cp} processes; launch a multiple "
                              f"of {cp} (torchrun --nproc_per_node {cp}; mmrl validate CONFIG --nproc {cp}) or set "
                              f"train.context_parallel=1")
        check_cp(cp, world, kind=t.cp_kind)
        if folder:
            from mmrl.policy.base import resolve_model_path

            try:
                path = resolve_model_path(cfg.model.path)
            except FileNotFoundError:
                path = cfg.model.path  # check_model_folder says what is missing
            check_model_folder(path, cp, t.cp_kind, cfg.model.sample_size, cfg.model.num_frames)
    if world <= 1:
        return
    if t.parallel == "none":
        raise ConfigError(f"train.parallel=none on {world} processes: every process would train alone. Set "
                          f"train.parallel=ddp (replicated weights) or fsdp (sharded weights; hsdp: within a node)")
    if t.parallel == "hsdp" and t.shard_size and world % t.shard_size:
        raise ConfigError(f"train.shard_size={t.shard_size} does not divide the {world} processes: each shard group "
                          f"holds one copy of the weights. Set train.shard_size to a divisor of {world} (0 = a node)")
    if t.prompts_per_iter < world // cp:
        raise ConfigError(f"train.prompts_per_iter={t.prompts_per_iter} groups for {world // cp} data-parallel ranks "
                          f"({world} processes / train.context_parallel={cp}): ranks shard whole groups, so every rank "
                          f"needs one. Set train.prompts_per_iter >= {world // cp}")
    if kind is not None and kind.decodes and t.parallel in SHARDED and cfg.sampler.engine != "prefix_cache":
        raise ConfigError(f"train.parallel={t.parallel} for model.policy={kind.name} needs sampler.engine=prefix_cache "
                          f"(its decoding runs in lockstep across ranks, which FSDP's all-gathers need)")


class Distributed:
    """rank / world / device of this process, its groups, and the collectives the trainer needs. world == 1:
    every method is a no-op (or the identity)."""

    syncs = True  # the next backward synchronizes gradients across ranks (False inside no_sync)

    def __init__(self, parallel: str = "none", context_parallel: int = 1, cp_kind: str = "ulysses",
                 timeout_min: float = 30.0, shard_size: int = 0):
        self.parallel = parallel
        self.rank, self.world = 0, 1
        self.shard_size = 1  # ranks that share one copy of the trained weights (set below: fsdp all, hsdp a node's)
        self.timeout = datetime.timedelta(minutes=timeout_min)  # train.dist_timeout_min
        self.cp, self.cp_kind, self.mesh = context_parallel, cp_kind, None
        self.device = torch.device("cpu")
        self.group = self.cpu_group = None
        self.wrapped: list[torch.nn.Module] = []  # the DDP / FSDP2 modules (gradient sync is switched on them)
        if parallel != "none" and launched():
            from accelerate import PartialState

            from mmrl.preemption import restarted

            cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true")
            timeout = self.timeout  # (a group made earlier keeps its own)
            if not dist.is_initialized() and restarted() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                _init_restarted_group(cpu, timeout)
            state = PartialState(cpu=cpu, timeout=timeout)
            if not dist.is_initialized() or dist.get_world_size() != int(os.environ["WORLD_SIZE"]):
                raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but no process group of that size: launch "
                                   f"with torchrun or `accelerate launch --multi_gpu` (on CPU set ACCELERATE_USE_CPU=true)")
            self.rank, self.world, self.device = dist.get_rank(), dist.get_world_size(), state.device
            self.cpu_group = dist.new_group(backend="gloo", timeout=timeout)  # bookkeeping and object traffic
            # the trained networks' collectives: the default group when it serves this device (NCCL on GPUs, gloo
            # on CPU); else (a default group without a CPU backend while training on CPU, as in the tests) gloo
            self.group = None if _serves(self.device) else self.cpu_group
            self.shard_size = _shard_size(parallel, shard_size, self.world)
            if self.cp > 1:  # (dp, cp) mesh: the cp ranks of one dp row are adjacent and hold the same rows
                from mmrl.parallel.context_parallel import build_mesh

                self.mesh = build_mesh(self.cp, self.world, self.device.type)
        elif launched():
            raise RuntimeError(f"started as one of WORLD_SIZE={os.environ['WORLD_SIZE']} processes with "
                               f"train.parallel=none: every process would train alone. Set train.parallel=ddp or fsdp "
                               f"(or hsdp)")
        elif parallel != "none":
            log.warning("train.parallel=%s in a single process: nothing to parallelize", parallel)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel index: the cp ranks of one mesh row (train.context_parallel) share it."""
        return self.rank // self.cp

    @property
    def data_world(self) -> int:
        """Data-parallel ranks: world / train.context_parallel."""
        return self.world // self.cp

    def share(self, n: int) -> range:
        """This data rank's contiguous share of n items (groups, evaluation examples)."""
        return range(n * self.data_rank // self.data_world, n * (self.data_rank + 1) // self.data_world)

    # ------------------------------------------------------------------------------------------ sampling
    def sample(self, policy, examples: list[dict], group_size: int, gen: torch.Generator, first_group: int = 0,
               batch: int | None = None):
        """One group per example; with several processes, this rank's whole groups (a contiguous share). Group ids
        are global: example i of this call is group `first_group + i`. batch: the size of the whole batch whose groups
        first_group, first_group + 1, ... this call samples (reward.overlap_chunks samples a batch in chunks): a rank
        samples the groups its share of the whole batch holds, so chunking never moves a group to another rank; None:
        the call is the whole batch. Policies that sample by row draw every row's noise from its row index (`rows`),
        so a row is the same on any rank. Under FSDP every forward is a collective, so a rank with fewer groups
        samples copies of one of its groups (dropped afterwards) until every rank samples as many: the same number of
        forwards everywhere. A rank without a group of this call (a dynamic-sampling refill of fewer groups than
        ranks, a small chunk) still samples one copy and returns one row of it with group id -1 (never scored,
        trained or counted): the collective count stays equal, and the rank keeps a row for its padding passes."""
        if self.data_world == 1:  # one process, or every rank in one cp group: all rows, as one process samples them
            ro = policy.sample(examples, group_size, gen)
            ro.group_id = ro.group_id + first_group
            return ro
        base, whole = (0, len(examples)) if batch is None else (first_group, batch)

        def held(r: int) -> list[int]:  # the examples of this call in data rank r's share of the whole batch
            lo, hi = whole * r // self.data_world - base, whole * (r + 1) // self.data_world - base
            return list(range(max(lo, 0), min(hi, len(examples))))

        share = held(self.data_rank)
        most = max(len(held(r)) for r in range(self.data_world)) if self.parallel in SHARDED else 0
        pad = max(most - len(share), 0 if share else 1)  # a rank without a group of this call still samples one
        groups = share + [share[-1] if share else 0] * pad
        if policy.samples_rows:
            rows = torch.tensor([g * group_size + j for g in groups for j in range(group_size)], dtype=torch.long)
            ro = policy.sample(examples, group_size, gen, rows=rows)
        else:
            ro = policy.sample([examples[i] for i in groups], group_size, gen)
            ro.group_id = torch.tensor(groups, dtype=torch.long)[ro.group_id]
        if not share:  # one row of the padding copy, group id -1
            ro = ro.select(torch.tensor([0]))
            ro.group_id = torch.full((1,), -1, dtype=torch.long)
            return ro
        if pad:  # the first G rows of each of this rank's groups; later rows of a group are padding copies
            mine, taken, keep = set(share), {}, []
            for i, g in enumerate(ro.group_id.tolist()):
                if g in mine and taken.get(g, 0) < group_size:
                    taken[g] = taken.get(g, 0) + 1
                    keep.append(i)
            ro = ro.select(torch.tensor(keep, dtype=torch.long))
        ro.group_id = ro.group_id + first_group
        return ro

    # ----------------------------------------------------------------------------- bookkeeping (CPU group)
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate [n_r, ...] tensors of every rank in rank order (n_r may differ); the result is on x's
        device. Travels on the CPU group."""
        if self.world == 1:
            return x
        return torch.cat([p.to(x.device) for p in self.gather_list([x.detach().cpu()])])

    def gather_list(self, items: list, every_rank: bool = False) -> list:
        """Concatenate every data rank's list (picklable items) in rank order: the ranks of a cp group hold the
        same rows, so only its first rank's list is kept (every_rank: all of them)."""
        if self.world == 1:
            return items
        parts = [None] * self.world
        dist.all_gather_object(parts, items, group=self.cpu_group)
        return [x for r, part in enumerate(parts) if every_rank or r % self.cp == 0 for x in part]

    def broadcast_object(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def max_int(self, n: int) -> int:
        """The largest of every rank's n (e.g. how many forwards every rank must run)."""
        if self.world == 1:
            return n
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return int(t.item())

    def all_true(self, flag: bool) -> bool:
        """True when `flag` is true on every rank (e.g. every rank is done decoding)."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return bool(t.item())

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """Each flag true when it is true on some rank (e.g. which experts some rank's rows need)."""
        if self.world == 1:
            return list(flags)
        t = torch.tensor([int(f) for f in flags], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return [bool(f) for f in t.tolist()]

    def decide(self, elapsed_min: float, stop: bool) -> tuple[float, bool]:
        """One decision for every rank at an iteration boundary, in one collective: rank 0's clock (the minutes
        every time-based choice reads: time budget, timed evaluations, lr cooldown) and whether any rank was asked
        to stop (a signal). Ranks start and run at different speeds; deciding from each rank's own clock would send
        them down different branches (one evaluates or stops while another trains on: a hang, or weights that
        drift apart)."""
        if self.world == 1:
            return elapsed_min, stop
        t = torch.tensor([elapsed_min if self.main else 0.0, float(stop)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return float(t[0]), bool(t[1])

    def gather_rows(self, rollout, rewards: dict, valid: torch.Tensor, extras: tuple[str, ...] = ()):
        """Every rank's rows in the single-process order (by global group id; a group's rows stay in order), as
        credit assignment and the reward metrics read them, in one exchange: a Rollout of group ids, old log-probs,
        action masks, off-policy flags, categories and the named per-action `extras` (no outputs, no model inputs;
        [N, A] tensors right-padded to the widest rank's A), the rewards [N] and the valid mask [N]; and this rank's
        positions in that order [n]. Padding rows (group id -1) are left out."""
        from mmrl.data import Rollout

        real = (rollout.group_id >= 0).nonzero().squeeze(-1)
        mine = {"group_id": rollout.group_id[real], "old_log_prob": rollout.old_log_prob[real],
                "action_mask": rollout.action_mask[real], "is_offpolicy": rollout.is_offpolicy[real],
                "valid": valid[real], "category": [rollout.examples[i].get("category") for i in real.tolist()],
                **{f"extras/{k}": rollout.extras[k][real] for k in extras},
                **{f"rewards/{k}": v[real] for k, v in rewards.items()}}
        parts = self.gather_list([{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in mine.items()}])
        order = torch.sort(torch.cat([p["group_id"] for p in parts]), stable=True).indices  # rank -> single order
        where = torch.empty_like(order)
        where[order] = torch.arange(len(order))
        off = sum(len(p["group_id"]) for p in parts[:self.data_rank])
        local_rows = where[off:off + len(real)]

        def cat(key):  # every rank's values of `key`, in the single-process order
            # a reward key a rank lacks (its whole batch of that component failed: invalid rows) is zeros there
            ts = [p[key] if key in p else torch.zeros(len(p["group_id"])) for p in parts]
            if ts[0].dim() > 1:  # [n_r, A_r]: pad to the widest
                width = max(t.shape[1] for t in ts)
                ts = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in ts]
            return torch.cat(ts)[order]

        cats = [c for p in parts for c in p["category"]]
        everyone = Rollout(group_id=cat("group_id"), old_log_prob=cat("old_log_prob"), action_mask=cat("action_mask"),
                           examples=[{"category": cats[i]} for i in order.tolist()], outputs=None,
                           extras={k: cat(f"extras/{k}") for k in extras}, is_offpolicy=cat("is_offpolicy"))
        keys = sorted({k[len("rewards/"):] for p in parts for k in p if k.startswith("rewards/")})
        return everyone, {k: cat(f"rewards/{k}") for k in keys}, cat("valid"), local_rows

    @staticmethod
    def local_rows(mine, everyone, rows: torch.Tensor, adv: torch.Tensor, overall: torch.Tensor):
        """gather_rows reversed: this rank's rollout `mine` with the action masks credit assignment left in
        `everyone` (the single-process order), and its rows of the advantages [N] or [N, A] and rewards [N];
        `rows` [n] are its real rows' positions in that order. Padding rows (group id -1) get nothing."""
        real = (mine.group_id >= 0).nonzero().squeeze(-1)
        width = mine.action_mask.shape[1]
        mine.action_mask = torch.zeros_like(mine.action_mask)
        mine.action_mask[real] = everyone.action_mask[rows, :width]
        local_adv = torch.zeros((len(mine), *adv.shape[1:]), dtype=adv.dtype)
        local_adv[real] = adv[rows] if adv.dim() == 1 else adv[rows, :width]
        return mine, local_adv, torch.zeros(len(mine)).index_put_((real,), overall[rows])

    def mean_stats(self, stats: dict[str, list[tuple[float, int]]]) -> dict[str, float]:
        """Statistics kept as (sum, count) pairs, summed over every rank's pairs: sum / count (one set of numbers
        per run, the single-process one)."""
        merged: dict[str, list] = {}
        for part in self.gather_list([{k: (sum(x for x, _ in v), sum(c for _, c in v)) for k, v in stats.items()}]):
            for k, (x, c) in part.items():
                m = merged.setdefault(k, [0.0, 0])
                m[0], m[1] = m[0] + x, m[1] + c
        return {k: x / c if c else 0.0 for k, (x, c) in sorted(merged.items())}

    def check_in_sync(self, params: list[torch.Tensor], what: str = "parameters") -> None:
        """Raise if this rank's replicated parameters differ from rank 0's: a checksum and a position-weighted
        checksum, accumulated in fp64 one parameter at a time (nothing is materialized), compared across ranks.
        FSDP2 shards: under hsdp a rank's shards are compared with those of the rank holding the same shards on the
        first node (rank % shard_size); under fsdp they have no replica and are skipped."""
        replicated = [p for p in params if not hasattr(p, "to_local")]
        shards = [p.to_local() for p in params if hasattr(p, "to_local")] if self.parallel == "hsdp" else []
        if self.world == 1 or not (replicated or shards):
            return

        def checksums(ts: list[torch.Tensor]) -> torch.Tensor:  # [2] fp64
            v = torch.zeros(2, dtype=torch.float64)
            for t in ts:
                f = t.detach().flatten().double()
                w = torch.arange(1, f.numel() + 1, device=f.device).remainder_(97)
                v += torch.stack([f.sum(), (f * w).sum()]).cpu()
            return v

        with torch.no_grad():
            v = torch.cat([checksums(replicated), checksums(shards)])
        sums = torch.stack(self.gather_list([v], every_rank=True))          # [world, 4]
        twin = lambda r: torch.cat([sums[0, :2], sums[r % self.shard_size, 2:]])  # noqa: E731 - what rank r must hold
        bad = [r for r in range(self.world) if not torch.allclose(sums[r], twin(r), rtol=1e-9, atol=1e-9)]
        if bad:
            raise RuntimeError(f"ranks are out of sync: {what} differ from rank 0's on rank(s) {bad}. Either gradients "
                               f"are not averaged (check train.parallel and the launcher: a plain Accelerator() on a "
                               f"machine without GPUs runs each process alone) or the ranks took different steps "
                               f"(learning rates, skipped updates): that is a bug in mmrl, please report it")

    # -------------------------------------------------------------------------- the trained networks
    def wrap(self, module: torch.nn.Module, mixed_precision: str = "no") -> torch.nn.Module:
        """DDP: the module wrapped (attributes still reach it); FSDP2 / HSDP: the module sharded in place. DDP's
        gradients are views into its all-reduce buckets (`gradient_as_bucket_view`: no second gradient-sized buffer;
        the optimizer's zero_grad(set_to_none=True) drops the views and the next backward points them back)."""
        if self.world == 1 or self.parallel == "none":
            return module
        if self.parallel == "ddp":
            wrapped = _DDP(module, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                           forward_sync_buffers=False, process_group=self.group, gradient_as_bucket_view=True)
            self.wrapped.append(wrapped)
            return wrapped
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.shard_mesh()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if mixed_precision == "bf16" else MixedPrecisionPolicy()
        # FSDP units, all-gathered one at a time: each transformer block; in a model of few large blocks (each over
        # 1/16 of its parameters) also each block's large children (>= 1/8 of the block). Gathering a unit holds ~2-3x
        # the unit whole on every rank for a moment (the gathered buffer and its per-parameter copies; in backward the
        # unsharded gradients too): with 8 blocks that would add ~1/3 of the model to a rank's 1/world share.
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        total = count(module)
        for blk in transformer_blocks(module):
            if count(blk) > total / 16:
                for child in blk.children():
                    if count(child) >= count(blk) / 8:
                        fully_shard(child, mesh=mesh, mp_policy=mp)
            fully_shard(blk, mesh=mesh, mp_policy=mp)
        fully_shard(module, mesh=mesh, mp_policy=mp)
        self.wrapped.append(module)
        return module

    def shard_mesh(self):
        """The device mesh FSDP2 shards over, made once. fsdp: 1-D over every rank. hsdp: 2-D, dims ("replicate",
        "shard"); row i is the node of ranks [i s, (i + 1) s) (s = shard_size), which all-gathers and reduce-scatters
        one copy of the weights, and column j the ranks holding the same shards on every node, which all-reduce their
        gradient shards (FSDP2's hybrid sharding: only gradient shards cross the interconnect)."""
        from torch.distributed.device_mesh import DeviceMesh

        if getattr(self, "_mesh", None) is None:
            group = self.group or dist.group.WORLD
            if self.parallel != "hsdp":
                self._mesh = DeviceMesh.from_group(group, self.device.type)
            else:  # every rank makes every group, in the same order (new_group is a collective on the default group)
                grid = torch.arange(self.world).view(self.world // self.shard_size, self.shard_size)
                backend = None if self.group is None else "gloo"  # the device group's backend (gloo: CPU)
                rows = [dist.new_group(r.tolist(), backend=backend, timeout=self.timeout) for r in grid]
                cols = [dist.new_group(c.tolist(), backend=backend, timeout=self.timeout) for c in grid.T]
                node, pos = divmod(self.rank, self.shard_size)
                self._mesh = DeviceMesh.from_group([cols[pos], rows[node]], self.device.type, mesh=grid,
                                                   mesh_dim_names=("replicate", "shard"))
        return self._mesh

    @contextlib.contextmanager
    def no_sync(self, skip: bool = True):
        """DDP: gradients accumulate locally inside the block (no all-reduce) when `skip`: every backward of an
        optimizer step but its last runs here. FSDP2 reduce-scatters at every backward and accumulates the shards:
        skipping it would keep each rank's gradients of the whole model unsharded in fp32 until the step (measured by
        `mmrl plan`: 44 GiB per GPU for FLUX.1-dev full fine-tuning, 106 GiB for Wan2.2-A14B's two experts). HSDP
        reduce-scatters within the node at every backward too, but all-reduces the accumulated shards across nodes
        only at the step's last backward (`set_requires_all_reduce(False)` inside the block)."""
        ddp = [m for m in self.wrapped if not hasattr(m, "set_requires_gradient_sync")]
        hsdp = [m for m in self.wrapped if hasattr(m, "set_requires_all_reduce")] if self.parallel == "hsdp" else []
        if not skip or self.world == 1 or not (ddp or hsdp):
            yield
            return
        with contextlib.ExitStack() as stack:
            self.syncs = False
            stack.callback(setattr, self, "syncs", True)
            for m in ddp:
                stack.enter_context(m.no_sync())
            for m in hsdp:
                m.set_requires_all_reduce(False)
                stack.callback(m.set_requires_all_reduce, True)
            yield

    def reshard(self) -> None:
        """FSDP2: free the gathered parameters a forward left behind (the root keeps them), so the next forward
        gathers the shards as they are now (after an in-place change such as an EMA swap)."""
        for m in self.wrapped:
            if hasattr(m, "reshard"):
                m.reshard()

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
            dist.barrier(group=self.cpu_group)

    def autocast(self, mixed_precision: str, policy):
        """train.mixed_precision=bf16: the training forward under bf16 autocast (FSDP2 instead computes in bf16
        through its MixedPrecisionPolicy); log-probs and the loss are computed in fp32 from its outputs."""
        if mixed_precision != "bf16" or (self.parallel in SHARDED and self.world > 1):
            return contextlib.nullcontext()
        return torch.autocast(torch.device(policy.device).type, dtype=torch.bfloat16)

    def close(self) -> None:
        """End of a run: every rank waits for the others, then the process group is destroyed (a rank that exits
        while another still talks to it can abort the whole job at teardown)."""
        if self.world > 1 and dist.is_initialized():
            dist.barrier(group=self.cpu_group)
            dist.destroy_process_group()


def _init_restarted_group(cpu: bool, timeout: datetime.timedelta) -> None:
    """The default process group of workers that torchrun restarted (--max-restarts), on the agent's store under a
    prefix of their own attempt: on the plain store the new workers read the addresses the dead ones published
    (gloo: "Connection refused" at start-up, seen with torch 2.14)."""
    from mmrl.preemption import restarted

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    if not cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if cpu else "nccl", store=dist.PrefixStore(f"mmrl/attempt-{restarted()}", store),
                            rank=rank, world_size=world, timeout=timeout)


def _shard_size(parallel: str, shard_size: int, world: int) -> int:
    """Ranks that share one copy of the trained weights: fsdp every rank; hsdp train.shard_size, 0 = the processes
    of one node (LOCAL_WORLD_SIZE, set by torchrun and accelerate); ddp 1."""
    if parallel != "hsdp":
        return world if parallel == "fsdp" else 1
    size = shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % size:
        raise ConfigError(f"train.parallel=hsdp shards within groups of {size} ranks (train.shard_size, else the "
                          f"processes per node), which must divide the {world} processes: set train.shard_size to a "
                          f"divisor of {world}")
    return size


def _serves(device: torch.device) -> bool:
    """Whether the default process group has a backend for `device`'s tensors."""
    try:
        dist.group.WORLD._get_backend(device)
        return True
    except RuntimeError:  # "No backend type associated with device type cpu"
        return False


class _DDP(torch.nn.parallel.DistributedDataParallel):
    """DDP whose unknown attributes (config, adapters, save_pretrained ...) are the wrapped module's."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)
