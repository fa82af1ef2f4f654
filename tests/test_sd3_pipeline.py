"""Real loading code for SD3-class checkpoints: a tiny StableDiffusion3Pipeline saved with save_pretrained and
loaded by model.path, in latent space through its VAE; the policy contract holds there too."""

import pytest
import torch

from mmrl.compose import load_config
from mmrl.models.tiny_pipelines import build_tiny
from mmrl.policy import POLICIES
from mmrl.policy.flow import load_policy_checkpoint
from mmrl.testing.contract import check_policy


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sd3") / "tiny-sd3")
    build_tiny("sd3").save_pretrained(path)
    return path


@pytest.mark.parametrize("lora", [False, True])
def test_sd3_pipeline_policy_contract(sd3_dir, lora, tmp_path):
    cfg = load_config(None, [f"model.path={sd3_dir}", "sampler.num_steps=4", "sampler.shift=3.0",
                             f"model.lora.enabled={lora}", "model.lora.rank=4"])
    pol = POLICIES["flow"](cfg)
    assert pol.model.latent_shape == (16, 8, 8)
    ro = pol.sample([{"prompt": "a cat"}, {"prompt": "a red car"}], 2, torch.Generator().manual_seed(0))
    assert check_policy(pol, [{"prompt": "a cat"}, {"prompt": "a red car"}])["max_ratio_error"] < 1e-5
    assert ro.outputs.shape == (4, 3, 16, 16)  # decoded by the VAE (x2 upsampling)
    assert ro.extras["latents"].shape == (4, 3, 16, 8, 8)
    ratio = torch.exp(pol.log_prob(ro, torch.arange(4)).log_prob - ro.old_log_prob)
    assert (ratio - 1).abs().max() < 1e-5
    if lora:
        with torch.no_grad():
            for p in pol.trainable_parameters():
                p.add_(0.01)
    pol.save_pretrained(str(tmp_path / "policy"))
    model = load_policy_checkpoint(str(tmp_path / "policy"))
    imgs = model.generate(["a cat"], [0], num_steps=2, cfg_scale=1.0, shift=3.0)
    assert imgs.shape == (1, 3, 16, 16) and torch.isfinite(imgs).all()


def test_missing_model_dir_error(tmp_path):
    cfg = load_config(None, [f"model.path={tmp_path}"])
    with pytest.raises(FileNotFoundError, match="has no model_index.json"):
        POLICIES["flow"](cfg)


