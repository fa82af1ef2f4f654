"""VAE decodes batched within a memory bound: rows per VAE call from the live-tensor peak of a decode measured on a
meta copy of the VAE (no memory, no compute), so a video VAE decodes several clips per call where they fit instead
of one row at a time. `LivePeak` / `decode_peak` are also what `mmrl plan` measures the decode transient with."""

from __future__ import annotations

import os
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mmrl.data import in_chunks

MEMORY_FRACTION = 0.5  # of the device's free memory a decode may take: the estimate ignores allocator fragmentation


class LivePeak(TorchDispatchMode):
    """The peak bytes of live tensors created under it (meta tensors included), not counting `exclude`d storages
    (the parameters): a storage is live while a tensor created on it is referenced."""

    def __init__(self, exclude: set[int] = frozenset()):
        super().__init__()
        self.exclude, self.refs, self.nbytes, self.live, self.peak = exclude, {}, {}, 0, 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            self.live -= self.nbytes.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key in self.exclude:
                    continue
                if key not in self.refs:
                    self.refs[key], self.nbytes[key] = 0, t.untyped_storage().nbytes()
                    self.live += self.nbytes[key]
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._release, key)
        return out


def decode_peak(vae: torch.nn.Module, z: torch.Tensor) -> tuple[int, torch.Size]:
    """(peak bytes of live tensors, output shape) of `vae.decode(z)` without gradients; z [n, C, (F,) H, W] (a VAE's
    latents; diffusers returns `.sample`), or image tokens [n, A] (Janus's VQ model; it returns the pixels)."""
    with torch.no_grad(), LivePeak({p.untyped_storage()._cdata for p in vae.parameters()}) as live:
        out = vae.decode(z)
    return live.peak, getattr(out, "sample", out).shape


def meta_copy(vae: torch.nn.Module) -> torch.nn.Module:
    """The same diffusers VAE (class and config) on the meta device at its dtype: no weights, for measuring."""
    import logging

    dtype = next(vae.parameters()).dtype
    with torch.device("meta"):
        meta = type(vae).from_config(vae.config)
    if next(meta.parameters()).dtype != dtype:  # the cast's "keep in float32" notice is about loading, not measuring
        quiet = logging.getLogger("diffusers.models.modeling_utils")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            meta = meta.to(dtype)
        finally:
            quiet.setLevel(level)
    return meta


def row_bytes(vae: torch.nn.Module, row_shape: tuple[int, ...]) -> tuple[int, int]:
    """(fixed, per row) bytes of a decode of latents [n, *row_shape]: peak(n) = fixed + n x per_row, fitted on the
    measured peaks of 1 and 2 rows (meta device)."""
    meta, dtype = meta_copy(vae), next(vae.parameters()).dtype
    one, two = (decode_peak(meta, torch.empty(n, *row_shape, device="meta", dtype=dtype))[0] for n in (1, 2))
    per_row = max(two - one, 1)
    return max(one - per_row, 0), per_row


def free_bytes(device: torch.device) -> int:
    """Memory free for a decode on `device`: CUDA's free memory plus what torch's allocator caches unused; on CPU
    the available physical memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def rows_per_call(fixed: int, per_row: int, budget: int, n: int) -> int:
    """The most rows (1 .. n) whose decode peak fixed + rows x per_row stays within `budget` bytes (at least one)."""
    return max(1, min(n, (budget - fixed) // per_row))


def decode_in_batches(decode, vae: torch.nn.Module, latents: torch.Tensor, budget: int | None = None,
                      cache: dict | None = None) -> torch.Tensor:
    """decode(latents [N, *row]) -> [N, ...] in calls of as many rows as fit in `budget` bytes (default:
    MEMORY_FRACTION of the VAE device's free memory); the per-row cost is measured once per row shape (kept in
    `cache`). Each row's output equals its one-row decode (the VAE treats rows independently)."""
    key = (tuple(latents.shape[1:]), latents.dtype)
    if cache is None or key not in cache:
        cost = row_bytes(vae, key[0])
        if cache is not None:
            cache[key] = cost
    else:
        cost = cache[key]
    if budget is None:
        budget = int(MEMORY_FRACTION * free_bytes(next(vae.parameters()).device))
    rows = rows_per_call(*cost, budget, len(latents))
    return torch.cat([decode(latents[i:i + rows]) for i in range(0, len(latents), rows)])


def decode_rows(decode, latents: torch.Tensor, chunk: int) -> torch.Tensor:
    """A model's decode of latents [N, *row] without gradients: in memory-bounded batches when it is a VAE decode
    (`decode.vae`, `decode.costs`: set by the families' decoders), else in calls of `chunk` rows (0 = all)."""
    vae = getattr(decode, "vae", None)
    if vae is not None:
        return decode_in_batches(decode, vae, latents, cache=decode.costs)
    return in_chunks(decode, chunk, latents)
