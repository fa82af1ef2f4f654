"""FLUX.1 and Wan2.x through the flow policy: tiny pipelines of the real classes saved with save_pretrained and
loaded by model.path (the same from_pretrained code as real checkpoints); the policy contract, LoRA on the
architecture's attention, checkpoints that reload with their options, trees on video latents."""

import pytest
import torch

from mmrl.compose import load_config
from mmrl.metrics import video_strips
from mmrl.models.families.flux import flux_call
from mmrl.models.flow_model import compute_dtype
from mmrl.models.tiny_pipelines import build_tiny
from mmrl.policy import POLICIES
from mmrl.policy.flow import load_policy_checkpoint
from mmrl.testing.contract import check_policy

PROMPTS = [{"prompt": "a red circle moving left"}, {"prompt": "a cat"}]


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipelines")
    build_tiny("flux").save_pretrained(str(root / "flux"))
    build_tiny("wan").save_pretrained(str(root / "wan"))
    return {"flux": str(root / "flux"), "wan": str(root / "wan")}


def policy(path, *items):
    return POLICIES["flow"](load_config(None, [f"model.path={path}", "sampler.num_steps=4", "sampler.shift=3.0",
                                               "sampler.cfg_scale=1.0", *items]))


def contract(pol, latent, output):
    assert check_policy(pol, PROMPTS, 2)["max_ratio_error"] < 1e-5  # the shared contract
    ro = pol.sample(PROMPTS, 2, torch.Generator().manual_seed(0))
    assert ro.extras["latents"].shape == (4, 3, *latent) and ro.outputs.shape == (4, *output)
    assert torch.isfinite(ro.outputs).all() and ro.outputs.abs().max() <= 1
    assert torch.equal(pol.sample(PROMPTS, 2, torch.Generator().manual_seed(0)).outputs, ro.outputs)
    out = pol.log_prob(ro, torch.arange(4))
    assert (out.log_prob - ro.old_log_prob).abs().max() < 1e-5
    out.log_prob.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in pol.trainable_parameters())
    return ro


def test_flux_packing_is_a_permutation():
    """The 2x2 packing around the FLUX call is undone exactly: a transformer returning its input gives v = x."""
    class Echo(torch.nn.Module):
        config = type("C", (), {"guidance_embeds": False})

        def forward(self, hidden_states, **kw):
            assert hidden_states.shape == (2, 16, 64) and kw["img_ids"].shape == (16, 3)
            return (hidden_states,)

    x = torch.randn(2, 16, 8, 8)
    assert torch.equal(flux_call(3.5)(Echo(), x, torch.rand(2), torch.randn(2, 5, 32), torch.randn(2, 32)), x)


def test_flux_policy_contract_lora_and_checkpoint(pipelines, tmp_path):
    pol = policy(pipelines["flux"], "model.sample_size=8", "model.lora.enabled=true", "model.lora.rank=4")
    assert pol.model.latent_shape == (16, 8, 8)
    lora = [n for n, _ in pol.transformer.named_parameters() if "lora_A" in n]
    assert any("single_transformer_blocks" in n for n in lora) and any("add_q_proj" in n for n in lora)
    contract(pol, (16, 8, 8), (3, 16, 16))
    # the guidance embedding reaches the transformer
    x, s = pol.model.initial_noise([0]), torch.tensor([0.6])
    enc, pooled = pol.model.encode_prompts(["a cat"])
    with torch.no_grad():
        v1 = pol.model.velocity(x, s, enc, pooled)
        pol.model.call = flux_call(7.0)
        v2 = pol.model.velocity(x, s, enc, pooled)
    assert not torch.allclose(v1, v2)
    with torch.no_grad():
        for p in pol.trainable_parameters():
            p.add_(0.01)
    pol.save_pretrained(str(tmp_path / "policy"))
    model = load_policy_checkpoint(str(tmp_path / "policy"))
    assert model.latent_shape == (16, 8, 8)  # the sample_size the policy trained with
    pol.model.call = flux_call(3.5)
    with torch.no_grad():
        assert torch.allclose(model.velocity(x, s, enc, pooled), pol.model.velocity(x, s, enc, pooled), atol=1e-5)
    parent = load_policy_checkpoint(str(tmp_path))  # a trainer checkpoint folder (iter-N) holds policy/
    with torch.no_grad():
        assert torch.equal(parent.velocity(x, s, enc, pooled), model.velocity(x, s, enc, pooled))


