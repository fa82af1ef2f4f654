"""Memory per GPU and phase of one iteration, measured: the run's modules are built at real size on fake tensors
(FakeTensorMode: shapes, dtypes and devices, no storage), sharded by the trainer's own FSDP2 layout
(`Distributed.wrap`: `fully_shard` per transformer block, then the root) under a fake process group of world x cp
ranks (collectives return at once), and one iteration's work runs through them (the model's real forward and
backward, AdamW's state, mmrl's EMA, DTensor gathers), while torch's MemTracker counts every live storage on the
device. This is how torchtitan estimates memory (scripts/estimate/estimation.py); nothing is allocated.

Phases (what one rank holds at its peak; every rank of a fake world runs the same code, and on the GPU rank 0 is
no different: it reads weights into host memory and broadcasts one tensor at a time, which every rank receives whole
before keeping its shard):
  startup   the trained weights (fp32, sharded under FSDP), the frozen KL reference copy (full fine-tuning; at
            model.dtype, sharded like the live copy), text encoders and VAE (replicated at model.dtype), EMA (fp32,
            sharded), plus the largest tensor received whole while loading (a policy that loads its model onto the
            device before sharding it, token policies and any run under DDP: the whole trained module at once,
            `Workload.loaded_whole`);
  sampling  + what a rank keeps from sampling to training (rollout storage, prompt-embedding cache) and the chain of
            latents of its rows, + one no-grad transformer forward of a sampling chunk (CFG doubles its rows);
  decode    + the VAE decode of one sampling chunk (the chain freed);
  train     + AdamW's state (2 x fp32, sharded; made by the first step, held from then on), the KL reference's
            no-grad forward when the objective needs it, two micro-batches' forward and
            backward (DDP: the first under `no_sync` when an optimizer step has several; FSDP2 reduce-scatters
            each backward and accumulates sharded gradients), the AdamW step and the EMA update;
  save      + the EMA swapped in and each trained tensor gathered whole, one at a time (what a save holds on top of
            the shards).
Rollout storage, the chain and the text cache are sized by hand (mmrl/plan.py) and held as fake allocations. Text
encoder forwards and the reward models are not run. Context parallelism is planned by running the transformer on
1/cp of the tokens (a spatial or frame axis cut cp ways): per-GPU activations of Ulysses attention are those of
L/cp tokens with all heads.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

log = logging.getLogger(__name__)
_propagating = False  # inside DTensor's sharding propagation (see fake_world)
PHASES = ("startup", "sampling", "decode", "train", "save")


class PhaseTracker(MemTracker):
    """torch's MemTracker (parameters, gradients, optimizer states, FSDP2's resized all-gather storages, every other
    live tensor) keeping only the device-wide peak: its per-module peaks cost O(modules) per operator, ~200 s for one
    FLUX.1-dev forward, and refuse a module called twice (CFG, micro-batches)."""

    def _pre_fw_hook(self, module, inputs) -> None:
        pass

    _post_fw_hook = _pre_bw_hook = _post_bw_hook = lambda self, *args: None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _propagating:  # DTensor infers an output's global shape by running the op on global-shape fake tensors
            return func(*args, **(kwargs or {}))  # under the active FakeTensorMode: no memory of any rank
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if snap[_TOTAL_KEY] > self._peak_mem.get(dev, 0):
                self._peak_mem[dev], self._peak_mem_snap[dev] = snap[_TOTAL_KEY], dict(snap)

    def live(self) -> int:
        return sum(s[_TOTAL_KEY] for s in self._curr_mem_snap.values())

    @contextlib.contextmanager
    def phase(self, peaks: dict, name: str):
        """Track the block: peaks[name] = the most bytes live at once while it ran (what it found included),
        peaks[name + "_added"] = that minus what it found."""
        start, found = time.perf_counter(), self.live()
        with self:
            yield
        peaks[name] = max(self._peak_mem.values(), default=0)
        peaks[name + "_added"] = peaks[name] - found
        log.debug("%s: peak %.2f GiB %s in %.1f s", name, peaks[name] / 2**30,
                  {str(k): round(v / 2**30, 2) for snap in self._peak_mem_snap.values() for k, v in snap.items()},
                  time.perf_counter() - start)


@contextlib.contextmanager
def fake_world(size: int):
    """`size` ranks simulated in this process: rank 0 of a fake process group, under FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if size > 1 and dist.is_initialized():
        raise RuntimeError("mmrl plan simulates its ranks in a fake process group of its own: call it from a process "
                           "without one (not from a launched run)")
    if size > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    # DeviceMesh builds its table of ranks from a real tensor (`.tolist()`), which FakeTensorMode refuses: meshes
    # (Distributed.wrap makes one per sharded module) are built outside it
    from_group = DeviceMesh.from_group

    def real_from_group(*args, **kwargs):
        with unset_fake_temporarily():
            return from_group(*args, **kwargs)

    DeviceMesh.from_group = staticmethod(real_from_group)
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def flagged(*args, **kwargs):
        global _propagating
        _propagating = True
        try:
            return propagate(*args, **kwargs)
        finally:
            _propagating = False

    ShardingPropagator._propagate_tensor_meta_non_cached = flagged
    try:
        with FakeTensorMode():
            yield
    finally:
        DeviceMesh.from_group = staticmethod(from_group)
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        if size > 1:
            dist.destroy_process_group()


