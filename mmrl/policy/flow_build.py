"""Building a flow policy from a config: the base model loaded (whole, or built on the meta device and read into
FSDP2 shards by `FlowPolicy.parallelize` when the run shards it), then wrapped as a FlowPolicy."""

from __future__ import annotations

import json
import logging
import os

from mmrl.algorithms.objective import build_objective
from mmrl.config import sample_chunk
from mmrl.devices import indexed, resolve_device, torch_dtype
from mmrl.errors import ConfigError
from mmrl.models.flow_model import EXPERTS
from mmrl.models.pipelines import load_flow_model
from mmrl.models.shard_load import shardable_weights, sharded_start
from mmrl.policy.base import reference_kind, resolve_model_path
from mmrl.policy.flow import FlowPolicy

log = logging.getLogger(__name__)


def build_flow_policy(cfg, dist=None) -> FlowPolicy:
    """The flow policy of `cfg`; `dist` (several processes): see `shard_on_load`."""
    dtype, device = torch_dtype(cfg.model.dtype), resolve_device(cfg.model.device)
    path = resolve_model_path(cfg.model.path)
    if os.path.isfile(os.path.join(path, "mmrl_policy.json")):
        raise ConfigError(f"{path!r} is an mmrl policy checkpoint; use it with mmrl eval, or set model.path to a "
                          f"base model folder")
    options = {"sample_size": cfg.model.sample_size, "num_frames": cfg.model.num_frames, "guidance": cfg.model.guidance,
               "text_max_length": cfg.model.text_max_length, "family": cfg.model.family}
    meta = shard_on_load(cfg, dist, path)
    model = load_flow_model(path, dtype, device, **options, meta=meta)
    return FlowPolicy(model=model, sampler_cfg=cfg.sampler, lora_cfg=cfg.model.lora, reference=reference_kind(cfg),
                      model_path=path, progress=cfg.log.progress, tree_cfg=cfg.tree, model_options=options,
                      micro_batch=sample_chunk(cfg.train), text_cache=cfg.model.text_cache, offload=cfg.model.offload,
                      objective=build_objective(cfg.algo).actions, device=indexed(device) if meta else None,
                      seed=cfg.train.seed)


def shard_on_load(cfg, dist, path: str) -> tuple[str, ...]:
    """The trained transformers to build on the meta device and load into FSDP2 shards after `parallelize` (so
    every rank holds 1/world of them from the first byte): FSDP on several processes (full fine-tuning, or LoRA's
    frozen base in its own dtype), from safetensors folders. model.offload (the reference stays whole on the CPU)
    and folders without safetensors load whole, as in one process."""
    if not sharded_start(cfg, dist) or cfg.model.offload:
        return ()
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        return ()  # load_flow_model says what the folder lacks
    index = json.load(open(os.path.join(path, "model_index.json")))
    names = tuple(n for n in EXPERTS if n == "transformer" or (index.get(n) or [None])[0])
    if not all(shardable_weights(os.path.join(path, n)) for n in names):
        log.warning("%s: no safetensors weights in %s; every rank loads the whole transformer before FSDP shards it",
                    path, ", ".join(n + "/" for n in names))
        return ()
    return names

