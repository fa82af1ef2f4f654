"""Policy contract for the flow policy: shapes, determinism under a seed, on-policy ratio = 1."""

import pytest
import torch

from mmrl.compose import load_config
from mmrl.policy import POLICIES
from mmrl.testing.contract import check_policy

EXAMPLES = [{"prompt": "a red circle"}, {"prompt": "two squares"}]


def make_policy(path, **over):
    items = [f"model.path={path}", "sampler.num_steps=5"] + [f"{k}={v}" for k, v in over.items()]
    return POLICIES["flow"](load_config(None, items))


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_contract(tiny_pixel_model, kind, cfg_scale):
    noise = {"flow_grpo": 0.7, "dance": 0.3, "cps": 0.5}[kind]
    pol = make_policy(tiny_pixel_model, **{"sampler.kind": kind, "sampler.noise_level": noise,
                                           "sampler.cfg_scale": cfg_scale})
    ro = pol.sample(EXAMPLES, 3, torch.Generator().manual_seed(0))
    n, a = 6, 4  # B * G samples; num_steps - 1 trainable steps
    assert ro.old_log_prob.shape == (n, a) and ro.action_mask.shape == (n, a)
    assert ro.outputs.shape == (n, 3, 24, 24) and ro.group_id.tolist() == [0, 0, 0, 1, 1, 1]
    assert ro.extras["latents"].shape == (n, a, 3, 24, 24)
    assert torch.isfinite(ro.old_log_prob).all()
    # determinism under a seed
    ro2 = pol.sample(EXAMPLES, 3, torch.Generator().manual_seed(0))
    assert torch.equal(ro.outputs, ro2.outputs) and torch.equal(ro.old_log_prob, ro2.old_log_prob)
    ro3 = pol.sample(EXAMPLES, 3, torch.Generator().manual_seed(1))
    assert not torch.equal(ro.outputs, ro3.outputs)
    assert check_policy(pol, EXAMPLES, 3)["max_ratio_error"] < 1e-5  # the shared contract
    # on-policy ratio = 1 with unchanged weights, for every minibatch split
    for idx in (torch.arange(n), torch.tensor([4, 1]), torch.tensor([0])):
        out = pol.log_prob(ro, idx)
        assert out.log_prob.shape == (len(idx), a)
        ratio = torch.exp(out.log_prob - ro.old_log_prob[idx])
        assert (ratio - 1).abs().max().item() < 1e-5
        assert torch.allclose(out.stats["mean"], ro.extras["old_mean"][idx], atol=1e-5)


