"""Qwen-Image-Edit and Qwen-Image-Edit-Plus (image editing) through the flow policy: tiny QwenImageEditPipeline /
QwenImageEditPlusPipeline of the real classes (a Qwen2.5-VL with its vision tower as the text encoder, a Qwen2-VL
processor, the Qwen-Image transformer, -Plus's with -2511's zero_cond_t) saved with save_pretrained and loaded by
model.path. The VLM sees the images; their VAE latents ride in `pooled` and are appended to the generated tokens in
the call. mmrl's sampler reproduces each pipeline's own edit (with and without its true CFG, whose negative prompt
sees the same images); the policy passes the contract with LoRA on examples carrying images; the adapter it saves
loads with the pipeline's load_lora_weights; `mmrl plan` at real size."""

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from mmrl.compose import load_config
from mmrl.models.families import qwen_image_edit
from mmrl.models.families.common import pack2x2, unpack2x2
from mmrl.models.pipelines import load_flow_model
from mmrl.models.tiny_pipelines import build_tiny
from mmrl.policy import POLICIES
from mmrl.testing.contract import check_policy
from mmrl.testing.family import check_lora_in_diffusers

RECIPE = "configs/t2i/qwen_image_edit_lora.yaml"
SIDE = 128  # output px: 4 x 4 latents of the tiny x32 VAE; condition images are VAE-encoded at 1024 px (32 x 32)
# family -> (pipeline class, images per example in the tests)
EDITS = {"qwen_image_edit": ("QwenImageEditPipeline", 1), "qwen_image_edit_plus": ("QwenImageEditPlusPipeline", 2)}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[str]:
    """Three 1024 x 1024 PNGs (square: the pipelines keep the aspect ratio, mmrl makes every image square)."""
    root, paths = tmp_path_factory.mktemp("images"), []
    for i in range(3):
        cells = np.random.default_rng(i).integers(0, 256, (8, 8, 3), dtype=np.uint8)
        Image.fromarray(cells).resize((1024, 1024), Image.NEAREST).save(root / f"source{i}.png")
        paths.append(str(root / f"source{i}.png"))
    return paths


@pytest.fixture(scope="module", params=list(EDITS))
def edit(request, tmp_path_factory):
    """(family name, pipeline folder, its FlowModel at 4 x 4 latents)."""
    path = str(tmp_path_factory.mktemp("pipelines") / request.param)
    build_tiny(request.param).save_pretrained(path)
    return request.param, path, load_flow_model(path, sample_size=4)


def rgb(path):
    with Image.open(path) as im:
        return im.convert("RGB")


def policy(path, *items):
    return POLICIES["flow"](load_config(None, [f"model.path={path}", "model.sample_size=4", "sampler.num_steps=4",
                                               "sampler.cfg_scale=1.0", "model.lora.enabled=true",
                                               "model.lora.rank=4", *items]))


def test_call_appends_each_rows_images_and_keeps_the_generated_tokens():
    """pooled = [mask | count | z of up to max_images]: the transformer sees [x's 2x2 tokens | image 1's | ...] with
    img_shapes listing them all, rows grouped by image count (RoPE takes one layout per call) and put back in order;
    the call returns the first HW/4 output tokens unpacked."""
    calls = []

    def spy(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_mask, img_shapes, return_dict):
        calls.append(dict(tokens=hidden_states, sigma=timestep, mask=encoder_hidden_states_mask, shapes=img_shapes))
        return (hidden_states * 2,)

    x, z = torch.randn(3, 16, 4, 2), torch.randn(3, 2, 16, 6, 6)                  # 2 generated, 9 tokens / image
    mask, count = torch.ones(3, 5), torch.tensor([[2.0], [1.0], [2.0]])
    z[1, 1] = 0                                                                  # row 1 has one image
    pooled = torch.cat([mask, count, z.flatten(1)], 1)
    sigma = torch.tensor([0.1, 0.2, 0.3])
    out = qwen_image_edit.edit_call(5, 2, 6)(spy, x, sigma, torch.randn(3, 7, 8), pooled)
    torch.testing.assert_close(out, 2 * x)                                       # the images' outputs are dropped
    one, two = calls                                                             # counts in increasing order
    assert one["tokens"].shape == (1, 2 + 9, 64) and two["tokens"].shape == (2, 2 + 18, 64)
    assert one["shapes"] == [[(1, 2, 1), (1, 3, 3)]] and two["shapes"] == [[(1, 2, 1), (1, 3, 3), (1, 3, 3)]] * 2
    torch.testing.assert_close(two["tokens"][:, 2:], torch.cat([pack2x2(z[[0, 2], 0]), pack2x2(z[[0, 2], 1])], 1))
    torch.testing.assert_close(two["sigma"], sigma[[0, 2]])
    calls.clear()  # plan: every row with a fixed count, no grouping by values
    qwen_image_edit.edit_call(5, 2, 6, images=2)(spy, x, sigma, torch.randn(3, 7, 8), pooled)
    assert len(calls) == 1 and calls[0]["tokens"].shape == (3, 20, 64)


