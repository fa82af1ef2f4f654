"""`train.micro_batch: auto`: the largest training forward that fits the device, from `mmrl plan`.

A fixed micro-batch is either too small for a large GPU (SD3.5-M at `micro_batch: 4` runs 2.25x the training
forwards of flow_grpo's 9 samples per forward) or too large for a small one. `auto` plans the config at micro-batch
1 and 2 (the parts by hand, seconds at real size: mmrl/plan.py), takes the sampling and the training peak each as
linear in the micro-batch between them (sampling forwards take train.sample_chunk rows, or the micro-batch), and picks
the largest micro-batch whose peaks stay within HEADROOM of the device's memory, at most the rank's planned share of
a minibatch (one training forward per minibatch; forwards without gradients take as many rows unless
train.sample_chunk says otherwise). `mmrl train` resolves it once, on rank 0, and every rank uses rank 0's pick;
`mmrl plan` reports the pick for its device (`--gpu-gib`). Flow policies only: a token policy's memory follows its
prompts' lengths (video tokens), which the config does not fix.
"""

from __future__ import annotations

import copy
import logging
import math

import torch

from mmrl.devices import indexed, resolve_device
from mmrl.errors import ConfigError

log = logging.getLogger(__name__)
HEADROOM = 0.9  # of the device's memory the plan may fill: the allocator's fragmentation, CUDA context, NCCL buffers


def device_memory_gib(device: torch.device) -> float:
    """The device's memory: a GPU's total, else the memory the system has available now."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    import psutil

    return psutil.virtual_memory().available / 2**30


def fit_micro_batch(cfg, budget_gib: float, arch: str | None = None, world: int = 1, cp: int = 1,
                    prompt_tokens: int | None = None) -> dict:
    """{"micro_batch": the pick, "peak_gib": its planned peak, "per_row_gib": what one more row adds to the sampling
    and the training peak, "whole": the rows of the rank's planned share of a minibatch}. Raises ConfigError for a
    token policy, or when a forward of one row does not fit `budget_gib`."""
    from mmrl.algorithms.objective import build_objective
    from mmrl.plan import plan
    from mmrl.plan_rows import flow_steps, rows_of
    from mmrl.policy.kinds import kind_of

    kind = kind_of(cfg.model.policy)
    if kind is None or not kind.denoises:
        raise ConfigError(f"train.micro_batch=auto sizes flow policies; model.policy={cfg.model.policy}'s memory follows "
                          f"its prompts' lengths (video and image tokens): set a count (mmrl plan --prompt-tokens N "
                          f"train.micro_batch=K shows the peak)")

    def planned(m: int) -> dict:
        c = copy.deepcopy(cfg)
        c.train.micro_batch = m
        return plan(c, arch, prompt_tokens, world, cp)

    one, two = planned(1), planned(2)
    peaks = ("peak_sampling_gib", "peak_training_gib")
    per_row = {k: two[k] - one[k] for k in peaks}                         # GiB one more row adds to each peak
    forward = build_objective(cfg.algo).actions == "forward"             # transitions of a rank's planned minibatch
    rows = rows_of(cfg.train, world).share * flow_steps(cfg.sampler, forward, one.get("experts", 1))[0]
    limit = HEADROOM * budget_gib
    if one["total_gib"] > limit:
        raise ConfigError(f"train.micro_batch=auto: a forward of one row plans {one['total_gib']:.1f} GiB, over "
                          f"{HEADROOM:.0%} of the device's {budget_gib:.1f} GiB: enable train.gradient_checkpointing, "
                          f"model.lora, shard the model (train.parallel=fsdp) or use more GPUs (mmrl plan shows the parts)")
    m = min([rows] + [1 + math.floor((limit - one[k]) / per_row[k]) for k in peaks if per_row[k] > 0])
    peak = max(one["total_gib"], *(one[k] + (m - 1) * max(per_row[k], 0.0) for k in peaks))
    return {"micro_batch": m, "peak_gib": peak, "per_row_gib": per_row, "whole": rows}


def resolve_micro_batch(cfg, dist) -> None:
    """train.micro_batch=auto replaced by rank 0's pick for its device (every rank the same); other values kept."""
    if cfg.train.micro_batch != "auto":
        return
    device = dist.device if dist.world > 1 else indexed(resolve_device(cfg.model.device))  # one process: the model's
    fit = fit_micro_batch(cfg, device_memory_gib(device), world=dist.data_world, cp=dist.cp) if dist.main else None
    cfg.train.micro_batch = dist.broadcast_object(None if fit is None else fit["micro_batch"])
    if fit is not None:
        log.info("train.micro_batch=auto: %d (planned peak %.1f GiB)", cfg.train.micro_batch, fit["peak_gib"])
