"""The family seam: a family's facts (LoRA targets, the pipeline that reads its adapters, its VAE's layout) are read
from the family by training and by `mmrl plan` alike, so a variant family cannot train one thing and plan another."""

import dataclasses
import os

import pytest

from mmrl.compose import load_config
from mmrl.models.families import FAMILIES, family_for, pixel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = os.path.join(ROOT, "tasks", "assets", "shapes-base")
MOTION = os.path.join(ROOT, "tasks", "assets", "motion-base")

VARIANT = '''
import dataclasses

from mmrl.models.families import pixel

VARIANT = dataclasses.replace(pixel.FAMILY, name="pixel_qv", lora_targets=("attn.to_q", "attn.to_v"))
'''


def test_a_variant_family_trains_what_plan_reports(tmp_path, monkeypatch):
    """The variant written as docs/extending.md suggests (the pixel family, LoRA on to_q / to_v only), named by
    import path: the policy trains exactly the adapters `mmrl plan` counts. The shapes base's SD3 transformer has
    4 blocks of width 4 heads x 32 = 128 (attn.to_q and attn.to_v: 128 -> 128 in each); a rank-r adapter on a
    128 -> 128 linear is r (128 + 128) parameters: 4 blocks x 2 targets x 8 x 256 = 16,384 at r = 8 (the parent's
    8 targets would train 31 adapters, 63,488)."""
    from mmrl.plan import plan
    from mmrl.policy.flow_build import build_flow_policy

    (tmp_path / "variant_family.py").write_text(VARIANT)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, [f"model.path={SHAPES}", "model.family=variant_family:VARIANT",
                             "model.lora.enabled=true", "model.lora.rank=8", "sampler.num_steps=3",
                             "train.threads=1"])
    pol = build_flow_policy(cfg)
    assert pol.model.family.name == "pixel_qv"
    trained = {n for n, p in pol.model.transformer.named_parameters() if p.requires_grad}
    assert trained and all(".to_q.lora_" in n or ".to_v.lora_" in n for n in trained), sorted(trained)[:4]
    n_trained = sum(p.numel() for p in pol.model.transformer.parameters() if p.requires_grad)
    planned = plan(cfg)["trainable_params"]
    assert n_trained == planned == 4 * 2 * 8 * (128 + 128)


def test_the_loader_stamps_the_family_it_loaded_with():
    """model.family is the family that loaded the folder (its targets and LoRA pipeline), the pixel video model's
    its own family, found by the folder's transformer class."""
    from mmrl.models.pipelines import load_flow_model

    assert load_flow_model(SHAPES).family is pixel.FAMILY
    assert load_flow_model(MOTION).family is FAMILIES["pixel_video"]
    video = FAMILIES["pixel_video"]
    assert video.lora_pipeline == "WanPipeline" and video.lora_targets != pixel.FAMILY.lora_targets


def test_family_lookup_by_pipeline_then_transformer():
    """Several families of one pipeline class: the folder's transformer class picks; none given, the first."""
    assert family_for("MMRLPixelPipeline", transformer="WanTransformer3DModel") is FAMILIES["pixel_video"]
    assert family_for("MMRLPixelPipeline", transformer="SD3Transformer2DModel") is pixel.FAMILY
    assert family_for("MMRLPixelPipeline") is pixel.FAMILY
    assert family_for("WanPipeline", transformer="WanTransformer3DModel") is FAMILIES["wan"]
    with pytest.raises(ValueError, match="model.family"):
        family_for("NoSuchPipeline")


@pytest.mark.parametrize("name, latent, expected", [
    ("sd3", (16, 128, 128), (16, 128, 128)),     # an image VAE decodes [N, C, H, W]
    ("qwen_image", (16, 128, 128), (16, 1, 128, 128)),  # Qwen-Image's video VAE: one frame
    ("wan", (16, 21, 60, 60), (16, 21, 60, 60)),  # a video latent already has its frames
])
def test_the_family_says_how_its_vae_decodes(name, latent, expected):
    assert FAMILIES[name].vae_latent(latent) == expected


def test_a_flow_model_without_family_needs_targets():
    """A builder's FlowModel without a family (docs/examples/tiny_generator.py gives one) has no LoRA targets: the
    policy names the two ways to give them."""
    import torch

    from mmrl.models.flow_model import FlowModel
    from mmrl.policy.flow import FlowPolicy

    cfg = load_config(None, ["model.lora.enabled=true"])
    net = torch.nn.Linear(2, 2)
    model = FlowModel(net, lambda t: None, lambda x: x, (2,))
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        FlowPolicy(model=model, sampler_cfg=cfg.sampler, lora_cfg=cfg.model.lora)
