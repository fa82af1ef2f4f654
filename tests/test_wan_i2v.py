"""Wan2.x image-to-video through the flow policy: tiny WanImageToVideoPipelines of the real classes (UMT5, the 3-D
transformer, the causal video VAE; Wan2.1's CLIP vision tower; Wan2.2 A14B's two experts; TI2V-5B's
expand_timesteps) saved with save_pretrained and loaded by model.path. mmrl's ODE sampler reproduces the pipeline's
videos with and without CFG; the policy passes the contract with LoRA (both experts trained); the adapters mmrl
saves load with the pipeline's load_lora_weights; `mmrl plan` sizes the published architectures."""

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.compose import load_config
from mmrl.models.families.wan_i2v import CLIP_TOKENS, TEXT_LEN
from mmrl.models.pipelines import load_flow_model
from mmrl.models.tiny_pipelines import build_tiny
from mmrl.policy import POLICIES
from mmrl.policy.flow import load_policy_checkpoint
from mmrl.testing.contract import check_policy

LAYOUTS = ("wan21", "wan22_a14b", "ti2v")
SHIFT = 5.0  # the tiny pipelines' scheduler shift (Wan2.2 I2V's): sigmas 1, .94 | .83, .62 around boundary 0.9


def picture(seed: int, size=(48, 40)) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_i2v")
    paths = {}
    for layout in LAYOUTS:
        paths[layout] = str(root / layout)
        build_tiny("wan_i2v", layout=layout).save_pretrained(paths[layout])
    for i in range(2):
        picture(i).save(root / f"image{i}.png")
    paths["examples"] = [{"prompt": "a red circle moving left", "image": str(root / "image0.png")},
                         {"prompt": "a cat", "image": str(root / "image1.png")}]
    return paths


def policy(path, *items):
    return POLICIES["flow"](load_config(None, [f"model.path={path}", "model.sample_size=4", "model.num_frames=5",
                                               "sampler.num_steps=4", f"sampler.shift={SHIFT}", "sampler.cfg_scale=1.0",
                                               "model.lora.enabled=true", "model.lora.rank=4", *items]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sampler_reproduces_the_pipeline(folders, layout):
    """Same seed, 4 steps, CFG 1 and 4 (the negative branch on the same image conditioning): FlowModel.generate gives
    WanImageToVideoPipeline's video [1, 3, 5, 32, 32] up to float rounding; the image matters."""
    from diffusers import WanImageToVideoPipeline

    path, image = folders[layout], picture(0)
    model = load_flow_model(path, sample_size=4, num_frames=5)
    assert model.latent_shape == (16, 2, 4, 4)                    # 5 frames -> 2 latent frames of 4 x 4
    enc, pooled = model.encode_prompts(["a cat", ""], [[image], [picture(1)]])
    cond = {"wan21": 20 * 2 * 4 * 4 + 17 * 16, "wan22_a14b": 20 * 2 * 4 * 4, "ti2v": 16 * 4 * 4}[layout]
    assert enc.shape == (2, TEXT_LEN, 32) and pooled.shape == (2, cond)  # 17 tiny CLIP tokens of width 16
    assert (model.transformer_2 is not None) == (layout == "wan22_a14b")
    pipe = WanImageToVideoPipeline.from_pretrained(path)
    diffs = {}
    for w in (1.0, 4.0):
        ours = (model.generate(["a red circle"], [0], 4, w, SHIFT, images=[[image]]) + 1) / 2  # [1, 3, F, H, W]
        theirs = pipe(image=image, prompt="a red circle", height=32, width=32, num_frames=5, num_inference_steps=4,
                      guidance_scale=w, output_type="pt", generator=torch.Generator().manual_seed(0)).frames
        diffs[w] = (ours - theirs.permute(0, 2, 1, 3, 4)).abs().max().item()
    print(f"{layout}: max abs diff vs WanImageToVideoPipeline, CFG 1: {diffs[1.0]:.2e}, CFG 4: {diffs[4.0]:.2e}")
    assert max(diffs.values()) <= 1e-5
    other = (model.generate(["a red circle"], [0], 4, 4.0, SHIFT, images=[[picture(1)]]) + 1) / 2
    assert (other - ours).abs().max() > 1e-3


@pytest.mark.parametrize("layout,cfg", [("wan21", 3.0), ("wan22_a14b", 1.0), ("ti2v", 3.0)])
def test_policy_contract_with_lora(folders, layout, cfg):
    pol = policy(folders[layout], f"sampler.cfg_scale={cfg}")
    experts = [tr for _, tr in pol.experts()]
    assert len(experts) == (2 if layout == "wan22_a14b" else 1)
    for tr in experts:
        lora = [n for n, _ in tr.named_parameters() if "lora_A" in n]
        assert any("attn1.to_q" in n for n in lora) and any("attn2.to_k" in n for n in lora)
    if layout == "wan22_a14b":
        assert pol.model.boundary == 0.9 and pol.sigmas[1] >= 0.9 > pol.sigmas[2]  # 2 high-noise, 2 low-noise steps
    assert check_policy(pol, folders["examples"], 2)["max_ratio_error"] < 1e-5
    ro = pol.sample(folders["examples"], 2, torch.Generator().manual_seed(0))
    assert ro.outputs.shape == (4, 3, 5, 32, 32) and torch.isfinite(ro.outputs).all()
    out = pol.log_prob(ro, torch.arange(4))
    assert (out.log_prob - ro.old_log_prob).abs().max() < 1e-5
    out.log_prob.sum().backward()
    for tr in experts:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in tr.named_parameters() if "lora" in n)
    if layout == "ti2v":  # the first latent frame ends on the image's latents: the first video frame is the image's
        torch.testing.assert_close(ro.outputs[0::2, :, 0], ro.outputs[1::2, :, 0], atol=1e-5, rtol=0)
        assert (ro.outputs[0, :, 1:] - ro.outputs[1, :, 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["wan21", "wan22_a14b"])
def test_lora_loads_in_diffusers(folders, layout, tmp_path):
    from diffusers import WanImageToVideoPipeline

    pol = policy(folders[layout])
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for p in pol.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    pol.save_pretrained(str(tmp_path / "policy"))
    pipe = WanImageToVideoPipeline.from_pretrained(folders[layout])
    pipe.load_lora_weights(str(tmp_path / "policy"))
    if layout == "wan22_a14b":
        pipe.load_lora_weights(str(tmp_path / "policy" / "transformer_2"), load_into_transformer_2=True)
    base = load_flow_model(folders[layout], sample_size=4, num_frames=5)
    x = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.95, 0.4])                                  # one row per expert (Wan2.2)
    enc, pooled = base.encode_prompts(["a cat", "a red car"], [[picture(0)], [picture(1)]])
    with torch.no_grad():
        untrained = base.velocity(x, sigma, enc, pooled)
        want = pol.model.velocity(x, sigma, enc, pooled)
        base.transformer, base.transformer_2 = pipe.transformer, pipe.transformer_2
        got = base.velocity(x, sigma, enc, pooled)
    assert (want - untrained)[1].abs().max() > 1e-3 and (want - untrained)[0].abs().max() > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # mmrl's own checkpoint reloads through the family with the policy's options
        torch.testing.assert_close(load_policy_checkpoint(str(tmp_path / "policy")).velocity(x, sigma, enc, pooled),
                                   want, atol=1e-5, rtol=1e-5)