def test_wan_video_policy_contract_and_trees(pipelines):
    pol = policy(pipelines["wan"], "model.sample_size=4", "model.num_frames=9", "model.lora.enabled=true",
                 "model.lora.rank=4", "sampler.cfg_scale=3.0")
    lora = [n for n, _ in pol.transformer.named_parameters() if "lora_A" in n]
    assert any("attn1.to_q" in n for n in lora) and any("attn2.to_k" in n for n in lora)
    contract(pol, (16, 3, 4, 4), (3, 9, 32, 32))  # 9 frames of 32 x 32 from 3 latent frames of 4 x 4
    # BranchGRPO trees on video latents: the same policy, a config choice
    tree = policy(pipelines["wan"], "model.sample_size=4", "model.num_frames=9", "tree.split_steps=[0]",
                  "train.group_size=2", "algo.loss_agg=token_mean")
    ro = tree.sample(PROMPTS, 2, torch.Generator().manual_seed(0))
    assert ro.outputs.shape == (4, 3, 9, 32, 32) and ro.extras["tree_node"].shape == (4, 3)


def test_video_strips():
    v = torch.arange(2 * 3 * 12 * 2 * 2, dtype=torch.float).view(2, 3, 12, 2, 2)
    s = video_strips(v, max_frames=4)
    assert s.shape == (2, 3, 2, 8)
    assert torch.equal(s[:, :, :, 2:4], v[:, :, 4]) and torch.equal(s[:, :, :, 6:8], v[:, :, 11])  # frames 0, 4, 7, 11


def test_flux_dynamic_shift_by_hand(pipelines):
    """FLUX's schedule at 16 packed tokens (8x8 latents): mu = 0.5 + (16 - 256) * 0.65 / 3840 = 0.459375, and
    sigma' = e^mu / (e^mu + 1 / sigma - 1) over sigma = 1, 3/4, 1/2, 1/4, then 0 (as FluxPipeline sets them)."""
    import math

    pol = policy(pipelines["flux"], "model.sample_size=8")
    mu = 0.5 + (16 - 256) * (1.15 - 0.5) / (4096 - 256)
    assert pol.model.schedule.mu == pytest.approx(mu)
    want = [math.exp(mu) / (math.exp(mu) + 1 / s - 1) for s in (1.0, 0.75, 0.5, 0.25)] + [0.0]
    # e^mu = 1.5830: 0.75 -> 1.5830 / (1.5830 + 1/3) = 0.8261, 0.5 -> 0.6129, 0.25 -> 0.3454
    assert [round(w, 4) for w in want] == [1.0, 0.8261, 0.6129, 0.3454, 0.0]
    torch.testing.assert_close(pol.sigmas, torch.tensor(want), atol=1e-6, rtol=0)
    assert not hasattr(policy(pipelines["wan"]).model.schedule, "mu")  # static shift elsewhere


def test_wan22_two_experts_switch_at_the_boundary_and_both_train(tmp_path):
    """Wan2.2 A14B layout: steps at sigma >= boundary_ratio run `transformer`, the others `transformer_2`; both
    experts get LoRA adapters and gradients from their own steps; the checkpoint reloads with both, and the
    adapters load into the diffusers pipeline (transformer_2 with load_into_transformer_2=True)."""
    from diffusers import WanPipeline

    path = str(tmp_path / "wan22")
    build_tiny("wan", two_experts=True).save_pretrained(path)
    pol = policy(path, "model.sample_size=4", "model.num_frames=5", "model.lora.enabled=true", "model.lora.rank=4")
    assert [n for n, _ in pol.experts()] == ["transformer", "transformer_2"] and pol.model.boundary == 0.875
    assert pol.sigmas[0] >= 0.875 > pol.sigmas[1]  # shift 3, 4 steps: step 0 is high-noise, steps 1-2 low-noise
    contract(pol, (16, 2, 4, 4), (3, 5, 32, 32))
    for _, tr in pol.experts():
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in tr.named_parameters() if "lora" in n)
    x = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    enc, pooled = pol.model.encode_prompts(["a cat", "a dog"])
    sigma = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        for _, tr in pol.experts():
            for p in (p for n, p in tr.named_parameters() if "lora_B" in n):
                p.add_(torch.randn_like(p) * 0.05)
        both = pol.model.velocity(x, sigma, enc, pooled)
        hi = pol.model._expert(pol.model.transformer, x[:1], sigma[:1], enc[:1], pooled[:1])
        lo = pol.model._expert(pol.model.transformer_2, x[1:], sigma[1:], enc[1:], pooled[1:])
    torch.testing.assert_close(both, torch.cat([hi, lo]))
    from mmrl.plan import plan

    planned = plan(load_config(None, [f"model.path={path}", "model.sample_size=4", "model.num_frames=5"]))
    assert planned["experts"] == 2
    lora = sum(p.numel() for p in pol.trainable_parameters())
    assert planned["params"] == sum(p.numel() for _, tr in pol.experts() for p in tr.parameters()) - lora
    pol.save_pretrained(str(tmp_path / "policy"))
    reloaded = load_policy_checkpoint(str(tmp_path / "policy"))
    pipe = WanPipeline.from_pretrained(path)
    pipe.load_lora_weights(str(tmp_path / "policy"))
    pipe.load_lora_weights(str(tmp_path / "policy" / "transformer_2"), load_into_transformer_2=True)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.velocity(x, sigma, enc, pooled), both, atol=1e-5, rtol=1e-5)
        reloaded.transformer, reloaded.transformer_2 = pipe.transformer, pipe.transformer_2
        torch.testing.assert_close(reloaded.velocity(x, sigma, enc, pooled), both, atol=1e-5, rtol=1e-5)


