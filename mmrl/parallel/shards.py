"""FSDP2 shards and transformer blocks: whole tensors of sharded parameters (`full`, `gather_to`, `unsharded`:
collectives every rank enters, in one order) and the repeated blocks of a model (`transformer_blocks`: FSDP units,
compiled regions)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def unsharded(modules: list[torch.nn.Module], keep: bool = True, which=lambda p: True, known: dict | None = None):
    """Within the block, the FSDP2-sharded parameters p of `modules` with which(p) are replaced by whole tensors
    on the CPU where `keep` (the rank that saves); every rank must enter (each parameter is all-gathered in turn,
    in the same order everywhere, so a rank holds one whole parameter at a time besides what it keeps). known:
    {id(parameter): its whole CPU tensor where `keep`} already gathered, not gathered again (the same keys on every
    rank, or the ranks' gathers would not match). The sharded parameters are put back afterwards."""
    known = known or {}
    sharded = [(sub, name, p) for mod in modules for sub in mod.modules()
               for name, p in list(sub._parameters.items()) if p is not None and hasattr(p, "full_tensor") and which(p)]
    whole = []
    with torch.no_grad():
        for _, _, p in sharded:
            if id(p) in known:
                whole.append(torch.nn.Parameter(known[id(p)], requires_grad=p.requires_grad) if keep else None)
                continue
            t = p.full_tensor()
            if keep:
                whole.append(torch.nn.Parameter(t.detach().cpu().clone(), requires_grad=p.requires_grad))
            del t
    if keep:
        for (sub, name, _), w in zip(sharded, whole):
            sub._parameters[name] = w
    try:
        yield
    finally:
        if keep:
            for sub, name, p in sharded:
                sub._parameters[name] = p


def gather_to(keep: bool, tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The whole tensors (CPU copies) of possibly FSDP2-sharded `tensors` where `keep`, else Nones; every rank
    must call it (one all-gather per sharded tensor, one at a time)."""
    out = []
    with torch.no_grad():
        for t in tensors:
            f = full(t).detach()  # a collective under FSDP: every rank
            out.append(f.cpu().clone() if keep else None)
    return out


_BLOCK_LISTS = ("layers", "blocks", "transformer_blocks", "single_transformer_blocks")


def transformer_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a model: the items of its outermost ModuleLists named like layers / blocks
    (diffusers transformer_blocks, transformers model.layers, vision blocks ...)."""
    found, taken = [], []
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in _BLOCK_LISTS:
            if not any(name.startswith(t + ".") for t in taken):
                taken.append(name)
                found.extend(m)
    return found


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP2-sharded DTensor) parameter."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p
