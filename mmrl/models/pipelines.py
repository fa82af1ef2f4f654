"""`load_flow_model(path)`: a FlowModel from a generator folder, through its model family (mmrl/models/families/:
the folder's model_index.json `_class_name` picks it, or `family` names one, a user's own by import path), stamped
with that family (`model.family`: its LoRA targets and LoRA pipeline are read there and nowhere else).

Sharded loading (FSDP2, several processes): `load_flow_model(..., meta=("transformer",))` builds the trained
transformers on the meta device (parameters without storage; buffers real, they are small and some are not in the
weight files); after `fully_shard` splits them, `load_into_shards` gives each rank storage for its own shard only
and reads that shard's rows from the safetensors files, so no rank ever holds a whole copy; `copy_shards` fills a
second sharded module (the frozen KL reference) from the first, shard by shard, in its own dtype.
"""

from __future__ import annotations

import json
import os

import torch

from mmrl.errors import MissingFile
from mmrl.models.families import LoadOptions, families, family_of
from mmrl.models.families.pixel import PARTS as PIXEL_PARTS
from mmrl.models.flow_model import FlowModel
from mmrl.models.pixel_t2i import PIPELINE_CLASS


def missing_parts(path: str, index: dict) -> list[str]:
    """The component folders a pipeline's model_index.json names that `path` lacks."""
    parts = PIXEL_PARTS if index.get("_class_name") == PIPELINE_CLASS else \
        [k for k, v in index.items() if isinstance(v, list) and v[0]]
    return [k for k in parts if not os.path.isdir(os.path.join(path, k))]


def read_index(path: str) -> dict:
    index_file = os.path.join(path, "model_index.json")
    if not os.path.isfile(index_file):
        known = sorted(p for f in families() for p in f.pipelines if p != PIPELINE_CLASS)
        raise MissingFile(f"{path!r} has no model_index.json: point model.path at a diffusers pipeline folder "
                          f"({', '.join(known)}) or an mmrl pixel-model folder (scripts/pretrain_world.py "
                          f"writes one)")
    return json.load(open(index_file))


def load_flow_model(path: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                    sample_size: int | None = None, num_frames: int | None = None, guidance: float = 3.5,
                    text_max_length: int | None = None, family: str | None = None,
                    meta: tuple[str, ...] = ()) -> FlowModel:
    """Load a generator folder through its family. `sample_size` overrides the latent size (H = W), `num_frames`
    a video's length, `guidance` the guidance-embedding scale, `text_max_length` the prompt tokens; `family` a
    registered family name or package.module:NAME (else the folder's model_index.json class picks it); `meta`
    the components (trained transformers) built on the meta device, their weights left for `load_into_shards`.
    The model's `family` is the family that loaded it."""
    index = read_index(path)
    fam = family_of(index, family, where=os.path.join(path, "model_index.json"))
    missing = missing_parts(path, index)
    if missing:  # else from_pretrained would look for them on the hub ("couldn't connect to huggingface.co")
        raise MissingFile(f"{path!r}: model_index.json names {missing}, but the folder has no "
                          f"{', '.join(m + '/' for m in missing)}; copy the whole folder")
    model = fam.load(path, index, LoadOptions(dtype, device, sample_size, num_frames, guidance, text_max_length,
                                              tuple(meta)))
    model.family = fam
    for m in model.text_modules:
        m.requires_grad_(False).eval()
    for name in ("transformer", "transformer_2"):
        if getattr(model, name) is not None and name not in meta:
            getattr(model, name).to(device)
    for m in model.text_modules:
        m.to(device)
    return model
