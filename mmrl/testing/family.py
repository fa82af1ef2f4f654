"""Checks every model family's test makes: the LoRA adapter a flow policy saves loads in the family's diffusers
pipeline and gives the trained velocity there."""

from __future__ import annotations

import torch


def check_lora_in_diffusers(policy, pipe, base, x: torch.Tensor, sigma: torch.Tensor, enc: torch.Tensor,
                            pooled: torch.Tensor, folder: str, tol: float = 1e-5) -> float:
    """Perturb the policy's (zero-initialized) adapter, save it to `folder`, load it into `pipe` with
    `load_lora_weights`, put that transformer into `base` (the FlowModel of the untrained folder) and compare its
    velocity at (x, sigma, enc, pooled) with the trained policy's. Returns the largest difference; raises
    AssertionError when the adapter does not matter (< 1e-3) or the two differ by more than tol."""
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for p in policy.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    policy.save_pretrained(folder)
    pipe.load_lora_weights(folder)
    own = base.transformer
    try:
        with torch.no_grad():
            untrained = base.velocity(x, sigma, enc, pooled)
            want = policy.model.velocity(x, sigma, enc, pooled)
            base.transformer = pipe.transformer
            got = base.velocity(x, sigma, enc, pooled)
    finally:
        base.transformer = own  # `base` is left as it came
    assert (want - untrained).abs().max() > 1e-3, "the adapter does not change the velocity"
    diff = float((got - want).abs().max())
    assert diff <= tol + tol * float(want.abs().max()), f"diffusers' velocity differs from mmrl's by {diff:.3g}"
    return diff
