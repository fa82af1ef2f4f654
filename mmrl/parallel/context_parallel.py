"""Sequence (context) parallelism for video DiTs through diffusers' own API, composed with data parallelism.

A cp group of `cp_degree` ranks runs ONE transformer call together: diffusers' hooks (the model's `_cp_plan`)
split the video tokens of `hidden_states` [N, S, D] into cp_degree contiguous chunks [N, S / cp, D] before the
first block, every self-attention exchanges them (Ulysses: all-to-all of heads; ring: rotation of K/V), and
`proj_out` all-gathers the output, so every rank of the group returns the WHOLE velocity [N, C, F', H, W].
Text tokens are not split (Wan's cross-attention runs locally against the full prompt). Activations inside the
blocks are 1 / cp_degree per rank; the weights are whole on every rank.

The ranks form a (dp, cp) DeviceMesh, rank = dp_rank * cp + cp_rank: the cp ranks of one dp row are adjacent
(on a node, where the all-to-all is cheap).

How the trainer / policy wires it (a few lines):

    mesh = build_mesh(cp_degree)                                  # after init_process_group
    enable_context_parallel(policy.transformer, cp_degree, mesh)  # each trained transformer (Wan2.2 A14B: both)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    # rows: split by dp_rank over dp_size (NOT by global rank); every rank of a cp group must pass the SAME
    # rows, latents, noise generators, timesteps and prompt embeddings: the hooks cut one shared input, and a
    # rank that sees other inputs silently computes a different sample.
    ...
    loss.backward()                                               # loss identical on the cp ranks of a row
    reduce_gradients(policy.transformer.parameters(), mesh)       # sum over cp, mean over dp
    optimizer.step()

Why the sum: each cp rank back-propagates only the gradient of ITS chunk of tokens (the output all-gather's
backward keeps one chunk), so its parameter gradients are partial and their SUM over the cp group is the
one-process gradient (their mean is 1 / cp of it). `reduce_gradients` does sum-over-cp and mean-over-dp in one
all-reduce over the world. Under DDP / FSDP2 over the whole world (which average over dp * cp ranks) instead
multiply the loss by `cp_degree` (`loss_scale(mesh)`) and skip `reduce_gradients`.

On a machine without an accelerator diffusers' `_resolve_parallel_config` computes `rank % device_count()`
with device_count() = 0 (ZeroDivisionError); `enable_context_parallel` makes device_count() return 1 for that
call only, and only when no accelerator is present (the device it builds is then "cpu:0", which gloo ignores).
What runs where (diffusers 0.42): docs/scale-out.md#context-parallelism.
"""

from __future__ import annotations

from typing import Iterable
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from mmrl.errors import ConfigError

KINDS = ("ulysses", "ring")
# Backends diffusers registers with supports_context_parallel=True whose forward op returns the log-sum-exp that
# ring attention merges chunks with; "native" (SDPA) has a cp path for Ulysses only (its forward op refuses
# return_lse=True). All of these are CUDA / NPU kernels.
RING_BACKENDS = ("flash", "flash_hub", "flash_varlen_hub", "_flash_3_hub", "_flash_3_varlen_hub", "_native_cudnn",
                 "_native_flash", "_native_npu", "sage", "sage_hub")


