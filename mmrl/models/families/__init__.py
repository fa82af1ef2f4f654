"""Model families: everything mmrl knows about one kind of flow generator, in one file each.

A `Family` holds its diffusers pipeline classes (what a folder's model_index.json names), how it becomes a
`FlowModel` (text encoding, the transformer call with its conditioning, CFG or guidance embedding, the sigma
schedule with its shift, the VAE decode), its LoRA target modules and the pipeline whose LoRA loader reads them,
its published sizes for `mmrl plan --arch` (transformer config and frozen parts), the shapes `mmrl plan` feeds the
transformer, and a tiny random-init builder of the real classes (tests, scripts/gpu_check.py). Loading, plan,
export, gpu_check and the tests read families; nothing else names a pipeline class.

Each fact lives in the family only: the loader stamps the family on the FlowModel it returns (`model.family`), and
training, `mmrl plan` and LoRA saving all read the targets and the LoRA pipeline from there, so a variant
(`dataclasses.replace(pixel.FAMILY, lora_targets=...)`) trains exactly what `mmrl plan` counts.

A folder's family is found from its model_index.json `_class_name` (several families of one pipeline class: the
one of the folder's transformer class); `model.family` names one explicitly, and a user's own family loads by
import path like a reward does (`model.family: my_family:FAMILY`; docs/extending.md).
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch

from mmrl.errors import ConfigError
from mmrl.registry import Registry


@dataclass(frozen=True)
class LoadOptions:
    """How a folder is loaded (config keys under `model`, kept in checkpoints as model_options)."""
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    sample_size: int | None = None       # latent H = W (None: the pipeline's default)
    num_frames: int | None = None        # video frames (Wan: None = 81)
    guidance: float = 3.5                # guidance-embedding scale (FLUX.1-dev, FLUX.2-dev)
    text_max_length: int | None = None   # prompt tokens (None: the pipeline's)
    meta: tuple[str, ...] = ()           # components built on the meta device, their weights not read (FSDP loads
                                         # them into shards: mmrl.models.pipelines.load_into_shards)


class PlanInputs(NamedTuple):
    """What `mmrl plan` feeds one transformer call on meta tensors."""
    call: Callable                 # (transformer, x, sigma, enc, pooled) -> like x
    latent_shape: tuple[int, ...]  # of one row, as the FlowModel sees it
    text_tokens: int               # L of enc [N, L, D]
    enc_dim: int                   # D
    pooled_dim: int                # P of pooled [N, P] (0 when the family has none)


@dataclass(frozen=True)
class Family:
    name: str
    pipelines: tuple[str, ...]     # model_index.json `_class_name`s this family loads (diffusers pipeline classes)
    transformer: str               # its diffusers transformer class
    load: Callable[[str, dict, LoadOptions], Any]   # (folder, model_index.json, options) -> FlowModel
    lora_targets: tuple[str, ...]  # peft target-module suffixes
    plan_inputs: Callable[[dict, str | None, LoadOptions], PlanInputs]  # (transformer config, folder or None, opts)
    lora_pipeline: str | None = None  # diffusers pipeline whose save_lora_weights / load_lora_weights read its adapters
    architectures: dict[str, dict] = field(default_factory=dict)  # --arch name -> {"config", "experts"?, "boundary"?}
    frozen_parts: tuple = ((), None)  # ([(transformers class, config class, config)], (diffusers VAE class, config))
    tiny: Callable[..., Any] | None = None  # (seed) -> a tiny random-init pipeline of the real classes
    condition_images: int = 0      # images an example carries as conditioning (edits, image-to-video); 0 = none
    diffusers: bool = True         # folders are diffusers pipelines (export through the pipeline class)
    video_vae: bool = False        # its VAE decodes clips [N, C, F, H, W] (Wan's, Qwen-Image's): images as 1 frame

    def vae_latent(self, latent: tuple[int, ...]) -> tuple[int, ...]:
        """One latent as the family's VAE decodes it: an image latent (C, H, W) gains a frame axis (C, 1, H, W)
        for a video VAE; a video latent (C, F, H, W), or any latent of an image VAE, is unchanged."""
        return (latent[0], 1, *latent[1:]) if self.video_vae and len(latent) == 3 else tuple(latent)


# every module of this package but `common` is one family, registered under the module's name: adding a family is
# adding its file (imported on first use)
FAMILIES = Registry("model family", {
    m.name: f"{__name__}.{m.name}:FAMILY" for m in pkgutil.iter_modules(__path__) if m.name != "common"})


def families() -> list[Family]:
    return [FAMILIES[name] for name in list(FAMILIES)]


def family_for(pipeline_class: str | None, name: str | None = None, where: str = "model_index.json",
               transformer: str | None = None) -> Family:
    """The family named `name` (a registered name or package.module:NAME), else the one that loads
    `pipeline_class`: of several (mmrl's pixel image and video models), the one of the `transformer` class, else
    the first registered."""
    if name:
        family = FAMILIES[name]
        if not isinstance(family, Family):
            raise TypeError(f"model.family={name!r} is a {type(family).__name__}, not an mmrl.models.families.Family")
        return family
    found = [f for f in families() if pipeline_class in f.pipelines]
    if found:
        return next((f for f in found if f.transformer == transformer), found[0])
    known = sorted({p for f in families() for p in f.pipelines})
    raise ConfigError(f"unsupported pipeline class {pipeline_class!r} in {where}; mmrl's families load {known}. "
                      f"Another model: write a family (docs/extending.md) and set model.family=your_module:FAMILY")


def lora_targets(family: Family | None, target_modules=()) -> list[str]:
    """The modules LoRA adapts in a model of `family` (peft module-name suffixes): `target_modules`
    (model.lora.target_modules) when given, else the family's. The flow policy and `mmrl plan` both ask here."""
    if target_modules:
        return list(target_modules)
    if family is None:
        raise ConfigError("LoRA on a FlowModel without a family (mmrl/models/families): nothing names its LoRA "
                          "targets; set model.lora.target_modules to the module-name suffixes to adapt")
    return list(family.lora_targets)


def transformer_class(index: dict) -> str | None:
    """The transformer class a folder's model_index.json names (diffusers: `transformer: [library, class]`; mmrl's
    pixel folders: `transformer_class`), None when it names none."""
    entry = index.get("transformer")
    return index.get("transformer_class") or (entry[1] if isinstance(entry, list) and len(entry) == 2 else None)


def family_of(index: dict, name: str | None = None, where: str = "model_index.json") -> Family:
    """The family that loads the folder of model_index.json `index` (`name`: model.family, else found from the
    index; see family_for), refusing one whose transformer class is not the folder's."""
    tr = transformer_class(index)
    family = family_for(index.get("_class_name"), name, where, transformer=tr)
    if tr and tr != family.transformer:
        raise ConfigError(f"{where} names a {tr} transformer, but the family {family.name!r} loads a "
                          f"{family.transformer}: set model.family to a family of {tr}, or leave it unset to let the "
                          f"folder pick one")
    return family


def published_architectures() -> dict[str, tuple[Family, dict]]:
    """`mmrl plan --arch` names of every built-in family -> (family, its entry)."""
    return {arch: (f, entry) for f in families() for arch, entry in f.architectures.items()}


def all_architectures() -> dict[str, dict]:
    """Every `mmrl plan --arch` name -> {"policy": flow | token, "config", ...}: the token policies' published
    architectures (mmrl/models/architectures.py) and every family's (flow ones also carry "family")."""
    from mmrl.models.architectures import ARCHITECTURES

    flow = {name: {"policy": "flow", "family": f, **entry} for name, (f, entry) in published_architectures().items()}
    return {**ARCHITECTURES, **flow}
