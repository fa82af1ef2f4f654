"""FLUX.2-dev and FLUX.2-klein through the flow policy: tiny pipelines of the real classes (Flux2Pipeline: Mistral3 +
PixtralProcessor; Flux2KleinPipeline: Qwen3ForCausalLM, base and step-distilled; Flux2Transformer2DModel,
AutoencoderKLFlux2 with batch-norm statistics) saved with save_pretrained and loaded by model.path. mmrl's ODE sampler
reproduces each pipeline's image (dev's guidance embedding, klein-base's CFG, the distilled klein ignoring guidance,
FLUX.2's step-dependent schedule); the policy passes the contract with LoRA on the double- and single-stream
targets; its adapter loads with the pipeline's load_lora_weights; plan sizes the published models."""

import pytest
import torch

from mmrl.compose import load_config
from mmrl.models.families.flux2 import flux2_call
from mmrl.models.pipelines import load_flow_model
from mmrl.models.tiny_pipelines import build_tiny
from mmrl.plan import plan
from mmrl.policy import POLICIES
from mmrl.testing.contract import check_policy
from mmrl.testing.family import check_lora_in_diffusers

PROMPTS = [{"prompt": "a red circle"}, {"prompt": "two green triangles left of a dog"}]
SIZE = 16  # VAE latent side (x2 tiny VAE: 32 px images); x [16, 8, 8]
# name -> (family, builder kwargs, pipeline class, sampler.cfg_scale)
PIPES = {"dev": ("flux2", {}, "Flux2Pipeline", 1.0), "klein": ("flux2_klein", {}, "Flux2KleinPipeline", 4.0),
         "klein_distilled": ("flux2_klein", {"distilled": True}, "Flux2KleinPipeline", 1.0)}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux2")
    for name, (family, kw, _, _) in PIPES.items():
        build_tiny(family, **kw).save_pretrained(str(root / name))
    return {name: str(root / name) for name in PIPES}


def pipeline(path, name):
    import diffusers

    pipe = getattr(diffusers, PIPES[name][2]).from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_image(pipe, guidance_scale, steps=4):
    return pipe(prompt="a red circle", height=2 * SIZE, width=2 * SIZE, num_inference_steps=steps,
                guidance_scale=guidance_scale, output_type="pt", generator=torch.Generator().manual_seed(0)).images


@pytest.mark.parametrize("name, cfg, guidance", [("dev", 1.0, 4.0), ("klein", 1.0, 1.0), ("klein", 4.0, 4.0),
                                                 ("klein_distilled", 4.0, 4.0)])
def test_sampler_reproduces_the_pipeline(paths, name, cfg, guidance):
    """Same seed, 4 steps: FlowModel.generate gives the pipeline's image. dev: guidance embedding 4 (model.guidance),
    no CFG; klein base: CFG against the empty prompt (cfg 4) or none (1); distilled klein: guidance ignored."""
    model = load_flow_model(paths[name], sample_size=SIZE, guidance=guidance)
    assert model.latent_shape == (16, SIZE // 2, SIZE // 2)
    enc, pooled = model.encode_prompts(["a red circle", "two green triangles left of a dog"])
    assert enc.shape == (2, 512, 48) and pooled.shape == (2, 0)  # layers stacked: 3 x 16; padded to 512 tokens
    ours = (model.generate(["a red circle"], [0], 4, cfg, 1.0) + 1) / 2
    pipe = pipeline(paths[name], name)
    theirs = pipeline_image(pipe, guidance)
    diff = (ours - theirs).abs().max().item()
    print(f"{name} cfg {cfg} guidance {guidance}: max abs diff {diff:.2e}")
    assert ours.shape == (1, 3, 2 * SIZE, 2 * SIZE) and diff <= 1e-5
    torch.testing.assert_close(model.schedule(4, 1.0), pipe.scheduler.sigmas, atol=1e-6, rtol=0)
    if name == "klein_distilled":
        return
    # the guidance matters: another guidance scale gives another image
    other = pipeline_image(pipe, 2.0 if name == "dev" else (1.0 if cfg != 1.0 else 4.0))
    assert (other - theirs).abs().max() > 100 * max(diff, 1e-7)


def test_schedule_shift_depends_on_the_step_count(paths):
    """FLUX.2's mu is a function of the image tokens and the step count: 8 steps are not 4 steps interleaved, and
    the schedule matches the pipeline's at 7 steps too (the scheduler's sigmas after its call)."""
    model = load_flow_model(paths["klein"], sample_size=SIZE)
    s4, s8 = model.schedule(4, 1.0), model.schedule(8, 1.0)
    assert s4[0] == s8[0] == 1 and s4[-1] == s8[-1] == 0 and (s4[1:-1] - s8[2:-1:2]).abs().max() > 1e-3
    pipe = pipeline(paths["klein"], "klein")
    pipeline_image(pipe, 1.0, steps=7)
    torch.testing.assert_close(model.schedule(7, 3.0), pipe.scheduler.sigmas, atol=1e-6, rtol=0)


def test_encode_latents_is_the_pipelines_image_encoding(paths):
    """x0 of an image (offline data) in x's layout: patchified and normalized as the pipeline encodes references."""
    model = load_flow_model(paths["dev"], sample_size=SIZE)
    images = torch.rand(2, 3, 2 * SIZE, 2 * SIZE, generator=torch.Generator().manual_seed(0)) * 2 - 1
    x0 = model.encode_latents(images)
    assert x0.shape == (2, *model.latent_shape) and model.latent_shape[-1] * model.image_scale == 2 * SIZE
    with torch.no_grad():
        torch.testing.assert_close(x0, pipeline(paths["dev"], "dev")._encode_vae_image(images, None))


def test_call_flattens_and_restores_the_patch_grid():
    """A transformer returning its image tokens gives v = x: [N, 128, h, w] <-> [N, h w, 128] tokens, with the
    image ids (0, row, col, 0) and text ids (0, 0, 0, l), and dev's guidance embedding only when the model has one."""
    class Echo(torch.nn.Module):
        config = type("C", (), {"guidance_embeds": True})

        def forward(self, hidden_states, img_ids, txt_ids, guidance, **kw):
            assert hidden_states.shape == (2, 12, 128) and img_ids.shape == (1, 12, 4) and txt_ids.shape == (1, 5, 4)
            assert img_ids[0, 5].tolist() == [0, 1, 1, 0] and txt_ids[0, 4].tolist() == [0, 0, 0, 4]
            assert guidance.tolist() == [4.0, 4.0]
            return (hidden_states,)

    x = torch.randn(2, 128, 3, 4)
    assert torch.equal(flux2_call(4.0)(Echo(), x, torch.rand(2), torch.randn(2, 5, 48), torch.zeros(2, 0)), x)


def policy(path, cfg, *items):
    return POLICIES["flow"](load_config(None, [f"model.path={path}", f"model.sample_size={SIZE}", "model.guidance=4.0",
                                               "sampler.num_steps=4", f"sampler.cfg_scale={cfg}",
                                               "model.lora.enabled=true", "model.lora.rank=4", *items]))


@pytest.mark.parametrize("name", ["dev", "klein"])
def test_policy_contract_with_lora(paths, name):
    pol = policy(paths[name], PIPES[name][3])
    lora = {n.split(".lora_A")[0] for n, _ in pol.transformer.named_parameters() if "lora_A" in n}
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_q_proj",
            "transformer_blocks.0.attn.to_out.0", "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
            "single_transformer_blocks.0.attn.to_out"} <= lora
    assert check_policy(pol, PROMPTS, 2)["max_ratio_error"] < 1e-5
    ro = pol.sample(PROMPTS, 2, torch.Generator().manual_seed(0))
    assert ro.outputs.shape == (4, 3, 2 * SIZE, 2 * SIZE) and ro.outputs.abs().max() <= 1