def test_wan22_experts_in_lockstep_run_both_on_every_call(tmp_path):
    """Several processes: each expert is a DDP / FSDP module whose calls are collectives, so with `lockstep` both
    experts run on every call (in one order), an expert without rows on one row that enters the result times 0:
    the velocity is unchanged, and the idle expert's parameters get zero (not missing) gradients."""
    path = str(tmp_path / "wan22")
    build_tiny("wan", two_experts=True).save_pretrained(path)
    pol = policy(path, "model.sample_size=4", "model.num_frames=5", "model.lora.enabled=true", "model.lora.rank=4")
    calls = []
    for name, tr in pol.experts():
        tr.register_forward_pre_hook(lambda *_, name=name: calls.append(name))
    x = torch.randn(2, 16, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    enc, pooled = pol.model.encode_prompts(["a cat", "a dog"])
    sigma = torch.tensor([0.9, 0.95])                               # both rows on the high-noise expert
    alone = pol.model.velocity(x, sigma, enc, pooled)
    assert calls == ["transformer"]
    pol.model.lockstep, calls[:] = (lambda need: [True, True]), []  # another rank needs the other expert
    together = pol.model.velocity(x, sigma, enc, pooled)
    assert calls == ["transformer", "transformer_2"]
    torch.testing.assert_close(together, alone)
    together.square().mean().backward()
    idle = [p.grad for n, p in pol.model.transformer_2.named_parameters() if p.requires_grad]
    assert idle and all(g is not None and g.abs().max() == 0 for g in idle)


class OtherRank:
    """A process group of two ranks: the experts the other rank's rows need (`other`), and the decisions asked."""
    syncs, other = True, (False, False)

    def __init__(self):
        self.asked = 0

    def any_rank(self, flags):
        self.asked += 1
        return [a or b for a, b in zip(flags, self.other)]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "hsdp"])
def test_wan22_lockstep_only_where_ranks_differ(tmp_path, parallel):
    """Rows per expert call, counted. Sampling (every rank's rows at the step's sigma) runs one expert per call: the
    CFG batch of 2 rows, no idle row. Training scores rows at sigmas of both experts; an expert this rank does not
    need runs one idle row only where its call is a collective: under FSDP2 when some rank needs it (decided per
    call, also for calls without gradients), under DDP and HSDP in the backward that synchronizes, HSDP as FSDP2
    in the others."""
    path = str(tmp_path / "wan22")
    build_tiny("wan", two_experts=True).save_pretrained(path)
    pol = policy(path, "model.sample_size=4", "model.num_frames=5", "model.lora.enabled=true", "model.lora.rank=4",
                 "sampler.cfg_scale=4.0", "sampler.cfg_grad=cond")
    pol.dist = OtherRank()
    pol.parallelize(lambda m: m, parallel)                           # the calls as several processes make them
    calls = []
    for name, tr in pol.experts():
        tr.register_forward_pre_hook(lambda m, a, kw, name=name: calls.append((name, len(kw["hidden_states"]))),
                                     with_kwargs=True)
    ro = pol.sample(PROMPTS[:1], 1, torch.Generator().manual_seed(0))  # the other rank at the same sigmas
    high = sum(float(s) >= pol.model.boundary for s in pol.sigmas[:-1])
    assert calls == [("transformer", 2)] * high + [("transformer_2", 2)] * (4 - high)  # 4 steps, [uncond | cond]
    assert pol.dist.asked == (0 if parallel == "ddp" else 4)         # FSDP2 / HSDP: one decision per call
    first = ro.extras["sigma"][0] >= pol.model.boundary              # [A] the trained steps' expert
    assert first.any() and (~first).any()                           # the window spans both experts
    calls[:] = []
    pol.log_prob(ro, torch.tensor([0]))                              # all actions: rows of both experts
    assert calls == [("transformer", int(first.sum())), ("transformer_2", int((~first).sum()))] * 2  # uncond, cond
    mine, idle = ("transformer", int(first.sum())), ("transformer_2", 1)
    pol.dist.other = (False, True)                                   # the other rank's rows: the low-noise expert
    for syncs in (False, True):                                      # no_sync passes, then a step's last
        pol.dist.syncs, calls[:] = syncs, []
        pol.log_prob(ro, torch.tensor([0]), actions=first[None])      # this rank: one expert's actions only
        other_rank = [mine, idle] * 2                                # (uncond, cond) as the other rank needs
        assert calls == {"fsdp": other_rank, "hsdp": other_rank, "ddp": [mine, mine, idle] if syncs else [mine] * 2
                         }[parallel]
    calls[:] = []
    with torch.no_grad():                                            # a frozen forward (KL reference, EMA): one
        pol.log_prob(ro, torch.tensor([0]), actions=first[None])     # batched [uncond | cond] call
    batched = ("transformer", 2 * int(first.sum()))
    assert calls == ([batched] if parallel == "ddp" else [batched, idle])
    pol.dist.other, pol.dist.syncs, calls[:] = (False, False), False, []  # every rank on the same expert: no idle row
    pol.log_prob(ro, torch.tensor([0]), actions=first[None])
    assert calls == [mine] * 2