def materialize(modules: list[torch.nn.Module]) -> None:
    """Meta parameters and buffers -> fake ones on "cpu", in place (call under FakeTensorMode). Parameters are
    replaced, not converted: a fake tensor cannot be swapped into a module (torch keeps a weak reference to it).
    Tied parameters stay tied."""
    memo: dict[int, torch.Tensor] = {}
    for m in (sub for module in modules for sub in module.modules()):
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in memo:
                    new = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                    memo[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
                table[name] = memo[id(t)]


def _sharder(size: int, parallel: str, mixed_precision: str):
    """The trainer's own wrap (mmrl.parallel.distributed.Distributed.wrap) on the fake process group, and its no_sync. HSDP
    is measured as FSDP over one shard group (`size` = its ranks): a rank holds and gathers what it would there (its
    all-reduce across replicas runs on the reduce-scattered gradient shards; with several backwards per step it keeps
    one more fp32 gradient shard between them, not counted)."""
    from mmrl.config import SHARDED
    from mmrl.parallel.distributed import Distributed

    if size == 1 or parallel not in SHARDED:  # DDP replicates: its wrapper adds buckets, not counted
        return (lambda m: m), contextlib.nullcontext
    d = Distributed.__new__(Distributed)  # without a launched run's set-up: only the fields wrap and no_sync read
    d.world, d.parallel, d.group, d.device, d.wrapped = size, "fsdp", None, torch.device("cpu"), []
    return (lambda m: d.wrap(m, mixed_precision)), d.no_sync


@dataclass
class Workload:
    """One rank's iteration on modules built on the meta device (closures see them after `materialize`)."""
    trained: list[torch.nn.Module]              # the trained networks (Wan2.2: two experts), prepared
    reference: list[torch.nn.Module]            # frozen KL copies at model.dtype (full fine-tuning), else []
    frozen: list[torch.nn.Module]               # text encoders, VAE: replicated, never sharded
    sample: Callable[[], None]                  # one no-grad forward of a sampling chunk
    loss: Callable[[bool], torch.Tensor]        # one training micro-batch's loss (True: through the reference)
    decode: Callable[[], None] | None = None    # the VAE decode of one sampling chunk
    kept_bytes: int = 0                         # held from sampling to training: rollout storage, text cache
    chain_bytes: int = 0                        # the sampling chain of a rank's rows, live while sampling
    passes_per_step: int = 1                    # training forwards + backwards per optimizer step on a rank
    needs_reference: bool = False               # the objective runs the reference (KL) before each pass
    ema_decay: float = 0.0
    shard_reference: bool = True                # FSDP shards the reference copy like the live one (flow policies)
    loaded_whole: int = 0                       # bytes of the trained modules held whole before sharding (0: loaded
                                                # into shards)
    extra: dict = field(default_factory=dict)


def measure(w: Workload, size: int, parallel: str, mixed_precision: str, foreach: bool = True) -> dict[str, int]:
    """Peak bytes per GPU of each phase (PHASES) of workload `w` on a rank of `size` (world x cp) ranks, and what
    each added to the bytes it found (`<phase>_added`). foreach: AdamW's multi-tensor step (torch's choice on CUDA;
    its temporaries are a few copies of the sharded state), else the per-tensor one (torch's choice on CPU)."""
    from mmrl.optim import EMA

    peaks: dict[str, int] = {}
    with fake_world(size):
        wrap, no_sync = _sharder(size, parallel, mixed_precision)
        materialize(w.trained + w.reference + w.frozen)
        trained = [wrap(m) for m in w.trained]  # in place: modules and closures keep their identity
        reference = [wrap(m) if w.shard_reference else m for m in w.reference]
        params = [p for m in trained for p in m.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
        tracker = PhaseTracker()
        tracker.track_external(*trained, *reference, *w.frozen)
        # ------------------------------------------------------------------------------------------ start-up
        with tracker.phase(peaks, "startup"), torch.no_grad():
            # loading into shards: each tensor arrives whole (rank 0's broadcast) before a rank keeps its shard
            largest = max((p for m in trained + reference for p in m.parameters()), key=lambda p: p.numel())
            whole = torch.empty(largest.shape, dtype=largest.dtype)
            del whole
            if w.loaded_whole:  # on the device whole, then sharded: the whole module less the shard kept
                local = [p.to_local() if hasattr(p, "to_local") else p for m in trained for p in m.parameters()]
                kept_shard = sum(p.numel() * p.element_size() for p in local)
                whole = torch.empty(max(w.loaded_whole - kept_shard, 0), dtype=torch.uint8)
                del whole
            ema = EMA(params, w.ema_decay) if w.ema_decay > 0 else None
        # ------------------------------------------------------------------------------------------ sampling
        with tracker.phase(peaks, "sampling"), torch.no_grad():
            kept = torch.empty(w.kept_bytes, dtype=torch.uint8)
            chain = torch.empty(w.chain_bytes, dtype=torch.uint8)
            w.sample()
            del chain
        if w.decode is not None:
            with tracker.phase(peaks, "decode"), torch.no_grad():
                w.decode()
        else:
            peaks["decode"], peaks["decode_added"] = tracker.live(), 0
        # ------------------------------------------------------------------------------------------ training
        with tracker.phase(peaks, "train"):
            with torch.no_grad():  # a later iteration's: AdamW's state (its first step makes it), sharded like p
                for p in params:
                    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                    "exp_avg_sq": torch.zeros_like(p)}
            for i in range(2 if w.passes_per_step > 1 else 1):
                if w.needs_reference:
                    with torch.no_grad():
                        w.loss(True)
                with no_sync(i == 0 and w.passes_per_step > 1):
                    w.loss(False).backward()
            opt.step()
            if ema is not None:
                ema.update()
            opt.zero_grad(set_to_none=True)
        # ------------------------------------------------------------------------------------------ save
        with tracker.phase(peaks, "save"), torch.no_grad(), (ema.swapped() if ema else contextlib.nullcontext()):
            for p in params:  # gathered whole one tensor at a time (full_state_dict), offloaded before the next
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p
                del whole
        del kept
    return peaks


def cp_cut(latent: tuple[int, ...], cp: int) -> tuple[int, ...]:
    """A latent's shape with 1/cp of its tokens: the first axis after the channels that cp divides (frames, then
    height, then width), else the height rounded up."""
    if cp == 1:
        return latent
    for axis in range(1, len(latent)):
        if latent[axis] % cp == 0 and latent[axis] // cp >= 2:
            return (*latent[:axis], latent[axis] // cp, *latent[axis + 1:])
    return (latent[0], math.ceil(latent[1] / cp), *latent[2:])


# ------------------------------------------------------------------------------------------------ workloads
def _upcast_copy(model: torch.nn.Module, reference: bool) -> list[torch.nn.Module]:
    """The policy's dtypes on a prepared meta model: fp32 master weights for what trains (upcast_trainable), and
    the frozen KL reference (a copy made before the upcast, so at model.dtype) when `reference`."""
    import copy

    from mmrl.policy.base import upcast_trainable

    ref = [copy.deepcopy(model).requires_grad_(False).eval()] if reference else []
    upcast_trainable(model)
    return ref


def flow_workload(cfg, model, inputs, text, vae, *, chunk: int, m: int, cp: int, kept: int, chain: int,
                  passes: int, needs_reference: bool, forward_objective: bool,
                  vae_latent: tuple[int, ...]) -> Workload:
    """One rank's flow iteration: `model` (prepared on meta; `model.experts` of them), its family's PlanInputs,
    frozen text encoders and VAE; `chunk` rows per no-grad forward, `m` transitions per training forward;
    `vae_latent`: one latent as the VAE decodes it (the family's `vae_latent`)."""
    import copy

    from mmrl.devices import torch_dtype
    from mmrl.models.flow_model import FlowModel
    from mmrl.sampling.flow_sde import gaussian_log_prob, step_mean_std

    s, dtype = cfg.sampler, torch_dtype(cfg.model.dtype)
    trained = [model] + [copy.deepcopy(model) for _ in range(getattr(model, "experts", 1) - 1)]
    full_ref = needs_reference and not cfg.model.lora.enabled
    reference = [r for tr in trained for r in _upcast_copy(tr, full_ref)]
    latent, text_tokens, enc_dim, pooled_dim = inputs[1:5]
    train_latent = cp_cut(tuple(latent), cp)

    def velocity(mods, rows: int, shape) -> torch.Tensor:  # CFG through FlowModel.velocity; Wan2.2's second expert
        fm = FlowModel(mods[0], None, None, shape, call=inputs.call,  # runs one row (the worst case: a lockstep call)
                       cfg_grad=s.cfg_grad)
        x, sigma = torch.randn(rows, *shape), torch.full((rows,), 0.5)
        enc, pooled = torch.randn(rows, text_tokens, enc_dim, dtype=dtype), torch.randn(rows, pooled_dim, dtype=dtype)
        neg = (enc.clone(), pooled.clone()) if s.cfg_scale != 1.0 else None
        v = fm.velocity(x, sigma, enc, pooled, s.cfg_scale, neg)
        for other in mods[1:]:
            v = v + 0.0 * fm._expert(other, x[:1], sigma[:1], enc[:1], pooled[:1]).sum()
        return v

    def loss(through_reference: bool) -> torch.Tensor:
        v = velocity((reference or trained) if through_reference else trained, m, train_latent)
        x = torch.randn(m, *train_latent)
        if forward_objective:
            return (v - x).pow(2).mean()
        sigma = torch.full((m,), 0.5)
        mean, std = step_mean_std(s.kind, x, v, sigma, sigma - 0.05, s.noise_level, 1.0)
        return -gaussian_log_prob(x, mean, std, s.logprob_reduce).mean()

    def decode():
        vae.decode(torch.randn(chunk, *vae_latent, dtype=dtype))

    return Workload(trained, reference, [*text, *([vae] if vae is not None else [])],
                    lambda: velocity(trained, chunk, cp_cut(tuple(latent), cp)), loss,
                    decode if vae is not None else None, kept, chain, passes, needs_reference,
                    cfg.train.ema_decay, shard_reference=not cfg.model.offload)


def token_workload(cfg, model, *, chunk: int, m: int, seq: int, kept: int, needs_reference: bool) -> Workload:
    """One rank's token iteration: a no-grad forward of `chunk` sequences of `seq` tokens keeping its KV cache
    (the sampling transient of generation's last step), then training forwards of `m` sequences whose completion
    logits are scored in fp32."""
    s = cfg.sampler
    reference = _upcast_copy(model, needs_reference and not cfg.model.lora.enabled)
    base = model.model if hasattr(model, "model") else model
    lm = getattr(base, "language_model", base)

    def forward(mod, rows: int, cache: bool):  # through the root module, as the policy calls it (FSDP's root
        ids = torch.zeros(rows, seq, dtype=torch.long)  # gathers the embeddings and the head)
        pos = torch.arange(seq).expand(3 if lm is not base else 1, rows, seq)
        mod.train(not cache)  # generation: eval mode keeps the KV cache (training under checkpointing drops it)
        out = mod(input_ids=ids, position_ids=pos if lm is not base else pos[0], use_cache=cache,
                  logits_to_keep=s.max_new_tokens)
        mod.train()
        return out.logits.float().logsumexp(-1).mean()  # the completion's log-probs, fp32

    return Workload([model], reference, [], lambda: forward(model, chunk, True),
                    lambda ref: forward(reference[0] if ref and reference else model, m, False), None, kept, 0,
                    # one pass, synced: the vision tower never runs here (token ids stand in for the media)
                    1, needs_reference, cfg.train.ema_decay, shard_reference=False,
                    # build_token_policy loads the whole model onto each GPU, then FSDP shards it
                    loaded_whole=sum(p.numel() * (4 if p.requires_grad else p.element_size()) for p in model.parameters()))


def janus_workload(cfg, janus, lm, frozen, vq, scorer, *, chunk: int, m: int, prompt: int, kept: int, passes: int,
                   needs_reference: bool, loaded_whole: int) -> Workload:
    """One rank's Janus-Pro iteration (mmrl/policy/janus.py) on its ImageTokenLM `lm` (prepared on meta), the frozen
    understanding path and VQ model `vq`, and `scorer` (plan_models.janus_scorer: the policy's training forward):
    generation's last step for `chunk` samples (both CFG rows' KV cache at full length, that step's logits), the VQ
    decode of the chunk's A tokens, training forwards of `m` samples of `prompt` + A tokens. loaded_whole: the plan's
    bytes of the ImageTokenLM a rank holds whole before sharding (0: build_janus_policy reads it into shards)."""
    import copy

    from transformers import DynamicCache

    from mmrl.policy.base import upcast_trainable
    from mmrl.policy.janus import positions
    from mmrl.policy.token import selective_log_softmax

    s = cfg.sampler
    # as JanusPolicy: a full fine-tuning reference copied at model.dtype, then fp32 master weights
    reference = [copy.deepcopy(lm).requires_grad_(False).eval()] if needs_reference and not cfg.model.lora.enabled \
        else []
    upcast_trainable(lm)
    scorer.device = torch.device("cpu")
    a, rows = janus.config.vision_config.num_image_tokens, chunk * (2 if s.cfg_scale != 1 else 1)

    def sample():  # eval mode, as the policy samples: the KV cache kept (checkpointing would drop it)
        mask = torch.ones(rows, prompt + a - 1, dtype=torch.long)                          # [2 chunk, P + A - 1]
        lm.eval()
        lm(torch.zeros(rows, prompt, dtype=torch.long), torch.zeros(rows, a - 1, dtype=torch.long), mask,
           positions(mask), DynamicCache(), keep=1)
        lm.train()

    def loss(through_reference: bool) -> torch.Tensor:  # LoRA's reference is the same module, adapters off
        scorer.lm = reference[0] if through_reference and reference else lm
        ids = torch.zeros(m, a, dtype=torch.long)                                         # [m, A]
        try:
            return selective_log_softmax(scorer._scores([torch.zeros(1, prompt, dtype=torch.long)] * m, ids,
                                                        s.cfg_scale), ids)[0].mean()
        finally:
            scorer.lm = lm

    def decode():
        vq.decode(torch.zeros(chunk, a, dtype=torch.long))

    return Workload([lm], reference, [*frozen, vq], sample, loss, decode, kept, 0, passes, needs_reference,
                    cfg.train.ema_decay, shard_reference=True, loaded_whole=loaded_whole)
