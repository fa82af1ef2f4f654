"""FLUX.1 Kontext (image editing) through the flow policy: a tiny FluxKontextPipeline of the real classes saved with
save_pretrained and loaded by model.path. The conditioning image's latents ride in `pooled` and are appended to the
generated tokens in the call (ids (1, row, col), outputs dropped); mmrl's sampler reproduces the pipeline's own edit
(with and without its true CFG); the policy passes the contract with LoRA on examples carrying an `image` path; the
adapter it saves loads with the pipeline's load_lora_weights; `mmrl plan --arch flux1-kontext-dev` at real size."""

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.compose import load_config
from mmrl.models.families import flux_kontext
from mmrl.models.pipelines import load_flow_model
from mmrl.models.tiny_pipelines import build_tiny
from mmrl.policy import POLICIES
from mmrl.testing.contract import check_policy
from mmrl.testing.family import check_lora_in_diffusers

RECIPE = "configs/t2i/flux_kontext_edit_lora.yaml"
SIDE = 16  # output pixels (8 x 8 latents, the tiny VAE's x2); the conditioning images are saved at this size


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    """(pipeline folder, [two PNG paths of SIDE x SIDE])."""
    root = tmp_path_factory.mktemp("kontext")
    build_tiny("flux_kontext").save_pretrained(str(root / "pipe"))
    paths = []
    for i in range(2):
        pixels = np.random.default_rng(i).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / f"source{i}.png")
        paths.append(str(root / f"source{i}.png"))
    return str(root / "pipe"), paths


def rgb(path):
    with Image.open(path) as im:
        return im.convert("RGB")


def policy(path, *items):
    return POLICIES["flow"](load_config(None, [f"model.path={path}", "model.sample_size=8", "sampler.num_steps=4",
                                               "sampler.cfg_scale=1.0", "model.lora.enabled=true",
                                               "model.lora.rank=4", *items]))


def test_call_appends_the_image_tokens_and_keeps_the_generated_ones():
    """The transformer sees [x's 2x2 tokens | the image's] with ids (0, r, c) then (1, r, c), CLIP's pooled part
    only, timestep = sigma and the guidance; the call returns the first HW/4 output tokens unpacked."""
    seen = {}

    class Spy(torch.nn.Module):
        config = type("C", (), {"guidance_embeds": True, "pooled_projection_dim": 32})

        def forward(self, hidden_states, img_ids, **kw):
            seen.update(hidden_states=hidden_states, img_ids=img_ids, **kw)
            return (hidden_states * 2,)

    x, image = torch.randn(2, 16, 8, 4), torch.randn(2, 16, 8, 4)
    pooled = torch.cat([torch.randn(2, 32), image.flatten(1)], 1)               # [2, 32 + 16 * 8 * 4]
    out = flux_kontext.kontext_call(2.5)(Spy(), x, torch.tensor([0.3, 0.7]), torch.randn(2, 5, 32), pooled)
    torch.testing.assert_close(out, 2 * x)                                       # the image's outputs are dropped
    assert seen["hidden_states"].shape == (2, 16, 64)                            # 8 generated + 8 image tokens
    torch.testing.assert_close(seen["hidden_states"][:, 8:], flux_kontext.pack2x2(image))
    ids = seen["img_ids"]
    assert ids.shape == (16, 3) and ids[:8, 0].eq(0).all() and ids[8:, 0].eq(1).all()
    torch.testing.assert_close(ids[8:, 1:], ids[:8, 1:])                         # the same (row, col) grid
    assert ids[:8, 1:].tolist() == [[r, c] for r in range(4) for c in range(2)]
    torch.testing.assert_close(seen["pooled_projections"], pooled[:, :32])
    torch.testing.assert_close(seen["timestep"], torch.tensor([0.3, 0.7]))
    torch.testing.assert_close(seen["guidance"], torch.tensor([2.5, 2.5]))


@pytest.mark.parametrize("cfg", [1.0, 3.0])
def test_sampler_reproduces_the_pipeline(kontext, cfg, monkeypatch):
    """Same seed, 4 steps, the same PIL image: FlowModel.generate gives FluxKontextPipeline's edit (its true CFG
    with negative_prompt="" at cfg 3, the guidance embedding on both branches); _auto_resize=False keeps the image
    at the output size, as mmrl resizes it. With the image's ids at first coordinate 0, the edit differs."""
    from diffusers import FluxKontextPipeline

    path, images = kontext
    model = load_flow_model(path, sample_size=8)
    assert model.family.name == "flux_kontext" and model.latent_shape == (16, 8, 8)
    pil = rgb(images[0])
    ours = (model.generate(["make the circle red"], [0], 4, cfg, 1.0, images=[[pil]]) + 1) / 2
    true_cfg = {"true_cfg_scale": cfg, "negative_prompt": ""} if cfg != 1.0 else {}
    pipe = FluxKontextPipeline.from_pretrained(path)
    theirs = pipe(prompt="make the circle red", image=pil, height=SIDE, width=SIDE, max_area=SIDE * SIDE,
                  _auto_resize=False, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=32,
                  output_type="pt", generator=torch.Generator().manual_seed(0), **true_cfg).images
    diff = (ours - theirs).abs().max().item()
    print(f"cfg {cfg}: max |mmrl - FluxKontextPipeline| = {diff:.3g}")
    assert ours.shape == theirs.shape == (1, 3, SIDE, SIDE) and diff <= 1e-5
    # the conditioning matters: another image, or the image's tokens placed on the generated ids, change the edit
    other = (model.generate(["make the circle red"], [0], 4, cfg, 1.0, images=[[rgb(images[1])]]) + 1) / 2
    assert (other - theirs).abs().max() > 1e-3

    def same_ids(self, hidden_states, img_ids, **kw):  # the image's tokens on ids (0, row, col)
        out = self.transformer(hidden_states=torch.cat([hidden_states, self.tokens], 1),
                               img_ids=torch.cat([img_ids, img_ids]), **kw)[0]
        return (out[:, :hidden_states.shape[1]],)

    monkeypatch.setattr(flux_kontext._WithImage, "__call__", same_ids)
    wrong = (model.generate(["make the circle red"], [0], 4, cfg, 1.0, images=[[pil]]) + 1) / 2
    assert (wrong - theirs).abs().max() > 100 * max(diff, 1e-7)


