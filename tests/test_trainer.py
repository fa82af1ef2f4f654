"""The trainer loop in-process: option combinations, failing rewards, minibatch-split invariance."""

import pytest
import torch

from mmrl.compose import load_config
from mmrl.reward import REWARDS
from mmrl.data import micro_batches
from mmrl.optim import lr_scale
from mmrl.trainer import Trainer


@REWARDS.register("test_flaky")
def _flaky(**kw):
    from rewards.shapes import ShapesReward

    inner = ShapesReward()

    def fn(outputs, examples):
        out = inner(outputs, examples)
        if len(examples) > 1:
            out["overall"][0] = float("nan")
            raise_at = [i for i, e in enumerate(examples) if e["prompt"].startswith("a photo")]
            if raise_at:
                raise RuntimeError("scorer crashed")
        return out

    return fn


@REWARDS.register("test_constant")
def _constant(**kw):
    return lambda outputs, examples: {"overall": torch.ones(len(examples))}


def cfg_for(path, tmp_path, *items):
    return load_config("configs/tiny/flow_smoke.yaml", [f"model.path={path}", f"log.out_dir={tmp_path}",
                                                        "log.tensorboard=false", *items])


def optimize_capturing_grads(tr, ro, adv):
    """tr.optimize(ro, adv) with the weights kept: returns (the gradient of its first optimizer step, metrics)."""
    tr.opt.step = lambda: None
    captured = []
    orig = torch.nn.utils.clip_grad_norm_
    torch.nn.utils.clip_grad_norm_ = lambda params, max_norm: (captured.append([p.grad.clone() for p in tr.params]), torch.tensor(0.0))[1]
    try:
        m = tr.optimize(ro, adv)
    finally:
        torch.nn.utils.clip_grad_norm_ = orig
    return captured[0], m


@pytest.mark.parametrize("items", [
    ["algo.kl_coef=0.1", "model.lora.enabled=true", "model.lora.rank=4"],
    ["algo.kl_coef=0.1", "algo.kl=k3"],
    ["algo.advantage=dr_grpo", "algo.loss_agg=token_mean", "sampler.kind=cps", "sampler.noise_level=0.5"],
    ["train.mixed_precision=bf16", "train.gradient_checkpointing=true"],
    ["train.grad_accum=2", "train.inner_epochs=2", "train.ema_decay=0.5", "sampler.sde_window_size=2"],
    ["algo.ratio=guard", "algo.weighting=guard_dt", "algo.clip_range=2e-6", "train.inner_epochs=2"],  # GRPO-Guard
    ["algo.ratio=guard", "algo.weighting=tempflow+guard_dt", "sampler.sde_window_size=1",
     "sampler.shared_noise=true"],  # TempFlow branch point (shared noise, one SDE step) + weights + Guard
])
def test_option_combinations_run(tiny_pixel_model, tmp_path, items):
    tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "train.iterations=1", "log.eval_at_start=false", *items))
    m = tr.step(0)
    assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
    if "algo.kl_coef=0.1" in items:
        assert m["train/kl"] >= 0


def test_failing_reward_samples_counted_and_run_continues(tiny_pixel_model, tmp_path):
    cfg = cfg_for(tiny_pixel_model, tmp_path, "reward.name=test_flaky", "train.iterations=2", "log.eval_at_start=false")
    tr = Trainer(cfg)
    m = tr.step(0)
    assert m["reward/failed_samples"] >= 1
    assert torch.isfinite(torch.tensor(m["train/loss"]))
    assert tr.fit()["iterations"] == 2