def check_cp(cp_degree: int, world_size: int, num_heads: int | None = None, seq_len: int | None = None,
             kind: str = "ulysses") -> None:
    """Refuse a layout diffusers cannot run, with the fix in the message.

    Args:
        cp_degree: ranks per cp group; must divide world_size (dp = world_size / cp_degree).
        num_heads: attention heads; Ulysses scatters heads, so they must divide by cp_degree.
        seq_len: video tokens S = (F' / p_t) (H / p_h) (W / p_w) (see `sequence_length`); diffusers' equal split
            asserts S % cp_degree == 0.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown context-parallel kind {kind!r}; valid: {', '.join(KINDS)}")
    if cp_degree < 1 or world_size % cp_degree:
        raise ConfigError(f"cp_degree {cp_degree} must divide the world size {world_size} "
                          f"(dp = world / cp); use one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    if kind == "ulysses" and num_heads is not None and num_heads % cp_degree:
        raise ConfigError(f"Ulysses splits the {num_heads} attention heads over cp_degree {cp_degree} ranks: "
                          f"choose a cp_degree that divides {num_heads}, or kind='ring'")
    if seq_len is not None and seq_len % cp_degree:
        raise ConfigError(f"{seq_len} video tokens do not split into {cp_degree} equal chunks: choose a frame count "
                          f"or resolution whose token count divides by {cp_degree}")


def sequence_length(transformer, latent_shape: tuple[int, ...]) -> int:
    """Video tokens of a Wan-style transformer for latents [N, C, F', H, W]: (F'/p_t) (H/p_h) (W/p_w)."""
    p_t, p_h, p_w = transformer.config.patch_size
    _, _, f, h, w = latent_shape
    return (f // p_t) * (h // p_h) * (w // p_w)


def check_model_folder(path: str | None, cp_degree: int, kind: str = "ulysses", sample_size: int | None = None,
                       num_frames: int | None = None) -> None:
    """`check_cp` from a diffusers folder's configs alone (before any weight loads): its transformer class has a
    context-parallel plan, its heads split (Ulysses), and, for Wan-style video latents, the video tokens split.
    A path without transformer/config.json (the pixel worlds, a hub id) is refused: only diffusers DiTs with a
    `_cp_plan` run context-parallel."""
    import json
    import os

    import diffusers

    cfg_file = os.path.join(path or "", "transformer", "config.json")
    if not os.path.isfile(cfg_file):
        raise ConfigError(f"train.context_parallel={cp_degree} needs a diffusers pipeline folder with "
                          f"transformer/config.json (a video DiT such as Wan2.x); {path!r} has none. Set "
                          f"train.context_parallel=1")
    with open(cfg_file) as f:
        tc = json.load(f)
    cls = getattr(diffusers, tc.get("_class_name", ""), None)
    if getattr(cls, "_cp_plan", None) is None:
        raise ConfigError(f"{tc.get('_class_name')} has no context-parallel plan in diffusers {diffusers.__version__} "
                          f"(ModelMixin._cp_plan): set train.context_parallel=1")
    seq_len = None
    patch = tc.get("patch_size")
    if sample_size and isinstance(patch, list) and len(patch) == 3:  # Wan: latents [C, F', H, W]
        vae_file = os.path.join(path, "vae", "config.json")
        down = json.load(open(vae_file)).get("temperal_downsample", [False, True, True]) if os.path.isfile(vae_file) \
            else [False, True, True]
        frames = ((num_frames or 81) - 1) // 2 ** sum(map(bool, down)) + 1
        seq_len = (frames // patch[0]) * (sample_size // patch[1]) * (sample_size // patch[2])
    check_cp(cp_degree, cp_degree, tc.get("num_attention_heads"), seq_len, kind)


def build_mesh(cp_degree: int, world_size: int | None = None, device_type: str | None = None) -> DeviceMesh:
    """The (dp, cp) mesh over all ranks, dims named ("dp", "cp"); dp = world_size / cp_degree."""
    world_size = world_size or dist.get_world_size()
    check_cp(cp_degree, world_size)
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device_type = device_type or (acc.type if acc is not None else "cpu")
    return init_device_mesh(device_type, (world_size // cp_degree, cp_degree), mesh_dim_names=("dp", "cp"))


def attention_backend(transformer) -> str:
    """The attention backend the transformer's processors dispatch to (diffusers' active one, "native" = SDPA,
    unless `set_attention_backend` chose another)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    for m in transformer.modules():
        backend = getattr(getattr(m, "processor", None), "_attention_backend", None)
        if backend is not None:
            return str(getattr(backend, "value", backend))
    return _AttentionBackendRegistry.get_active_backend()[0].value


def check_backend(transformer, kind: str) -> None:
    """Refuse ring attention on a backend without a log-sum-exp (diffusers would fail at the first call)."""
    backend = attention_backend(transformer)
    if kind == "ring" and backend not in RING_BACKENDS:
        raise ConfigError(f"ring attention merges chunks by their log-sum-exp, which the {backend!r} attention backend "
                          f"does not return; use kind='ulysses', or transformer.set_attention_backend(one of "
                          f"{RING_BACKENDS}) on a GPU")