def test_wan22_forward_process_noise_levels_decide_together(tmp_path):
    """A forward-process objective's rollout scores each row at its own noise levels (rows of both experts on each
    rank): under FSDP2 those calls too run the experts some rank needs, decided once per call."""
    path = str(tmp_path / "wan22")
    build_tiny("wan", two_experts=True).save_pretrained(path)
    pol = policy(path, "model.sample_size=4", "model.num_frames=5", "model.lora.enabled=true", "model.lora.rank=4",
                 "algo.objective.name=nft", "sampler.forward_timesteps=2", "sampler.forward_t_range=[0.95,1.0]")
    pol.dist = OtherRank()
    pol.dist.other = (False, True)                                   # the other rank holds low-noise levels
    pol.parallelize(lambda m: m, "fsdp")
    calls = []
    for name, tr in pol.experts():
        tr.register_forward_pre_hook(lambda m, a, kw, name=name: calls.append(name), with_kwargs=True)
    pol.sample(PROMPTS[:1], 1, torch.Generator().manual_seed(0))
    asked = pol.dist.asked
    assert calls[-2:] == ["transformer", "transformer_2"] and asked == 5  # 4 sampling steps, then the noise levels


@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_wan_sampler_reproduces_the_pipeline(pipelines, cfg_scale):
    """Wan T2V: FlowModel.generate (UMT5 at the pipeline's 512 tokens, shift 3, CFG with the empty negative prompt)
    gives WanPipeline's video, 4 steps, same seed."""
    from diffusers import WanPipeline

    from mmrl.models.pipelines import load_flow_model

    model = load_flow_model(pipelines["wan"], sample_size=4, num_frames=5)
    ours = (model.generate(["a red circle moving left"], [0], 4, cfg_scale, 3.0) + 1) / 2      # [1, 3, 5, 32, 32]
    theirs = WanPipeline.from_pretrained(pipelines["wan"])(
        "a red circle moving left", negative_prompt="", height=32, width=32, num_frames=5, num_inference_steps=4,
        guidance_scale=cfg_scale, output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    torch.testing.assert_close(ours, theirs.permute(0, 2, 1, 3, 4), atol=1e-5, rtol=0)


def test_flux_sampler_reproduces_the_pipeline(pipelines):
    """FLUX.1-dev: FlowModel.generate (packed 2x2 tokens, the guidance embedding at 3.5, the resolution-dependent
    shift) gives FluxPipeline's image, 4 steps, same seed."""
    from diffusers import FluxPipeline

    from mmrl.models.pipelines import load_flow_model

    model = load_flow_model(pipelines["flux"], sample_size=8, guidance=3.5)
    ours = (model.generate(["a red circle"], [0], 4, 1.0) + 1) / 2                              # [1, 3, 16, 16]
    theirs = FluxPipeline.from_pretrained(pipelines["flux"])(
        "a red circle", height=16, width=16, num_inference_steps=4, guidance_scale=3.5, max_sequence_length=32,
        output_type="pt", generator=torch.Generator().manual_seed(0)).images
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


def test_wan_bf16_evaluates_in_one_process(pipelines):
    """Issue 43: diffusers keeps Wan's scale_shift_table, norms and time embedder in fp32 (_keep_in_fp32_modules), so
    the transformer's first parameter is fp32 while its patch embedding is bf16; evaluation runs without autocast
    and casting the inputs to the first parameter's dtype crashed ("Input type (float) and bias type
    (c10::BFloat16) should be the same"). The inputs take the compute dtype, diffusers' ModelMixin.dtype rule.
    (Full fine-tuning keeps fp32 master weights: model.dtype=bfloat16 is refused there, nothing to cast.)"""
    pol = policy(pipelines["wan"], "model.sample_size=4", "model.num_frames=5", "model.dtype=bfloat16",
                 "model.lora.enabled=true", "model.lora.rank=4", "sampler.eval_steps=2", "sampler.eval_cfg_scale=2.0")
    tr = pol.transformer
    assert next(tr.parameters()).dtype == torch.float32 and tr.patch_embedding.weight.dtype == torch.bfloat16
    assert compute_dtype(tr) == torch.bfloat16
    videos = pol.evaluate(PROMPTS, seed=7)                                               # [2, 3, F, H, W]
    assert videos.shape == (2, 3, 5, 32, 32) and torch.isfinite(videos).all() and videos.abs().max() <= 1
    assert torch.equal(pol.evaluate(PROMPTS, seed=7), videos)


@pytest.mark.parametrize("recipe", ["wan22_a14b_lora", "wan22_i2v_a14b_lora"])
def test_wan22_recipes_window_each_expert(recipe, tmp_path):
    """The shipped Wan2.2 recipes' steps and shift on the two-expert layout: both experts own trainable steps, and
    the recipe's SDE steps (every step but the last) cover both; with a 3-step window (the motion world's, which the
    previous recipe inherited: drawn from steps 0-3 it never reached the low-noise expert) every iteration's window
    holds steps of both experts, so `transformer_2` (below boundary_ratio) trains too; one training step moves both
    experts' LoRA weights. A schedule that gives an expert no trainable step is refused by name."""
    from mmrl.policy.flow import FlowPolicy
    from mmrl.testing.tiny_rewards import output_spread

    s = load_config(f"configs/t2v/{recipe}.yaml", ["sampler.sde_window_size=3", "sampler.sde_window_range=[0,4]"]).sampler
    shipped = load_config(f"configs/t2v/{recipe}.yaml").sampler.sde_window_size
    path = str(tmp_path / "wan22")
    build_tiny("wan", two_experts=True).save_pretrained(path)
    pol = policy(path, "model.sample_size=4", "model.num_frames=5", "model.lora.enabled=true", "model.lora.rank=4",
                 f"sampler.num_steps={s.num_steps}", f"sampler.shift={s.shift}",
                 f"sampler.sde_window_size={s.sde_window_size}",
                 f"sampler.sde_window_range=[{s.sde_window_range[0]},{s.sde_window_range[1]}]", "sampler.cfg_scale=1")
    high, low = pol.expert_steps()
    assert high and low and max(high) < min(low) and len(high) + len(low) == s.num_steps - 1
    assert shipped == 0  # the recipes' SDE runs on every trainable step: both experts' steps
    for seed in range(20):
        window = pol._window(torch.Generator().manual_seed(seed))
        assert len(window) == 2 * s.sde_window_size
        assert any(i in high for i in window) and any(i in low for i in window)
    pol.iteration = 0
    ro = pol.sample([{"prompt": "a cat walks"}, {"prompt": "a dog runs"}], 2, torch.Generator().manual_seed(0))
    before = {n: [p.detach().clone() for p in tr.parameters() if p.requires_grad] for n, tr in pol.experts()}
    adv = output_spread(ro.outputs)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    out = pol.log_prob(ro, torch.arange(4))
    (-(adv[:, None] * out.log_prob).mean()).backward()
    opt = torch.optim.SGD(pol.trainable_parameters(), lr=1.0)
    opt.step()
    for name, tr in pol.experts():
        moved = [not torch.equal(a, p) for a, p in zip(before[name], (p for p in tr.parameters() if p.requires_grad))]
        assert any(moved), f"{name}'s LoRA did not train"
    with pytest.raises(Exception, match="transformer_2 would never train"):
        policy(path, "model.sample_size=4", "model.num_frames=5", "sampler.num_steps=2", "sampler.shift=12")