def test_sampler_reproduces_the_pipeline(edit, images):
    """Same seed, 4 steps, 128 px output from 1024 px sources: FlowModel.generate gives the pipeline's edit (images
    and final latents), without CFG and with its true CFG at 4 (negative_prompt="" encoded with the same images).
    Another source image, or another prompt, moves the latents far more than that difference."""
    import diffusers

    name, path, model = edit
    cls, k = EDITS[name]
    pils = [rgb(p) for p in images[:k]]
    encoded = (*model.encode_prompts(["make the squares red"], [pils]), model.encode_prompts([""], [pils]))
    latents = dataclasses.replace(model, decode=lambda z: z)                   # generate -> the final latents
    pipe = getattr(diffusers, cls).from_pretrained(path)
    diffs = {}
    for cfg in (1.0, 4.0):
        def theirs(output_type):
            return pipe(image=pils if k > 1 else pils[0], prompt="make the squares red", true_cfg_scale=cfg,
                        negative_prompt="" if cfg > 1 else None, height=SIDE, width=SIDE, num_inference_steps=4,
                        output_type=output_type, generator=torch.Generator().manual_seed(0)).images

        ours = (model.generate(["make the squares red"], [0], 4, cfg, 1.0, encoded=encoded) + 1) / 2
        z = latents.generate(["make the squares red"], [0], 4, cfg, 1.0, encoded=encoded)  # [1, 16, 4, 4]
        assert ours.shape == (1, 3, SIDE, SIDE)
        diffs[cfg] = (float((ours - theirs("pt")).abs().max()),
                      float((z - unpack2x2(theirs("latent"), z.shape)).abs().max()))
    print(name, "max |mmrl - pipeline| (images, latents) at CFG 1, 4:", diffs)
    assert max(max(d) for d in diffs.values()) <= 1e-5
    other = latents.generate(["make the squares red"], [0], 4, 4.0, 1.0, images=[[rgb(images[2])] + pils[1:]])
    prompt = latents.generate(["add a dog"], [0], 4, 4.0, 1.0, images=[pils])
    assert min((other - z).abs().max(), (prompt - z).abs().max()) > 100 * diffs[4.0][1]


def test_encode_sees_the_images_and_carries_their_latents(edit, images):
    """enc: the VLM's states of the template with the images' vision tokens (so they depend on the image), padded
    to one length; pooled = [mask | count | z], z the pipeline's own _encode_vae_image of its preprocessed image."""
    import diffusers

    name, path, model = edit
    cls, k = EDITS[name]
    pipe = getattr(diffusers, cls).from_pretrained(path)
    slots = 1 if k == 1 else 3
    enc, pooled = model.encode_prompts(["add a dog", "add a dog"], [[rgb(images[0])], [rgb(images[1])]])
    length = enc.shape[1]
    assert enc.shape == (2, length, 32) and pooled.shape == (2, length + 1 + slots * 16 * 32 * 32)
    assert 0 < pooled[0, :length].sum() < length and pooled[:, length].tolist() == [1.0, 1.0]
    assert (enc[0] - enc[1]).abs().max() > 1e-3  # same prompt, another image: the VLM saw it
    with torch.no_grad():
        pixels = pipe.image_processor.preprocess(rgb(images[1]), 1024, 1024).unsqueeze(2)
        z = pipe._encode_vae_image(pixels, None)                                       # [1, 16, 1, 32, 32]
    torch.testing.assert_close(pooled[1, length + 1:length + 1 + 16 * 32 * 32], z.flatten())
    assert pooled[:, length + 1 + 16 * 32 * 32:].abs().sum() == 0                      # unused slots
    # the length: the empty prompt's tokens with the most images the family takes (counted by the processor alone),
    # then text_max_length (128) for the prompt
    _, full = model.encode_prompts([""], [[rgb(images[0])] * slots])
    assert full[0, :length].sum() == length - 128 and full[0, length] == slots
    with pytest.raises(ValueError, match="image"):
        model.encode_prompts(["a cat"])
    with pytest.raises(ValueError, match=f"1 to {slots}"):
        model.encode_prompts(["a cat"], [[rgb(images[0])] * (slots + 1)])