def test_encode_puts_the_image_latents_after_clip_pooled(kontext):
    """pooled = [CLIP's pooled embedding | the image's z, flattened], each as the pipeline computes it."""
    from diffusers import FluxKontextPipeline

    path, images = kontext
    model, pipe = load_flow_model(path, sample_size=8), FluxKontextPipeline.from_pretrained(path)
    pils = [rgb(images[0]), rgb(images[1])]
    enc, pooled = model.encode_prompts(["a cat", "a dog"], [[pils[0]], [pils[1]]])
    assert enc.shape == (2, 32, 32) and pooled.shape == (2, 32 + 16 * 8 * 8)
    with torch.no_grad():
        clip = pipe.encode_prompt(["a cat", "a dog"], None, max_sequence_length=32)[1]                 # [2, 32]
        z = pipe._encode_vae_image(pipe.image_processor.preprocess(pils, SIDE, SIDE), None)           # [2, 16, 8, 8]
    torch.testing.assert_close(pooled[:, :32], clip, atol=1e-6, rtol=0)
    torch.testing.assert_close(pooled[:, 32:], z.flatten(1), atol=1e-5, rtol=0)
    # any image is stretched to the output size: a 24 x 40 one encodes as its 16 x 16 resize
    odd = pils[0].resize((24, 40))
    torch.testing.assert_close(model.encode_prompts(["a cat"], [[odd]])[1],
                               model.encode_prompts(["a cat"], [[odd.resize((SIDE, SIDE), Image.LANCZOS)]])[1])
    with pytest.raises(ValueError, match="one image per prompt"):
        model.encode_prompts(["a cat"])


def test_policy_contract_with_lora(kontext):
    path, images = kontext
    examples = [{"prompt": "make the circle red", "image": images[0]}, {"prompt": "add a dog", "image": images[1]}]
    pol = policy(path, "sampler.cfg_scale=2.0", "sampler.eval_cfg_scale=2.0")
    lora = [n for n, _ in pol.transformer.named_parameters() if "lora_A" in n]
    assert any("single_transformer_blocks" in n for n in lora) and any("add_q_proj" in n for n in lora)
    assert check_policy(pol, examples, 2)["max_ratio_error"] < 1e-5
    ro = pol.sample(examples, 2, torch.Generator().manual_seed(0))
    assert ro.extras["pooled"].shape == (4, 32 + 16 * 8 * 8) and ro.outputs.shape == (4, 3, SIDE, SIDE)
    assert (ro.outputs[0] - ro.outputs[2]).abs().max() > 1e-3  # rows edit their own images
    with pytest.raises(ValueError, match="no `image`"):
        pol.sample([{"prompt": "no image"}], 2, torch.Generator().manual_seed(0))


def test_lora_loads_in_diffusers(kontext, tmp_path):
    from diffusers import FluxKontextPipeline

    path, images = kontext
    base = load_flow_model(path, sample_size=8)
    x, sigma = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0.7, 0.3])
    enc, pooled = base.encode_prompts(["a cat", "a red car"], [[rgb(images[0])], [rgb(images[1])]])
    check_lora_in_diffusers(policy(path), FluxKontextPipeline.from_pretrained(path), base, x, sigma, enc, pooled,
                            str(tmp_path / "policy"))


@pytest.mark.slow  # ~15 s: the published size on the meta device
def test_plan_at_real_size_and_the_recipe():
    """FLUX.1 Kontext [dev] is FLUX.1-dev's transformer (11.9 B); the image tokens double the sequence."""
    from mmrl.plan import plan

    cfg = load_config(RECIPE)
    assert cfg.model.guidance == 2.5 and cfg.sampler.num_steps == 6 and cfg.model.sample_size == 64
    full = plan(load_config(RECIPE, ["model.lora.enabled=false", "train.micro_batch=1"]), "flux1-kontext-dev")
    assert full["params"] == pytest.approx(11.90e9, rel=0.01)
    lora = plan(load_config(RECIPE, ["train.micro_batch=1"]), "flux1-kontext-dev")
    flux = plan(load_config("configs/t2i/flux_lora.yaml", ["train.micro_batch=1"]), "flux1-dev")
    assert 0 < lora["trainable_params"] < 0.03 * lora["params"]
    assert lora["tflop_per_iter_training"] > 0 and lora["activations_per_micro_batch_gib"] > \
        flux["activations_per_micro_batch_gib"]  # same 512 px output, twice the image tokens
    print({k: v for k, v in lora.items() if "gib" in k or "params" in k})
