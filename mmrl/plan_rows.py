"""An iteration's rows as `mmrl plan` counts them: a rank's share of each minibatch (whole groups per rank, minibatches
stratified by group), a flow chain's trained steps and transformer calls, and the idle rows two experts add in
lockstep. Read by the plan (mmrl/plan.py) and by train.micro_batch=auto (mmrl/micro_batch.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmrl.config import sample_chunk
from mmrl.data import micro_batches
from mmrl.models.families.common import static_schedule
from mmrl.sampling.flow_sde import strided_schedule


def rank_share(total: int, mine: int, drawn: int, p: float = 1e-6) -> tuple[float, int, int]:
    """A rank's rows in one minibatch: `drawn` rows of `total` drawn without replacement, `mine` of them the rank's
    (hypergeometric). Returns (mean, the count exceeded with probability < p, the most possible)."""
    hi, lo = min(mine, drawn), max(0, drawn - (total - mine))
    above, bound = 0, p * math.comb(total, drawn)  # P(X > k), scaled by comb(total, drawn)
    for k in range(hi, lo - 1, -1):
        if above >= bound:
            return drawn * mine / total, k + 1, hi
        above += math.comb(mine, k) * math.comb(total - mine, drawn - k)
    return drawn * mine / total, lo, hi


@dataclass
class Rows:
    """An iteration's rows and one rank's share (world data-parallel processes)."""
    total: int    # rows sampled per iteration (prompts x group_size)
    rank: int     # the most rows one rank samples (whole groups)
    mean: float   # a rank's rows in one minibatch: on average,
    share: int    # the count exceeded in < 1e-6 of minibatches (what the plan sizes for),
    most: int     # and the most possible
    chunk: int    # rows per forward without gradients (sampling, VAE decoding): train.sample_chunk, else all
    world: int    # data-parallel processes


def rows_of(t, world: int) -> Rows:
    """train config `t`'s rows on `world` data-parallel processes."""
    total, rank = t.prompts_per_iter * t.group_size, -(-t.prompts_per_iter // world) * t.group_size
    mean, share, most = rank_share(total, rank, total // t.minibatches)
    return Rows(total, rank, mean, share, most, sample_chunk(t) or rank, world)


def flow_steps(s, forward: bool, experts: int = 1) -> tuple[int, float]:
    """(trained actions per row, transformer calls per sampled row): a chain's SDE steps (a window in each expert's
    steps: Wan2.2's two) or the noise levels of its final sample (forward-process losses), and its calls
    (MixGRPO-Flash's strided ODE calls, the SDE windows at their first starts); TempFlow per-step branching
    (sampler.branch_children): one action per child, and per child its share of the trunk plus its ODE finish."""
    last = s.num_steps - 1
    sde = min(experts * s.sde_window_size, last) if s.sde_window_size else last
    if s.branch_children:
        lo = min(s.sde_window_range[0], last - sde)  # the first start
        steps = range(lo, lo + sde)
        return 1, (steps[-1] + 1 + s.branch_children * sum(last - j for j in steps)) / (s.branch_children * sde)
    trained = s.forward_timesteps if forward else sde
    kinds = ["sde" if i < sde else "ode" for i in range(s.num_steps)]
    return trained, len(strided_schedule(torch.zeros(s.num_steps + 1), kinds, s.ode_stride)[1])


def idle_expert_rows(cfg, model, rows: Rows, trained_steps: int, forward: bool) -> int:
    """Rows with gradients an iteration adds by two experts scoring in lockstep (Wan2.2 under several processes,
    FlowPolicy._lockstep): under DDP and HSDP the backward that synchronizes a step's gradients runs both experts,
    so a step whose last training forward holds one expert's transitions runs the other on one idle row. FSDP2's
    calls, decided per call, add none while every rank's micro-batches hold the same steps (equal shares, as
    planned). Counted on one rank's micro-batches as the trainer cuts them (data.micro_batches over each row's
    trained steps, the high-noise expert's first); a forward-process objective's noise levels are drawn per row, so
    its last forward is counted as one expert's."""
    t, s = cfg.train, cfg.sampler
    if getattr(model, "experts", 1) < 2 or rows.world == 1 or t.parallel not in ("ddp", "hsdp"):
        return 0
    sigmas = static_schedule(s.num_steps, s.shift)[:-1]
    high = int((sigmas >= model.boundary).sum()) if model.boundary is not None else 0
    high = min(s.sde_window_size or high, high, trained_steps)                         # trained steps of the first
    mask = torch.ones(max(round(rows.mean), 1), trained_steps, dtype=torch.bool)       # a rank's minibatch
    *_, (_, last) = micro_batches(mask, torch.arange(len(mask)), t.micro_batch, True)
    last = mask if last is None else last
    one = forward or bool(last[:, :high].any()) != bool(last[:, high:].any())
    return int(one) * rows.world * t.minibatches // t.grad_accum * t.inner_epochs