def add_sequence_check(transformer, cp_degree: int) -> None:
    """Check every call's video tokens before diffusers splits them (its own check is a bare assert). For Wan-style
    transformers: hidden_states [N, C, F', H, W] and a 3-D `patch_size` in the config."""

    def check(module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        if isinstance(x, torch.Tensor) and x.dim() == 5 and len(module.config.get("patch_size") or ()) == 3:
            check_cp(cp_degree, cp_degree, seq_len=sequence_length(module, x.shape))

    transformer.register_forward_pre_hook(check, with_kwargs=True)


def enable_context_parallel(transformer, cp_degree: int, mesh: DeviceMesh | None = None,
                            kind: str = "ulysses") -> DeviceMesh:
    """Split every call of a diffusers transformer (one with a `_cp_plan`, e.g. WanTransformer3DModel) over the cp
    ranks of `mesh`, through `ModelMixin.enable_parallelism(config=ContextParallelConfig(...))`.

    Args:
        transformer: a diffusers ModelMixin; call it before DDP / FSDP wrapping and before torch.compile.
        cp_degree: ranks per cp group.
        mesh: a (dp, cp) mesh from `build_mesh`, or a 1-D mesh named ("cp",); None builds `build_mesh(cp_degree)`.
        kind: "ulysses" (all-to-all of heads; heads % cp == 0) or "ring" (K/V rotation; needs a backend that
            returns the log-sum-exp, see RING_BACKENDS: none runs on CPU).
    Returns:
        the mesh (dims "dp", "cp"; or "cp"), for `reduce_gradients` and for picking rows by mesh["dp"].
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("enable_context_parallel needs torch.distributed initialized (torchrun, init_process_group)")
    check_cp(cp_degree, dist.get_world_size(), transformer.config.get("num_attention_heads"), kind=kind)
    mesh = mesh if mesh is not None else build_mesh(cp_degree)
    if "cp" not in (mesh.mesh_dim_names or ()) or mesh["cp"].size() != cp_degree:
        raise ValueError(f"mesh {mesh.mesh_dim_names} {tuple(mesh.shape)} needs a 'cp' dim of size {cp_degree}; "
                         "build it with build_mesh(cp_degree)")
    check_backend(transformer, kind)
    from diffusers import ContextParallelConfig

    # diffusers reads the cp ranks from dims named "ring" and "ulysses"; a view of the same ranks
    degrees = (cp_degree, 1) if kind == "ring" else (1, cp_degree)
    cp_mesh = mesh._unflatten("cp", degrees, ("ring", "ulysses"))
    config = ContextParallelConfig(ring_degree=degrees[0], ulysses_degree=degrees[1], mesh=cp_mesh)
    if torch.accelerator.is_available():
        transformer.enable_parallelism(config=config)
    else:  # diffusers computes `rank % torch.accelerator.device_count()`, 0 without an accelerator
        with mock.patch.object(torch.accelerator, "device_count", return_value=1):
            transformer.enable_parallelism(config=config)
    add_sequence_check(transformer, cp_degree)
    return mesh


def reduce_gradients(params: Iterable[torch.nn.Parameter], mesh: DeviceMesh) -> None:
    """Make every rank's .grad the gradient of the mean loss over dp rows: SUM over the cp group (each cp rank
    holds the part of its own tokens), MEAN over dp. One all-reduce over the mesh's ranks, divided by dp.

    Args:
        params: parameters with plain (not DTensor) .grad; under FSDP2 use `loss_scale` instead.
        mesh: the (dp, cp) mesh, or mesh["cp"] to only sum over cp (when DDP already averages over a dp group).
    """
    dp = mesh["dp"].size() if "dp" in mesh.mesh_dim_names else 1
    group = mesh._flatten().get_group() if mesh.ndim > 1 else mesh.get_group()
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for all parameters
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= dp
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def loss_scale(mesh: DeviceMesh) -> int:
    """The factor for the loss when DDP / FSDP average gradients over all dp * cp ranks instead of
    `reduce_gradients`: cp_degree (the average over cp of partial gradients is 1 / cp of their sum)."""
    return mesh["cp"].size()
