"""`train.micro_batch: auto`: the largest training forward that fits the device, from `mmrl plan`.

A fixed micro-batch is either too small for a large GPU (SD3.5-M at `micro_batch: 4` runs 2.25x the training
forwards of flow_grpo's 9 samples per forward) or too large for a small one. `auto` plans the config at micro-batch
1 and 2 (the parts by hand, seconds at real size: mmrl/plan.py), takes the sampling and the training peak each as
linear in the micro-batch between them (sampling forwards take train.sample_chunk rows, or the micro-batch), and picks
the largest micro-batch whose peaks stay within HEADROOM of the device's memory; one forward
per minibatch (0) when that holds the rank's whole minibatch. `mmrl train` resolves it once, on rank 0, and every
rank uses rank 0's pick; `mmrl plan` reports the pick for its device (`--gpu-gib`).
"""

from __future__ import annotations

import copy
import logging
import math

import torch

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
    """{"micro_batch": the pick (0 = the rank's whole minibatch), "peak_gib": its planned peak, "per_row_gib": what
    one more row of a training forward adds, "whole": the rows of the rank's whole minibatch}. Raises ConfigError
    when a forward of one row does not fit `budget_gib`."""
    from mmrl.config import policy_kind
    from mmrl.plan import _flow_steps, _rows, plan

    def planned(m: int) -> dict:
        c = copy.deepcopy(cfg)
        c.train.micro_batch = m
        return plan(c, arch, prompt_tokens, world, cp)

    one, two = planned(1), planned(2)
    peaks = ("peak_sampling_gib", "peak_training_gib")
    per_row = {k: two[k] - one[k] for k in peaks}                         # GiB one more row adds to each peak
    rows = _rows(cfg.train, world).share                                   # a rank's rows of a planned minibatch
    if policy_kind(cfg.model.policy) == "flow":                            # flow: transitions per forward
        from mmrl.algorithms.objective import build_objective

        forward = build_objective(cfg.algo).actions == "forward"
        rows *= _flow_steps(cfg.sampler, forward, one.get("experts", 1))[0]
    limit = HEADROOM * budget_gib
    if one["total_gib"] > limit:
        raise ConfigError(f"train.micro_batch=auto: a forward of one row plans {one['total_gib']:.1f} GiB, over "
                          f"{HEADROOM:.0%} of the device's {budget_gib:.1f} GiB: enable train.gradient_checkpointing, "
                          f"model.lora, shard the model (train.parallel=fsdp) or use more GPUs (mmrl plan shows the parts)")
    m = min([rows] + [1 + math.floor((limit - one[k]) / per_row[k]) for k in peaks if per_row[k] > 0])
    peak = max(one["total_gib"], *(one[k] + (m - 1) * max(per_row[k], 0.0) for k in peaks))
    return {"micro_batch": 0 if m >= rows else m, "peak_gib": peak, "per_row_gib": per_row, "whole": rows}


def resolve_micro_batch(cfg, dist) -> None:
    """train.micro_batch=auto replaced by rank 0's pick for its device (every rank the same); other values kept."""
    if cfg.train.micro_batch != "auto":
        return
    fit = fit_micro_batch(cfg, device_memory_gib(dist.device), world=dist.data_world, cp=dist.cp) if dist.main else None
    cfg.train.micro_batch = dist.broadcast_object(None if fit is None else fit["micro_batch"])
    if fit is not None:
        log.info("train.micro_batch=auto: %d (planned peak %.1f GiB)", cfg.train.micro_batch, fit["peak_gib"])