@pytest.mark.parametrize("name", ["dev", "klein"])
def test_lora_loads_in_diffusers(paths, name, tmp_path):
    base = load_flow_model(paths[name], sample_size=SIZE, guidance=4.0)
    x = torch.randn(2, 16, SIZE // 2, SIZE // 2, generator=torch.Generator().manual_seed(1))
    enc, pooled = base.encode_prompts(["a cat", "a red car"])
    check_lora_in_diffusers(policy(paths[name], 1.0), pipeline(paths[name], name), base, x, torch.tensor([0.7, 0.3]),
                            enc, pooled, str(tmp_path / "policy"))


# published sizes: FLUX.2-dev "32 B" (its diffusers config instantiates 32.22 B) with Mistral Small 3.2 24 B;
# klein "4 B" (3.88 B) and "9 B" (9.08 B) with Qwen3-4B (4.02 B) and Qwen3-8B (8.19 B, the 9 B entry's frozen_parts)
PUBLISHED = {"flux2-dev": ("configs/t2i/flux2_dev_lora.yaml", 32e9, 24.0e9),
             "flux2-klein-4b": ("configs/t2i/flux2_klein_lora.yaml", 4e9, 4.02e9),
             "flux2-klein-9b": ("configs/t2i/flux2_klein_lora.yaml", 9e9, 8.19e9)}


@pytest.mark.parametrize("arch", sorted(PUBLISHED))
def test_plan_at_real_size(arch):
    config, params, text = PUBLISHED[arch]
    p = plan(load_config(config, ["model.lora.enabled=false", "train.micro_batch=1", "train.mixed_precision=bf16"]),
             arch)
    assert p["params"] == pytest.approx(params, rel=0.04) and p["vae_params"] == pytest.approx(84e6, rel=0.01)
    assert p["text_encoder_params"] == pytest.approx(text, rel=0.01)
    lora = plan(load_config(config, ["train.micro_batch=1"]), arch)
    assert 0 < lora["trainable_params"] < 0.03 * lora["params"]
    assert lora["activations_per_micro_batch_checkpointed_gib"] < lora["activations_per_micro_batch_gib"]
    print(f"{arch}: {p['params'] / 1e9:.2f} B, text {p['text_encoder_params'] / 1e9:.2f} B, full fine-tune "
          f"{p['total_gib']:.1f} GiB, LoRA {lora['total_gib']:.1f} GiB")


def test_recipes_load():
    klein = load_config("configs/t2i/flux2_klein_lora.yaml")
    assert klein.model.path == "/models/FLUX.2-klein-base-4B" and klein.sampler.cfg_scale == 4.0
    dev = load_config("configs/t2i/flux2_dev_lora.yaml")
    assert dev.model.path == "/models/FLUX.2-dev" and dev.model.guidance == 4.0 and dev.sampler.cfg_scale == 1.0