def test_minibatch_split_gives_the_full_batch_gradient(tiny_pixel_model, tmp_path):
    """minibatches=2 with grad_accum=2 accumulates exactly the gradient of minibatches=1."""
    grads = []
    for items in (["train.minibatches=1"], ["train.minibatches=2", "train.grad_accum=2"]):
        tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, *items))
        ro = tr.policy.sample([{"prompt": "a red circle"}, {"prompt": "two squares"}], 3, torch.Generator().manual_seed(0))
        grads.append(optimize_capturing_grads(tr, ro, torch.linspace(-1, 1, len(ro)))[0])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("items", [
    [],
    ["algo.kl_coef=0.1", "algo.ratio=guard", "algo.weighting=tempflow+guard_dt", "algo.loss_agg=token_mean"],
    ["algo.advantage=dr_grpo", "algo.loss_agg=seq_sum_norm", "model.lora.enabled=true", "model.lora.rank=4"],
    ["algo.objective.name=nft", "sampler.cfg_scale=1.0", "sampler.kind=ode", "sampler.forward_timesteps=3"],
    ["algo.objective.name=awm", "sampler.cfg_scale=1.0", "algo.kl_coef=0.1", "algo.kl=flow_velocity", "sampler.ode_solver=dpm2m"],
])
def test_micro_batches_give_the_whole_minibatch_gradient(tiny_pixel_model, tmp_path, items):
    """train.micro_batch=4 transitions (a sample's 3 trained steps split across parts, with CFG) accumulates the
    gradient of the un-split minibatch; sampling in micro-batches draws the same rollout."""
    grads, rollouts = [], []
    for micro in (0, 4):
        torch.manual_seed(0)
        tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "train.minibatches=1", f"train.micro_batch={micro}", *items))
        ro = tr.policy.sample([{"prompt": "a red circle"}, {"prompt": "two squares"}], 3, torch.Generator().manual_seed(0))
        rollouts.append(ro)
        grads.append(optimize_capturing_grads(tr, ro, torch.linspace(-1, 1, len(ro)))[0])
    torch.testing.assert_close(rollouts[0].outputs, rollouts[1].outputs, atol=1e-6, rtol=0)
    diff = max((a - b).abs().max().item() for a, b in zip(*grads))
    assert diff < 1e-5 * max(g.abs().max().item() for g in grads[0])
    actions = int(ro.action_mask.sum())  # 6 samples x 3 steps (or noise levels) in parts of 4
    assert len(list(micro_batches(ro.action_mask, torch.arange(len(ro)), 4, True))) == -(-actions // 4)


@pytest.mark.parametrize("config", ["shapes_grpo", "shapes_tempflow_guard", "shapes_tempflow_branch", "shapes_branchgrpo",
                                    "shapes_branchgrpo_pruned", "shapes_overopt", "shapes_overopt_guard"])
def test_shapes_configs_smoke(config, tiny_pixel_model, tmp_path):
    """Every shapes config (the TempFlow + Guard composition, TempFlow's per-step branching, BranchGRPO trees, the
    proxy-reward runs) runs 2 iterations as written, on a tiny model with small batches (trees keep their 8 leaves,
    branching its 16 children per prompt)."""
    tree, branch = "branchgrpo" in config, "tempflow_branch" in config
    cfg = load_config(f"configs/t2i/{config}.yaml", [
        f"model.path={tiny_pixel_model}", f"log.out_dir={tmp_path}", "log.tensorboard=false", "log.progress=false",
        "train.iterations=2", "train.time_budget_min=0", "train.prompts_per_iter=2", "task.eval_prompts=6",
        f"train.group_size={8 if tree else 16 if branch else 3}"])
    res = Trainer(cfg).fit()
    assert res["iterations"] == 2 and 0.0 <= res["eval_end"]["strict"] <= 1.0  # overall: a proxy may exceed 1


def test_sft_coef_adds_the_nll_of_the_injected_rows(tiny_pixel_model, tmp_path):
    """With zero advantages the PPO term has no gradient, so the step's gradient is exactly that of
    sft_coef x sum over injected rows of their mean per-action NLL / N (seq_mean_token_mean)."""
    tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "train.minibatches=2", "train.grad_accum=2",
                         "algo.offpolicy=ground_truth", "algo.objective.sft_coef=2.5"))
    ro = tr.policy.sample([{"prompt": "a red circle"}, {"prompt": "two squares"}], 3, torch.Generator().manual_seed(0))
    ro.is_offpolicy = torch.tensor([False, False, True, False, False, True])  # one "injected" row per group
    grads, m = optimize_capturing_grads(tr, ro, torch.zeros(len(ro)))
    for p in tr.params:
        p.grad = None
    out = tr.policy.log_prob(ro, torch.arange(len(ro)))
    nll = -(out.log_prob * ro.action_mask).sum(-1) / ro.action_mask.sum(-1)  # [N] mean per-action NLL
    (2.5 * nll[ro.is_offpolicy].sum() / len(ro)).backward()
    for got, p in zip(grads, tr.params):
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        assert torch.allclose(got, want, atol=1e-7, rtol=1e-4)
    assert m["train/sft_nll"] == pytest.approx(float(-out.log_prob.detach()[ro.is_offpolicy][ro.action_mask[ro.is_offpolicy]].mean()), rel=1e-4)
    assert any(g.abs().sum() > 0 for g in grads)  # the NLL really moves the weights


