"""The gradient through classifier-free guidance (sampler.cfg_grad): the guided velocity v = v_u + w (v_c - v_u) is the
same either way; with cfg_grad=cond (Flow-GRPO's train_sd3.py detaches the unconditional prediction) its gradient is
w dv_c, with full it is (1 - w) dv_u + w dv_c, each against the branches' gradients computed separately."""

import pytest
import torch


@pytest.mark.parametrize("mode", ["cond", "full"])
def test_cfg_gradient_by_hand(tiny_pixel_model, mode):
    from mmrl.models.pipelines import load_flow_model

    model = load_flow_model(tiny_pixel_model)
    params = [p for p in model.transformer.parameters()]
    for p in params:
        p.requires_grad_(True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, *model.latent_shape, generator=g)
    probe = torch.randn(2, *model.latent_shape, generator=g)  # a random direction: loss = <v, probe>
    sigma, w = torch.tensor([0.8, 0.4]), 3.5
    enc, pooled = model.encode_prompts(["a red circle", "two blue squares"])
    neg = model.negative(2)

    def grads(fn):
        for p in params:
            p.grad = None
        (fn() * probe).sum().backward()
        return [p.grad.clone() for p in params]

    model.cfg_grad = mode
    guided = grads(lambda: model.velocity(x, sigma, enc, pooled, w, neg))
    cond = grads(lambda: model._forward(x, sigma, enc, pooled))
    uncond = grads(lambda: model._forward(x, sigma, *neg))
    hand = [w * c + (0.0 if mode == "cond" else (1 - w)) * u for c, u in zip(cond, uncond)]
    scale = max(h.abs().max().item() for h in hand)
    assert scale > 0 and max((a - b).abs().max().item() for a, b in zip(guided, hand)) < 1e-5 * scale
    with torch.no_grad():  # the value does not depend on the mode
        model.cfg_grad = "full"
        full = model.velocity(x, sigma, enc, pooled, w, neg)
        model.cfg_grad = "cond"
        torch.testing.assert_close(model.velocity(x, sigma, enc, pooled, w, neg), full)


def test_cond_gradient_keeps_no_activations_of_the_unconditional_branch(tiny_pixel_model):
    """cfg_grad=cond: the unconditional branch runs without autograd, so a training forward saves for backward what
    the conditional rows alone save (half of cfg_grad=full's batched forward), for the same gradient (above)."""
    from mmrl.models.pipelines import load_flow_model

    model = load_flow_model(tiny_pixel_model)
    params = list(model.transformer.parameters())
    for p in params:
        p.requires_grad_(True)
    weights = {p.untyped_storage().data_ptr() for p in params}
    g = torch.Generator().manual_seed(0)
    x, sigma = torch.randn(2, *model.latent_shape, generator=g), torch.tensor([0.8, 0.4])
    enc, pooled = model.encode_prompts(["a red circle", "two blue squares"])
    neg = model.negative(2)

    def saved(fn) -> int:
        n = [0]

        def pack(t):
            n[0] += 0 if t.untyped_storage().data_ptr() in weights else t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return n[0]

    by_mode = {}
    for mode in ("cond", "full"):
        model.cfg_grad = mode
        by_mode[mode] = saved(lambda: model.velocity(x, sigma, enc, pooled, 3.5, neg))
    alone = saved(lambda: model._forward(x, sigma, enc, pooled))
    assert by_mode["cond"] <= 1.05 * alone and by_mode["full"] >= 1.9 * alone


def test_text_max_length_sets_the_t5_prompt_length(tmp_path):
    """model.text_max_length: SD3's T5 tokens 256 by default (77 CLIP + 256), 128 as Flow-GRPO's recipes; a
    checkpoint keeps the setting (its model options)."""
    from mmrl.compose import build_policy, load_config
    from mmrl.models.tiny_pipelines import build_tiny
    from mmrl.policy.flow import load_policy_checkpoint

    build_tiny("sd3").save_pretrained(str(tmp_path / "sd3"))
    lengths = {}
    for n in (None, 128):
        pol = build_policy(load_config(None, [f"model.path={tmp_path / 'sd3'}", f"model.text_max_length={n or 'null'}",
                                              "model.lora.enabled=true", "model.lora.rank=2"]))
        lengths[n] = pol.model.encode_prompts(["a red circle"])[0].shape[1]
    assert lengths == {None: 77 + 256, 128: 77 + 128}
    pol.save_pretrained(str(tmp_path / "policy"))
    assert load_policy_checkpoint(str(tmp_path / "policy")).encode_prompts(["a red circle"])[0].shape[1] == 77 + 128
