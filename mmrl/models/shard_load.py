"""Sharded loading: a diffusers model built on the meta device (`meta_component`) and filled from its safetensors
files, each rank reading only the rows of its FSDP2 shards (`load_into_shards`); a frozen copy made shard by shard
(`copy_shards`); LoRA adapters started the same whole or in shards (`init_adapters`). A leaf of the models layer: the
families and the pipeline loader both use it."""

from __future__ import annotations

import json
import math
import os

import torch

from mmrl.config import SHARDED
from mmrl.errors import ConfigError

READ_BATCH = 256 * 2**20  # bytes read through one safetensors mapping before it is reopened (its pages count as
                          # resident memory while it is open)


def shardable_weights(folder: str) -> bool:
    """Whether `folder` (a model component) holds safetensors weights that `load_into_shards` reads."""
    return os.path.isdir(folder) and any(f.endswith(".safetensors") for f in os.listdir(folder))


def weight_files(folder: str) -> list[str]:
    """The safetensors files of a model folder: those its index (*.safetensors.index.json) names when sharded, else
    the files without a variant infix (diffusion_pytorch_model.safetensors, not ...fp16.safetensors) if any."""
    names = os.listdir(folder)
    index = [f for f in names if f.endswith(".safetensors.index.json")]
    if index:
        return sorted(set(json.load(open(os.path.join(folder, index[0])))["weight_map"].values()))
    files = sorted(f for f in names if f.endswith(".safetensors"))
    return [f for f in files if f.count(".") == 1] or files


