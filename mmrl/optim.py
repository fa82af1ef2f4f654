"""Optimizer-side helpers of the loop: AdamW, the learning-rate schedule and an EMA of the trained weights."""

from __future__ import annotations

import contextlib

import torch


def adamw(params: list[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """torch's AdamW with its fused kernel (one kernel per step on CUDA and CPU: 6x the default's speed on CPU, where
    the default loops over tensors) when every parameter is a plain floating tensor; FSDP2's DTensor shards take the
    multi-tensor (foreach) step. The state dict is the same either way (checkpoints move between them)."""
    plain = all(type(p) is torch.nn.Parameter and not hasattr(p, "to_local") and p.device.type in ("cpu", "cuda")
                and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **({"fused": True} if plain else {"foreach": True}))


def lr_scale(it: int, iterations: int, elapsed_min: float, budget_min: float, warmup: int, cooldown: float) -> float:
    """Learning-rate multiplier at iteration `it`: linear warm-up over `warmup` iterations, then constant, then a
    linear decay to 0 over the last `cooldown` fraction of the run. Progress is the larger of it / iterations and
    elapsed / budget (when a time budget is set), so a time-budgeted run cools down before its budget ends."""
    scale = min(1.0, (it + 1) / warmup) if warmup > 0 else 1.0
    if cooldown > 0:
        progress = max(it / iterations, elapsed_min / budget_min if budget_min > 0 else 0.0)
        scale *= min(1.0, max(0.0, 1.0 - progress) / cooldown)
    return scale


def soft_update_decay(it: int, rate: float, cap: float) -> float:
    """DiffusionNFT's schedule for the sampling policy's soft update at iteration `it`: eta = min(rate x it, cap)
    (0 at the start: the first rollouts sample with the weights themselves)."""
    return min(rate * it, cap)


class EMA:
    """Exponential moving average of `params` (train.ema_decay): `update()` after each optimizer step;
    `swapped()` puts the averages in the parameters for evaluation and saving, and the raw weights back after.

    Made after DDP / FSDP wrapping: under FSDP2 each shadow is a clone of a DTensor parameter, so a DTensor with
    this rank's shard only, in the parameter's fp32 (trained weights are fp32 master weights: upcast_trainable)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, after_swap=lambda: None):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]
        # FSDP2 keeps the root's parameters gathered after a forward: after_swap drops them (Distributed.reshard),
        # else the next forward would run on the weights from before the swap
        self.after_swap = after_swap

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        """shadow <- decay x shadow + (1 - decay) x params (`decay`: this update's, else the constant one)."""
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1 - (self.decay if decay is None else decay))

    @torch.no_grad()
    def _swap(self) -> None:
        for p, e in zip(self.params, self.shadow):
            tmp = p.detach().clone()
            p.copy_(e)
            e.copy_(tmp)
        self.after_swap()

    @contextlib.contextmanager
    def swapped(self):
        self._swap()
        try:
            yield
        finally:
            self._swap()
