"""`mmrl export CHECKPOINT OUT`: a trained policy as a plain model folder other tools load without mmrl.

- flow policy on a diffusers pipeline (SD3 / FLUX / Wan): the base pipeline with the LoRA fused into the
  transformer (or the fully fine-tuned transformer swapped in), written by `pipe.save_pretrained(OUT)`;
- flow policy on mmrl's pixel model: the model folder with the merged transformer;
- token policy: `merge_and_unload()` of the peft adapter (or the full model), with its processor, written by
  `save_pretrained(OUT)`.
"""

from __future__ import annotations

import json
import os
import shutil

from mmrl.checkpoint import policy_folder, share
from mmrl.errors import MissingFile, TargetExists
from mmrl.policy.kinds import kind_of
from mmrl.registry import import_path


def export(checkpoint: str, out: str) -> str:
    """Write the merged model of `checkpoint` (a policy folder, a trainer checkpoint iter-N, or a run folder: its
    newest intact checkpoint) to `out`. A damaged checkpoint is refused (mmrl.errors.DamagedCheckpoint)."""
    if os.path.exists(out) and os.listdir(out):
        raise TargetExists(f"{out!r} exists and is not empty: choose a new folder")
    folder = policy_folder(checkpoint)  # an intact checkpoint's policy/ (built from its shards when missing)
    if folder is None:
        raise MissingFile(f"{checkpoint!r} has no mmrl_policy.json: point at a policy folder written by mmrl "
                          f"(runs/NAME, runs/NAME/checkpoints/iter-N or its policy/)")
    checkpoint = folder
    meta_file = os.path.join(checkpoint, "mmrl_policy.json")
    meta = json.load(open(meta_file))
    tmp = out.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    kind = kind_of(meta["policy"])  # a user's own policy: a transformers model folder
    import_path(kind.export if kind is not None else "mmrl.export:export_transformers")(checkpoint, meta, tmp)
    share(tmp)  # safetensors writes owner-only files: the umask's permissions, so teammates can load the export
    os.replace(tmp, out)
    return out


def diffusers_index(out: str) -> None:
    """Make mmrl's pixel image model folder `out` a diffusers pipeline folder: its model_index.json names each
    component's library and class (mmrl's loader reads the same file), and mmrl/models/pixel_pipeline.py goes beside
    it as pipeline.py (`DiffusionPipeline.from_pretrained(out, custom_pipeline=out)`)."""
    import shutil

    import diffusers

    path = os.path.join(out, "model_index.json")
    index = json.load(open(path))
    index.update(_diffusers_version=diffusers.__version__, transformer=["diffusers", "SD3Transformer2DModel"],
                 text_encoder=["transformers", "CLIPTextModelWithProjection"],
                 tokenizer=["transformers", "PreTrainedTokenizerFast"],
                 scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"])
    with open(path, "w") as f:
        json.dump(index, f, indent=2)
    shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "pixel_pipeline.py"),
                os.path.join(out, "pipeline.py"))


def how_to_load(out: str) -> str:
    """How to load an exported folder, for `mmrl export` to print."""
    if os.path.isfile(os.path.join(out, "pipeline.py")):
        return (f'DiffusionPipeline.from_pretrained("{out}", custom_pipeline="{out}", trust_remote_code=True)  '
                f'# diffusers; the code it trusts is {out}/pipeline.py, written by mmrl')
    if os.path.isfile(os.path.join(out, "model_index.json")):
        return f'DiffusionPipeline.from_pretrained("{out}")  # diffusers'
    return f'AutoModel.from_pretrained("{out}") / AutoProcessor.from_pretrained("{out}")  # transformers'


def export_diffusers(checkpoint: str, meta: dict, out: str) -> None:
    import diffusers

    from mmrl.models.families import family_for
    from mmrl.policy.base import base_model_path
    from mmrl.policy.flow import _link_base_parts, load_policy_checkpoint

    base = base_model_path(meta, checkpoint)
    cls = json.load(open(os.path.join(base, "model_index.json")))["_class_name"]
    if not family_for(cls, meta.get("model_options", {}).get("family")).diffusers:
        # mmrl's pixel model: merged transformer + the base's text encoder and tokenizer
        model = load_policy_checkpoint(checkpoint)
        if meta["lora"]:
            model.transformer.fuse_lora()
            model.transformer.unload_lora()
        model.transformer.save_pretrained(os.path.join(out, "transformer"))
        _link_base_parts(base, out)
        if type(model.transformer).__name__ == "SD3Transformer2DModel":  # an image model: loadable by diffusers
            diffusers_index(out)
        return
    pipe = getattr(diffusers, cls).from_pretrained(base)
    if meta["lora"]:
        pipe.load_lora_weights(checkpoint)
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    else:
        pipe.transformer = type(pipe.transformer).from_pretrained(os.path.join(checkpoint, "transformer"))
    pipe.save_pretrained(out)


def export_transformers(checkpoint: str, meta: dict, out: str) -> None:
    from mmrl.policy.token import load_token_policy

    pol = load_token_policy(checkpoint)
    model = pol.model.merge_and_unload() if meta["lora"] else pol.model
    model.save_pretrained(out)
    pol.processor.save_pretrained(out)
