"""Qwen-Image and Z-Image through the flow policy: tiny pipelines of the real classes (QwenImagePipeline: Qwen2.5-VL
text encoder, QwenImageTransformer2DModel, the Qwen-Image VAE; ZImagePipeline: Qwen3 text encoder,
ZImageTransformer2DModel, the FLUX VAE) saved with save_pretrained and loaded by model.path. mmrl's sampler reproduces
each pipeline's own images; the policy passes the contract with LoRA on the architecture's targets (both objectives);
the adapter mmrl saves loads with the pipeline's load_lora_weights."""

from functools import partial

import pytest
import torch

from mmrl.compose import load_config
from mmrl.models.families.common import TEXT_LEN as QWEN_IMAGE_TEXT_LEN
from mmrl.models.pipelines import load_flow_model
from mmrl.models.tiny_pipelines import build_tiny
from mmrl.policy import POLICIES
from mmrl.testing.contract import check_policy
from mmrl.testing.family import check_lora_in_diffusers

PROMPTS = [{"prompt": "a red circle"}, {"prompt": "two green triangles left of a dog"}]


# name -> (builder, pipeline class, sampler.shift, image side for the pipeline call, pipeline kwargs)
PIPES = {"qwen_image": (partial(build_tiny, "qwen_image"), "QwenImagePipeline", 1.0, 64, {"true_cfg_scale": 1.0}),
         "z_image": (partial(build_tiny, "z_image"), "ZImagePipeline", 3.0, 16, {"guidance_scale": 0.0})}


@pytest.fixture(scope="module", params=list(PIPES))
def pipe_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pipelines") / request.param)
    PIPES[request.param][0]().save_pretrained(path)
    return request.param, path


def policy(name, path, *items):
    return POLICIES["flow"](load_config(None, [f"model.path={path}", "model.sample_size=8", "sampler.num_steps=4",
                                               f"sampler.shift={PIPES[name][2]}",
                                               "sampler.cfg_scale=1.0", "model.lora.enabled=true",
                                               "model.lora.rank=4", *items]))


def test_sampler_reproduces_the_pipeline(pipe_dir):
    """Same seed, 4 steps, no CFG: FlowModel.generate (the pipeline's schedule, padded masked prompt) gives the
    pipeline's image up to float rounding."""
    import diffusers

    name, path = pipe_dir
    _, cls, shift, side, kwargs = PIPES[name]
    model = load_flow_model(path, sample_size=8)
    assert model.latent_shape == (16, 8, 8)
    enc, mask = model.encode_prompts(["a red circle", "two green triangles left of a dog"])
    assert enc.shape == (2, QWEN_IMAGE_TEXT_LEN, 32) and mask.shape == (2, QWEN_IMAGE_TEXT_LEN)
    assert 0 < mask[0].sum() < mask[1].sum() < QWEN_IMAGE_TEXT_LEN  # the padding is masked, per prompt
    ours = (model.generate(["a red circle"], [0], 4, 1.0, shift) + 1) / 2
    pipe = getattr(diffusers, cls).from_pretrained(path)
    theirs = pipe("a red circle", height=side, width=side, num_inference_steps=4, output_type="pt", **kwargs,
                  generator=torch.Generator().manual_seed(0), max_sequence_length=QWEN_IMAGE_TEXT_LEN).images
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("loss", ["ppo_clip", "nft"])
def test_policy_contract_with_lora(pipe_dir, loss):
    name, path = pipe_dir
    pol = policy(name, path, f"algo.objective.name={loss}")
    lora = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in pol.transformer.named_parameters() if "lora_A" in n}
    assert lora >= ({"to_q", "add_q_proj", "proj"} if name == "qwen_image" else {"to_q", "to_k", "to_v"})
    assert check_policy(pol, PROMPTS, 2)["max_ratio_error"] < 1e-5
    ro = pol.sample(PROMPTS, 2, torch.Generator().manual_seed(0))
    side = PIPES[name][3]
    assert ro.outputs.shape == (4, 3, side, side) and ro.outputs.abs().max() <= 1


def test_lora_loads_in_diffusers(pipe_dir, tmp_path):
    import diffusers

    name, path = pipe_dir
    base = load_flow_model(path, sample_size=8)
    x, sigma = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0.7, 0.3])
    enc, mask = base.encode_prompts(["a cat", "a red car"])
    check_lora_in_diffusers(policy(name, path), getattr(diffusers, PIPES[name][1]).from_pretrained(path), base, x,
                            sigma, enc, mask, str(tmp_path / "policy"))


def test_qwen_image_true_cfg_reproduces_the_pipeline(tmp_path):
    """Qwen-Image guides with its pipeline's "true CFG" (the guided velocity rescaled, per packed token, to the
    conditional one's norm): at CFG 4 with the empty negative prompt, FlowModel.generate gives the pipeline's image;
    plain CFG (v_u + w (v_c - v_u)) does not."""
    from diffusers import QwenImagePipeline

    path = str(tmp_path / "qwen_image")
    build_tiny("qwen_image").save_pretrained(path)
    model = load_flow_model(path, sample_size=8)
    ours = (model.generate(["a red circle"], [0], 4, 4.0, 1.0) + 1) / 2
    theirs = QwenImagePipeline.from_pretrained(path)("a red circle", negative_prompt="", true_cfg_scale=4.0, height=64,
                                                     width=64, num_inference_steps=4, output_type="pt",
                                                     generator=torch.Generator().manual_seed(0),
                                                     max_sequence_length=QWEN_IMAGE_TEXT_LEN).images
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    model.guide = None  # plain CFG
    plain = (model.generate(["a red circle"], [0], 4, 4.0, 1.0) + 1) / 2
    assert (plain - theirs).abs().max() > 10 * (ours - theirs).abs().max()