def test_lora_adapter_loads_in_diffusers_and_peft(sd3_dir, tmp_path):
    """An adapter mmrl saved loads with the base pipeline's load_lora_weights and with PeftModel.from_pretrained,
    and both reproduce the trained policy's transformer output and its samples."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft import PeftModel

    from mmrl.models.pipelines import load_flow_model

    cfg = load_config(None, [f"model.path={sd3_dir}", "model.lora.enabled=true", "model.lora.rank=4",
                             "model.lora.alpha=16", "sampler.shift=3.0"])
    pol = POLICIES["flow"](cfg)
    with torch.no_grad():  # a trained adapter: B is no longer zero
        for p in pol.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    pol.save_pretrained(str(tmp_path / "policy"))
    x = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(1))
    enc, pooled = pol.model.encode_prompts(["a cat", "a red car"])
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        want = pol.model.velocity(x, sigma, enc, pooled)
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir)
    pipe.load_lora_weights(str(tmp_path / "policy"))
    base = load_flow_model(sd3_dir)
    with torch.no_grad():
        base.transformer = pipe.transformer
        got = base.velocity(x, sigma, enc, pooled)
        peft_tr = PeftModel.from_pretrained(SD3Transformer2DModel.from_pretrained(sd3_dir, subfolder="transformer"),
                                            str(tmp_path / "policy"))
        base.transformer = peft_tr
        got_peft = base.velocity(x, sigma, enc, pooled)
        base.transformer = SD3Transformer2DModel.from_pretrained(sd3_dir, subfolder="transformer")
        untrained = base.velocity(x, sigma, enc, pooled)
    assert (want - untrained).abs().max() > 1e-3  # the adapter matters
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_peft, want, atol=1e-5, rtol=1e-5)
    # samples: the diffusers-loaded transformer generates what the trained policy generates
    base.transformer = pipe.transformer
    torch.testing.assert_close(base.generate(["a cat"], [3], 4, 1.0, 3.0),
                               pol.model.generate(["a cat"], [3], 4, 1.0, 3.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lora", [True, False])
def test_export_writes_a_pipeline_diffusers_loads(sd3_dir, tmp_path, lora):
    from diffusers import StableDiffusion3Pipeline

    from mmrl.cli import main
    from mmrl.models.pipelines import load_flow_model

    cfg = load_config(None, [f"model.path={sd3_dir}", f"model.lora.enabled={lora}", "model.lora.rank=4",
                             "model.reference=none"])
    pol = POLICIES["flow"](cfg)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.02)
    pol.save_pretrained(str(tmp_path / "policy"))
    assert main(["export", str(tmp_path / "policy"), str(tmp_path / "merged")]) == 0
    assert isinstance(StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "merged")), StableDiffusion3Pipeline)
    merged = load_flow_model(str(tmp_path / "merged"))
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(2))
    enc, pooled = pol.model.encode_prompts(["a cat"])
    with torch.no_grad():
        torch.testing.assert_close(merged.velocity(x, torch.tensor([0.5]), enc, pooled),
                                   pol.model.velocity(x, torch.tensor([0.5]), enc, pooled), atol=1e-5, rtol=1e-5)
    assert main(["export", str(tmp_path / "policy"), str(tmp_path / "merged")]) == 2  # one message, no traceback
    with pytest.raises(FileExistsError, match="not empty"):
        main(["export", str(tmp_path / "policy"), str(tmp_path / "merged"), "--debug"])


def test_bf16_base_trains_fp32_weights(sd3_dir, tmp_path):
    """bf16 pipelines: the LoRA adapter is upcast to fp32 (the frozen base stays bf16), full fine-tuning keeps
    an fp32 transformer and needs mixed precision to compute in bf16; no frozen copy without a KL term."""
    cfg = load_config(None, [f"model.path={sd3_dir}", "model.dtype=bfloat16", "model.lora.enabled=true",
                             "model.lora.rank=4", "sampler.num_steps=3", "sampler.cfg_scale=1.0"])
    pol = POLICIES["flow"](cfg)
    assert {p.dtype for p in pol.trainable_parameters()} == {torch.float32}
    assert {p.dtype for p in pol.transformer.parameters() if not p.requires_grad} == {torch.bfloat16}
    ro = pol.sample([{"prompt": "a cat"}], 2, torch.Generator().manual_seed(0))
    lp = pol.log_prob(ro, torch.arange(2)).log_prob
    lp.sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in pol.trainable_parameters())
    assert torch.isfinite(lp).all()
    with pytest.raises(ValueError, match="train.mixed_precision=bf16"):
        load_config(None, [f"model.path={sd3_dir}", "model.dtype=bfloat16"])
    full = POLICIES["flow"](load_config(None, [f"model.path={sd3_dir}", "model.dtype=bfloat16",
                                               "train.mixed_precision=bf16"]))
    assert {p.dtype for p in full.trainable_parameters()} == {torch.float32}
    assert full._ref_copy is None  # algo.kl_coef = 0: no reference copy
    with_kl = POLICIES["flow"](load_config(None, [f"model.path={sd3_dir}", "algo.kl_coef=0.01"]))
    assert with_kl._ref_copy is not None


@pytest.mark.parametrize("cfg_scale", [1.0, 4.5])
def test_sd3_sampler_reproduces_the_pipeline(sd3_dir, cfg_scale):
    """SD3: FlowModel.generate (CLIP-L + CLIP-G + T5 tokens, shift 3, CFG with the empty negative prompt) gives
    StableDiffusion3Pipeline's image, 4 steps, same seed."""
    from diffusers import StableDiffusion3Pipeline

    from mmrl.models.pipelines import load_flow_model

    model = load_flow_model(sd3_dir, sample_size=8)
    ours = (model.generate(["a red circle"], [0], 4, cfg_scale, 3.0) + 1) / 2                   # [1, 3, 16, 16]
    theirs = StableDiffusion3Pipeline.from_pretrained(sd3_dir)(
        "a red circle", negative_prompt="", height=16, width=16, num_inference_steps=4, guidance_scale=cfg_scale,
        output_type="pt", generator=torch.Generator().manual_seed(0)).images
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