# ------------------------------------------------------------------ several rewards, pairwise, remote, overlap
def test_pairwise_multi_gdpo_remote_and_overlap_through_the_trainer(tiny_pixel_model, tmp_path):
    from mmrl.reward_server import RewardServer

    # Pref-GRPO: win rates from a score judge on the shapes reward; evaluated on the gold shapes reward
    tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "reward.name=pairwise", "reward.eval_name=shapes",
                         "train.iterations=1", "log.eval_at_start=false"))
    m = tr.step(0)
    assert 0 <= m["reward/overall_mean"] <= 1 and "reward/tie_rate_mean" in m
    assert abs(m["reward/overall_mean"] - 0.5) < 1e-6  # win rates average 0.5 in every fully compared group
    assert "strict" in tr.evaluate(1)
    # GDPO over two components, each logged
    multi = ('reward.kwargs={"components": {"shapes": {"weight": 1.0}, '
             '"stable": {"name": "temporal_consistency", "weight": 0.1}}}')
    with pytest.raises(ValueError, match="N, 3, F, H, W"):  # images are not videos: the component says so
        Trainer(cfg_for(tiny_pixel_model, tmp_path, "reward.name=multi", multi, "reward.on_error=raise")).step(0)
    multi = ('reward.kwargs={"components": {"shapes": {"weight": 1.0}, "sat": {"name": "shapes", '
             '"weight": [[0, 0.5], [10, 0.0]], "kwargs": {"strict_weight": 0.0}}}}')  # a scheduled weight
    m = Trainer(cfg_for(tiny_pixel_model, tmp_path, "reward.name=multi", multi, "algo.reward_aggregation=gdpo",
                        "train.iterations=1", "log.eval_at_start=false")).step(4)
    assert {"reward/shapes_mean", "reward/sat_mean", "reward/shapes/strict_mean"} <= set(m)
    assert m["reward/shapes_weight"] == 1.0 and m["reward/sat_weight"] == pytest.approx(0.3)  # iteration 4 of 10
    # a remote reward scored in the thread pool while the next chunk samples
    srv = RewardServer(REWARDS["shapes"]()).start()
    try:
        tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "reward.name=remote", f"reward.kwargs={{\"url\": \"{srv.url}\"}}",
                             "reward.workers=1", "reward.overlap_chunks=2", "reward.eval_name=shapes",
                             "train.iterations=1", "log.eval_at_start=false"))
        ro, rewards, valid, fails = tr.collect.sample_and_score([{"prompt": "a red circle"}, {"prompt": "two squares"}],
                                                         torch.Generator().manual_seed(0))
        assert fails == 0 and valid.all() and ro.group_id.tolist() == [0, 0, 0, 1, 1, 1]
        assert torch.equal(rewards["overall"], REWARDS["shapes"]()(ro.outputs, ro.examples)["overall"])
        m = tr.step(0)
        assert "time/reward_wait" in m and srv.requests >= 2
    finally:
        srv.close()


@pytest.mark.parametrize("items,match", [
    (["reward.name=pairwise"], "reward.eval_name"),
    (["algo.reward_aggregation=gdpo"], "reward.name=multi"),
    (["algo.reward_aggregation=gpdo"], "Did you mean 'gdpo'"),
    (["reward.workers=-1"], "reward.workers"),
    (["algo.objective.sft_coef=1.0"], "algo.offpolicy=ground_truth"),
    (["algo.objective.sft_coef=-1.0"], "algo.objective.sft_coef"),
])
def test_reward_config_errors_name_the_fix(tiny_pixel_model, tmp_path, items, match):
    with pytest.raises(ValueError, match=match):
        cfg_for(tiny_pixel_model, tmp_path, *items)


def test_lr_scale_by_hand():
    assert lr_scale(0, 100, 0.0, 0.0, 10, 0.0) == pytest.approx(0.1)        # warm-up: (0 + 1) / 10
    assert lr_scale(9, 100, 0.0, 0.0, 10, 0.0) == 1.0
    assert lr_scale(50, 100, 0.0, 0.0, 0, 0.2) == 1.0                      # before the cool-down
    assert lr_scale(90, 100, 0.0, 0.0, 0, 0.2) == pytest.approx(0.5)       # (1 - 0.9) / 0.2
    assert lr_scale(5, 1000, 7.2, 8.0, 0, 0.2) == pytest.approx(0.5)       # the time budget ends it first
    assert lr_scale(5, 1000, 9.0, 8.0, 0, 0.2) == 0.0                      # past the budget: never negative


def test_a_reward_failing_on_every_sample_stops_the_run(tiny_pixel_model, tmp_path):
    """The README's old SD3.5 mistake: the shapes detector on GenEval prompts raises for every sample; the run must
    stop naming the reward and the fix instead of training on zero loss."""
    prompts = tmp_path / "geneval.txt"
    prompts.write_text("a photo of a bicycle\na photo of two cats\n")
    tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "task.name=prompt_file", f"task.prompt_file={prompts}",
                         "log.eval_at_start=false"))
    with pytest.raises(RuntimeError, match=r"reward 'shapes' failed on 6 of 6 samples.*not a shapes-world prompt.*Fix"):
        tr.step(0)


