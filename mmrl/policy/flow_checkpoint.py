"""A flow policy's files: adapters in peft's and diffusers' formats, full transformers, and loading a saved policy
back into a FlowModel (evaluation, export, `mmrl sample`)."""

from __future__ import annotations

import json
import os

import torch

from mmrl.models.flow_model import EXPERTS, FlowModel
from mmrl.models.pipelines import load_flow_model
from mmrl.policy.base import base_model_path, load_lora_adapter


def save_diffusers_lora(name: str | None, adapter: dict[str, torch.Tensor], lora_config, path: str) -> None:
    """pytorch_lora_weights.safetensors: the adapter as diffusers saves it through pipeline class `name` (the
    family's lora_pipeline; keys under `transformer.`, rank and alpha in the file's metadata), so
    `pipe.load_lora_weights(path)` of the base pipeline loads it as trained. None (mmrl's pixel models): not written."""
    import diffusers

    if name is None:
        return
    meta = {k: v for k, v in lora_config.to_dict().items() if k in ("r", "lora_alpha", "target_modules",
                                                                    "init_lora_weights", "use_dora")}
    meta["target_modules"] = sorted(meta["target_modules"])
    getattr(diffusers, name).save_lora_weights(path, transformer_lora_layers={k: v.cpu() for k, v in adapter.items()},
                                               transformer_lora_adapter_metadata=meta)


def _load_transformer_weights(transformer: torch.nn.Module, path: str, name: str = "transformer") -> None:
    """Copy the weights of `path/name` (written by save_pretrained, possibly sharded) into `transformer`."""
    transformer.load_state_dict(type(transformer).from_pretrained(os.path.join(path, name)).state_dict())


def _link_base_parts(base: str, path: str) -> None:
    """Copy the frozen parts (text encoder, tokenizer, scheduler, index) of a pixel model (a family whose folders are
    not diffusers pipelines) next to the saved transformer, so the folder loads on its own. Small for the embedded
    model; diffusers pipelines are not copied."""
    import shutil

    from mmrl.models.families import family_for

    index = json.load(open(os.path.join(base, "model_index.json")))
    if family_for(index.get("_class_name")).diffusers:
        return
    shutil.copy(os.path.join(base, "model_index.json"), path)
    for part in ("text_encoder", "tokenizer", "scheduler"):
        shutil.copytree(os.path.join(base, part), os.path.join(path, part), dirs_exist_ok=True)


def load_policy_checkpoint(path: str, device: str = "cpu") -> FlowModel:
    """A FlowModel with a saved policy's weights applied (full folder or base + LoRA adapter); a trainer
    checkpoint folder (checkpoints/iter-N) means its policy/."""
    if os.path.isfile(os.path.join(path, "policy", "mmrl_policy.json")):
        path = os.path.join(path, "policy")
    meta_file = os.path.join(path, "mmrl_policy.json")
    if not os.path.isfile(meta_file):
        return load_flow_model(path, device=device)  # a plain model folder
    meta = json.load(open(meta_file))
    options = meta.get("model_options", {})
    if not meta["lora"] and os.path.isfile(os.path.join(path, "model_index.json")):
        return load_flow_model(path, device=device)
    from peft import LoraConfig

    model = load_flow_model(base_model_path(meta, path), device=device, **options)
    for name in EXPERTS:
        tr = getattr(model, name, None)
        if tr is None:
            continue
        if not meta["lora"]:
            _load_transformer_weights(tr, path, name)
            continue
        where = path if name == "transformer" else os.path.join(path, name)
        tr.add_adapter(LoraConfig.from_pretrained(where))
        load_lora_adapter(tr, where)
        tr.eval()
    return model