def test_log_prob_has_grad_and_changes_with_weights(tiny_pixel_model):
    pol = make_policy(tiny_pixel_model)
    ro = pol.sample(EXAMPLES, 2, torch.Generator().manual_seed(0))
    out = pol.log_prob(ro, torch.arange(4))
    out.log_prob.sum().backward()
    grads = [p.grad for p in pol.trainable_parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert (pol.log_prob(ro, torch.arange(4)).log_prob - ro.old_log_prob).abs().max() > 1e-4


def test_sde_window_and_lora_reference(tiny_pixel_model):
    pol = make_policy(tiny_pixel_model, **{"sampler.sde_window_size": 2, "model.lora.enabled": True,
                                           "model.lora.rank": 4, "model.lora.alpha": 4,
                                           "algo.kl_coef": 0.01})
    ro = pol.sample(EXAMPLES, 2, torch.Generator().manual_seed(3))
    assert ro.old_log_prob.shape == (4, 2)
    steps = ro.extras["step_index"][0].tolist()
    assert steps[1] == steps[0] + 1 and steps[1] <= 3  # never the last step (index 4)
    trainable = list(pol.trainable_parameters())
    assert trainable and all("lora" in n for n, p in pol.transformer.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for p in trainable:
            p.add_(0.1)
    cur = pol.log_prob(ro, torch.arange(4)).log_prob
    with pol.reference():
        ref = pol.log_prob(ro, torch.arange(4)).log_prob
    assert (cur - ref).abs().max() > 1e-5
    assert torch.equal(pol.log_prob(ro, torch.arange(4)).log_prob, cur)  # adapters back on after the context


@pytest.mark.parametrize("shared", [False, True])
def test_shared_noise_starts_a_group_from_one_noise(tiny_pixel_model, shared):
    """shared_noise: the rows of a group are identical up to the first SDE step and differ after it."""
    pol = make_policy(tiny_pixel_model, **{"sampler.sde_window_size": 1, "sampler.sde_window_range": "[2,3]",
                                           "sampler.shared_noise": shared})
    ro = pol.sample(EXAMPLES, 3, torch.Generator().manual_seed(0))
    x = ro.extras["latents"][:, 0]                                  # [6, C, H, W] state entering SDE step 2
    assert ro.extras["step_index"][0].tolist() == [2]
    assert torch.equal(x[0], x[1]) == shared and torch.equal(x[3], x[5]) == shared
    assert not torch.equal(x[0], x[3])                              # groups never share
    assert not torch.equal(ro.outputs[0], ro.outputs[1])            # the SDE step makes the rows differ
    for idx in (torch.arange(6), torch.tensor([5, 0])):
        assert (pol.log_prob(ro, idx).log_prob - ro.old_log_prob[idx]).abs().max() < 1e-5


def test_prompts_are_encoded_once_per_text_and_cached(tiny_pixel_model):
    from mmrl.compose import load_config
    from mmrl.policy import POLICIES

    pol = POLICIES["flow"](load_config(None, [f"model.path={tiny_pixel_model}", "sampler.num_steps=3",
                                              "sampler.cfg_scale=1.0"]))
    calls = []
    encode = pol.model.encode_prompts
    pol.model.encode_prompts = lambda texts: (calls.append(list(texts)), encode(texts))[1]
    exs = [{"prompt": "a red circle"}, {"prompt": "two squares"}]
    ro = pol.sample(exs, 3, torch.Generator().manual_seed(0))
    assert calls == [["a red circle", "two squares"]]  # not once per group member
    pol.sample(exs, 3, torch.Generator().manual_seed(1))
    assert len(calls) == 1  # the next iteration reads the cache
    enc, pooled = encode(["two squares"])
    torch.testing.assert_close(ro.extras["enc"][3:], enc.expand(3, -1, -1))
    torch.testing.assert_close(ro.extras["pooled"][3:], pooled.expand(3, -1))


def test_a_training_pass_builds_only_what_the_objective_reads(tiny_pixel_model):
    """Objective.reads (its terms' declared reads) -> the flow policy builds only those statistics and gathers only
    the stored tensors they need; the log-probs, the statistics it builds and the gradients equal the full pass's."""
    from mmrl.algorithms.objective import build_objective
    from mmrl.data import RowView

    algo = lambda *items: load_config(None, list(items)).algo  # noqa: E731
    assert build_objective(algo("algo.kl_coef=0")).reads == frozenset()
    assert build_objective(algo("algo.ratio=guard", "algo.kl_coef=0.01", "algo.kl=flow_mean")).reads == \
        {"std", "ratio_bias", "mean"}
    assert build_objective(algo("algo.objective.name=nft", "algo.kl_coef=0")).reads == \
        {"velocity", "old_velocity", "target", "sigma"}
    pol = make_policy(tiny_pixel_model, **{"sampler.cfg_scale": 1.0})
    ro = pol.sample(EXAMPLES, 2, torch.Generator().manual_seed(0))
    idx = torch.tensor([3, 0])
    full = pol.log_prob(ro, idx)
    full.log_prob.sum().backward()
    grads = [p.grad.clone() for p in pol.trainable_parameters()]
    pol.transformer.zero_grad(set_to_none=True)
    pol.reads = frozenset()
    read = []
    stored = ro.extras
    ro.extras = type("Watched", (dict,), {"__getitem__": lambda s, k: read.append(k) or dict.__getitem__(s, k)})(stored)
    lean = pol.log_prob(ro, idx)
    assert set(lean.stats) == {"std", "schedule_std_mean"} and "old_mean" not in read   # no mean, velocity, bias
    torch.testing.assert_close(lean.log_prob, full.log_prob, rtol=0, atol=0)
    lean.log_prob.sum().backward()
    for p, g in zip(pol.trainable_parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    view = RowView(stored, idx, "cpu")
    assert torch.equal(view["latents"], stored["latents"][idx]) and list(view.cut) == ["latents"]


def test_pass_statistics_stay_on_the_device_until_read():
    """PassStats keeps each pass's sums as tensors where they were computed (no host sync per pass) and reads them in
    one transfer; a masked-out NaN does not reach the sum."""
    from mmrl.train_stats import PassStats

    s = PassStats()
    s.add("x", torch.tensor([[1.0, 2.0], [3.0, float("nan")]]), torch.tensor([[True, False], [True, False]]))
    s.put("loss", torch.tensor(0.5), 1)
    s.put("grad_norm", 2.0, 1)
    assert isinstance(s.stats["x"][0][0], torch.Tensor)
    assert s.on_host() == {"x": [(4.0, 2)], "loss": [(0.5, 1)], "grad_norm": [(2.0, 1)]}