@pytest.mark.parametrize("edit", ["qwen_image_edit_plus"], indirect=True)
def test_plus_rows_with_different_image_counts(edit, images):
    """Edit-Plus: a batch mixing rows of 2 and 1 images gives each row the velocity it has alone."""
    name, path, model = edit
    enc, pooled = model.encode_prompts(["put 2 on 1", "add a dog"], [[rgb(images[0]), rgb(images[1])],
                                                                    [rgb(images[2])]])
    x, sigma = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0.7, 0.3])
    with torch.no_grad():
        both = model.velocity(x, sigma, enc, pooled)
        alone = torch.cat([model.velocity(x[i:i + 1], sigma[i:i + 1], enc[i:i + 1], pooled[i:i + 1]) for i in (0, 1)])
    torch.testing.assert_close(both, alone, atol=1e-5, rtol=1e-5)


def test_policy_contract_with_lora(edit, images):
    """True CFG at 2 (the negative branch on the rows' images) in sampling and training."""
    name, path, _ = edit
    k = EDITS[name][1]
    examples = [{"prompt": "make the squares red", "images": images[:k]}, {"prompt": "add a dog", "image": images[2]}]
    if k == 1:
        examples[0] = {"prompt": "make the squares red", "image": images[0]}
    pol = policy(path, "sampler.cfg_scale=2.0", "sampler.eval_cfg_scale=2.0")
    lora = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in pol.transformer.named_parameters() if "lora_A" in n}
    assert lora >= {"to_q", "add_q_proj", "to_add_out", "proj"}
    assert check_policy(pol, examples, 2)["max_ratio_error"] < 1e-5
    ro = pol.sample(examples, 2, torch.Generator().manual_seed(0))
    assert ro.outputs.shape == (4, 3, SIDE, SIDE) and ro.outputs.abs().max() <= 1
    assert (ro.outputs[0] - ro.outputs[2]).abs().max() > 1e-3  # rows edit their own images
    with pytest.raises(ValueError, match="no `image`"):
        pol.sample([{"prompt": "no image"}], 2, torch.Generator().manual_seed(0))


def test_lora_loads_in_diffusers(edit, images, tmp_path):
    import diffusers

    name, path, base = edit
    x, sigma = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0.7, 0.3])
    enc, pooled = base.encode_prompts(["a cat", "a red car"], [[rgb(images[0])], [rgb(images[1])]])
    check_lora_in_diffusers(policy(path), getattr(diffusers, EDITS[name][0]).from_pretrained(path), base, x, sigma,
                            enc, pooled, str(tmp_path / "policy"))


@pytest.mark.slow  # ~35 s: 20 B parameters on the meta device; the tiny model's plan is tested above
def test_plan_at_real_size_and_the_recipe():
    """Qwen-Image-Edit(-Plus) is Qwen-Image's transformer (the card's 20 B; its diffusers config instantiates
    20.43 B); each 1024 px condition image adds 4096 tokens to the 512 px output's 1024 (-Plus plans 3 images)."""
    from mmrl.plan import plan

    cfg = load_config(RECIPE)
    assert cfg.model.sample_size == 64 and cfg.sampler.num_steps == 10 and cfg.sampler.cfg_scale == 4.0
    assert cfg.model.path.startswith("/models/") and cfg.train.parallel == "fsdp"
    full = plan(load_config(RECIPE, ["model.lora.enabled=false", "train.micro_batch=1"]), "qwen-image-edit")
    assert full["params"] == pytest.approx(20.43e9, rel=0.01)
    edit, plus = (plan(load_config(RECIPE, ["train.micro_batch=1"]), arch, world=8)
                  for arch in ("qwen-image-edit", "qwen-image-edit-2511"))
    for p in (edit, plus):
        assert 0 < p["trainable_params"] < 0.03 * p["params"] and p["tflop_per_iter_training"] > 0
        assert p["params"] - p["trainable_params"] == full["params"]
        print(p["model"], {k: round(v, 2) for k, v in p.items() if k.endswith("gib") or k.endswith("tflop_per_row")})
    assert plus["forward_tflop_per_row"] > 2 * edit["forward_tflop_per_row"]