def meta_component(folder: str, name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The diffusers model `folder/name` (its config.json class) with its parameters on the meta device, in the
    dtypes `from_pretrained(dtype=dtype)` gives them (modules the class keeps in fp32 stay fp32); buffers are real
    (computed by the constructor: some, like SD3's positional table, are not in the weight files)."""
    import diffusers
    from accelerate import init_empty_weights

    config = json.load(open(os.path.join(folder, name, "config.json")))
    cls = getattr(diffusers, config["_class_name"])
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config)
    return to_load_dtype(model, dtype).eval()


def to_load_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` (built on the meta device) with the dtypes `from_pretrained(dtype=dtype)` gives: floating tensors in
    `dtype`, but those of the modules its class keeps in fp32 (`_keep_in_fp32_modules`, diffusers and transformers)."""
    keep = getattr(type(model), "_keep_in_fp32_modules", None) or ()
    for tname, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point() and not any(k in tname.split(".") for k in keep):
            t.data = t.data.to(dtype)
    return model


def sharded_start(cfg, dist) -> bool:
    """Whether a run builds its trained model on the meta device and reads it into FSDP2 shards: FSDP on several
    processes, full fine-tuning or LoRA (the frozen base then sharded in model.dtype, the adapters started by
    `init_adapters`); each policy adds what else it needs (safetensors weights, no model.offload)."""
    return dist is not None and dist.world > 1 and dist.parallel in SHARDED


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a peft LoRA adapter's (not in the base model's weight files)."""
    return ".lora_" in name


def file_key(name: str) -> str:
    """The weight files' key of parameter `name` of a model with peft adapters injected: a wrapped layer keeps its
    base weight at `<layer>.base_layer.weight`, saved as `<layer>.weight`."""
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def init_adapters(module: torch.nn.Module, init: bool | str, seed: int) -> None:
    """The starting values of `module`'s LoRA adapters, the same whole or in FSDP2 shards (so several processes start
    where one does): every A drawn whole on the CPU by one generator seeded `seed`, parameters in name order, as peft
    draws it (`init` = LoraConfig.init_lora_weights: True, kaiming-uniform with a = sqrt(5); "gaussian", N(0, 1/r)),
    every B zero; each rank keeps its rows. Called after peft has injected the adapters (its own draws overwritten)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if not is_adapter(name):
            continue
        local, rows = _local_slice(p)
        if ".lora_B." in name:
            local.zero_()
            continue
        if ".lora_A." not in name:
            raise ValueError(f"{name}: init_adapters starts LoRA's lora_A / lora_B of linear and conv layers only")
        whole = torch.empty(p.shape)
        if init is True:
            torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=g)
        elif init == "gaussian":
            torch.nn.init.normal_(whole, std=1 / whole.shape[0], generator=g)
        else:
            raise ValueError(f"init_lora_weights={init!r}: init_adapters draws True (kaiming) or 'gaussian'")
        local.copy_(whole[rows].reshape(local.shape))


def _persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(f"{mn}.{bn}" if mn else bn, b) for mn, m in module.named_modules() for bn, b in m._buffers.items()
            if b is not None and bn not in m._non_persistent_buffers_set]


def materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Storage on `device` for the meta parameters of `module` (FSDP2: this rank's shards only), uninitialized;
    its real buffers keep their values."""
    kept = {n: b for n, b in module.named_buffers()}
    module.to_empty(device=device)
    with torch.no_grad():
        for n, b in module.named_buffers():
            if not kept[n].is_meta:
                b.copy_(kept[n])


def _local_slice(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, its slice of the whole tensor): an FSDP2 DTensor's shard, or the whole tensor."""
    if not hasattr(t, "device_mesh"):
        return t, tuple(slice(0, n) for n in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def load_into_shards(module: torch.nn.Module, folder: str, device: torch.device, prefix: str = "") -> None:
    """Fill `module` (built by `meta_component`, then sharded by `fully_shard`, or whole) from the safetensors
    files of `folder`: each rank allocates and reads only its own shard of every parameter (rows of dim 0 under
    FSDP2), cast to the parameter's dtype (fp32 master weights are upcast shard by shard). Every parameter and
    persistent buffer must be in the files with its shape; else ValueError naming the folder and the keys.
    prefix: `module` is a part of the model the files hold (a transformers model's `model.`): parameter `n` is read
    from key `prefix + n`, and the files' other keys are not this call's (no "unexpected" check). With peft adapters
    injected, the base layers are read from their files' keys (`file_key`) and the adapters are left for
    `init_adapters` (uninitialized here)."""
    from safetensors import safe_open

    materialize(module, device)
    where: dict[str, str] = {}
    for f in weight_files(folder):
        with safe_open(os.path.join(folder, f), "pt") as h:
            where.update({k[len(prefix):]: f for k in h.keys() if k.startswith(prefix)})
    targets = [(file_key(n), t) for n, t in [*module.named_parameters(), *_persistent_buffers(module)]
               if not is_adapter(n)]
    missing = [prefix + n for n, _ in targets if n not in where]
    extra = [] if prefix else sorted(set(where) - {n for n, _ in targets})
    if missing or extra:
        raise ConfigError(f"{folder}: the weight files do not match {type(module).__name__}'s config.json: missing "
                          f"{missing[:5]}, unexpected {extra[:5]} ({len(missing)} / {len(extra)} in all)")
    by_file: dict[str, list] = {}
    for n, t in targets:
        by_file.setdefault(where[n], []).append((n, t))
    for f, items in by_file.items():
        h, read = None, 0
        for n, t in items:
            if h is None or read > READ_BATCH:  # reopen: the pages read so far leave the resident set
                h, read = safe_open(os.path.join(folder, f), "pt", device="cpu"), 0
            part = h.get_slice(prefix + n)
            if tuple(part.get_shape()) != tuple(t.shape):
                raise ConfigError(f"{folder}: {prefix + n} has shape {tuple(part.get_shape())} in {f}, the model "
                                  f"expects {tuple(t.shape)}: is config.json the one these weights were saved with?")
            local, rows = _local_slice(t)
            value = part[rows] if t.dim() else h.get_tensor(prefix + n)
            local.copy_(value.reshape(local.shape))
            read += value.numel() * value.element_size()
        del h


@torch.no_grad()
def copy_shards(src: torch.nn.Module, dst: torch.nn.Module, device: torch.device) -> None:
    """Fill `dst` (a meta copy of `src`, sharded the same way, maybe in another dtype) from `src`'s local shards:
    the frozen KL reference from the live transformer, never whole on a rank."""
    materialize(dst, device)
    pairs = list(zip([*src.named_parameters(), *_persistent_buffers(src)],
                     [*dst.named_parameters(), *_persistent_buffers(dst)]))
    for (ns, s), (nd, d) in pairs:
        assert ns == nd and s.shape == d.shape, (ns, nd)  # deep copies of one module: same names, same layout
        d_local, s_local = _local_slice(d)[0], _local_slice(s)[0]
        d_local.copy_(s_local)