def test_a_text_to_video_folder_is_refused(tmp_path):
    path = str(tmp_path / "t2v")
    build_tiny("wan").save_pretrained(path)
    with pytest.raises(ValueError, match="text-to-video"):
        load_flow_model(path, sample_size=4, num_frames=5, family="wan_i2v")


# published sizes: Wan2.1-I2V-14B (its 32.8 GB fp16 transformer: 16.4 B), Wan2.2-I2V-A14B (two 14.29 B experts)
PUBLISHED = {"wan21-i2v-14b": ("configs/t2v/wan21_i2v_lora.yaml", 16.39e9, 1),
             "wan22-i2v-a14b": ("configs/t2v/wan22_i2v_a14b_lora.yaml", 2 * 14.29e9, 2)}


@pytest.mark.parametrize("arch", sorted(PUBLISHED))
def test_plan_at_real_size_and_recipes(arch):
    from mmrl.plan import plan

    config, params, experts = PUBLISHED[arch]
    cfg = load_config(config)
    assert cfg.model.path.startswith("/models/") and cfg.task.name == "prompt_file" and cfg.model.lora.enabled
    p = plan(load_config(config, ["model.lora.enabled=false", "model.num_frames=5", "model.sample_size=16",
                                  "train.micro_batch=1"]), arch)
    print(f"{arch}: {p['params'] / 1e9:.2f} B parameters, frozen encoders {p['text_encoder_params'] / 1e9:.2f} B")
    assert p["params"] == pytest.approx(params, rel=0.01) and p["experts"] == experts
    assert p["trainable_params"] == p["params"]
    pooled = 20 * 2 * 16 * 16 + (CLIP_TOKENS * 1280 if arch == "wan21-i2v-14b" else 0)  # what the call unflattens
    from mmrl.models.families import LoadOptions
    from mmrl.models.families.wan_i2v import FAMILY
    inputs = FAMILY.plan_inputs(FAMILY.architectures[arch]["config"], None, LoadOptions(sample_size=16, num_frames=5))
    assert inputs.pooled_dim == pooled and inputs.latent_shape == (16, 2, 16, 16)