def test_all_zero_advantages_warn_after_patience(tiny_pixel_model, tmp_path, caplog):
    tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "reward.name=test_constant", "train.zero_signal_patience=2",
                         "log.eval_at_start=false"))
    tr.step(0)
    assert "NO LEARNING SIGNAL" not in caplog.text
    tr.step(1)
    assert "NO LEARNING SIGNAL: every advantage has been 0 for 2 iterations" in caplog.text


def test_timed_evaluations_are_listed_and_survive_resume(tiny_pixel_model, tmp_path):
    """log.eval_every_min: an evaluation each time that many minutes have passed (not at the end, which always
    evaluates), listed in results.json with its minute and iteration; a resumed run keeps the list."""
    items = ["train.iterations=3", "log.eval_every_min=0.0001", "log.save_every=1", "task.eval_prompts=4",
             "log.eval_at_start=false", "log.progress=false"]
    res = Trainer(cfg_for(tiny_pixel_model, tmp_path, *items)).fit()
    timed = res["eval_timed"]
    assert [e["iteration"] for e in timed] == [1, 2] and all(e["minutes"] > 0 and "strict" in e for e in timed)
    tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, *items[1:], "train.iterations=4"))
    assert tr.resume() and tr.timed_evals == timed
    assert [e["iteration"] for e in tr.fit()["eval_timed"]] == [1, 2]  # iteration 4 is the last: evaluated at the end


def test_a_non_finite_gradient_skips_the_step_and_stops_the_run_when_it_repeats(tiny_pixel_model, tmp_path):
    """A NaN loss (seen in bf16 on an H200 with a tiny FLUX.1) must not reach the weights: the step is skipped and
    counted (train/skipped_steps; the norm is global, so every rank skips alike); three in a row stop the run."""
    import math

    tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "train.minibatches=1", "log.eval_at_start=false"))
    aggregate = tr.objective.aggregate
    tr.objective.aggregate = lambda *a, **k: aggregate(*a, **k) * float("nan")
    before = [p.detach().clone() for p in tr.params]
    m = tr.step(0)
    assert m["train/skipped_steps"] == 1.0 and m["train/optimizer_steps"] == 0
    assert all(torch.equal(a, p) for a, p in zip(before, tr.params))
    assert all(p.grad is None for p in tr.params)
    tr.step(1)
    with pytest.raises(RuntimeError, match="3 optimizer steps in a row had a non-finite gradient"):
        tr.step(2)
    tr.objective.aggregate = aggregate
    tr.nonfinite = 0
    m = tr.step(3)
    assert m["train/skipped_steps"] == 0.0 and m["train/optimizer_steps"] == 1 and math.isfinite(m["train/grad_norm"])


def test_a_resumed_run_whose_time_budget_is_spent_trains_nothing_and_says_so(tiny_pixel_model, tmp_path, caplog):
    """Resuming a run whose train.time_budget_min is spent trained one more iteration without a word."""
    tr = Trainer(cfg_for(tiny_pixel_model, tmp_path, "train.time_budget_min=1", "train.iterations=10",
                         "log.eval_at_start=false"))
    tr.iteration, tr.elapsed_min = 3, 1.2  # as a resume of such a run leaves it
    with caplog.at_level("WARNING"):
        res = tr.fit()
    assert res["iterations"] == 3 and "time_budget_min=1.0 is spent" in caplog.text


def test_a_trainer_checks_its_config_once(tiny_pixel_model, tmp_path, monkeypatch):
    """load_config checks every registry name; the Trainer does not check that config again (it did: twice in all),
    but a config changed after loading (or built in code) is checked when the Trainer gets it."""
    import mmrl.compose as compose

    calls = []
    check = compose.check_choices
    monkeypatch.setattr(compose, "check_choices", lambda cfg: calls.append(1) or check(cfg))
    cfg = cfg_for(tiny_pixel_model, tmp_path)
    Trainer(cfg)
    assert len(calls) == 1
    cfg.algo.advantage = "no_such_advantage"  # changed after the check: checked again, and refused
    with pytest.raises(ValueError, match="algo.advantage"):
        Trainer(cfg)
    assert len(calls) == 2


def test_adamw_is_fused_for_plain_parameters_and_steps_as_torch_default():
    """mmrl.optim.adamw: the fused kernel for plain parameters (one kernel per step), equal to torch's default AdamW
    over 5 steps within fp32 rounding, and its state dict loads into the default one (checkpoints move)."""
    from mmrl.optim import adamw

    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(64, 8)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    fused, plain = adamw(a, 1e-2, 0.1), torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    for _ in range(5):
        for p, q in zip(a, b):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    assert max((p - q).abs().max().item() for p, q in zip(a, b)) < 1e-6
    plain.load_state_dict(fused.state_dict())
