"""GSPO's sequence-level ratio, off-policy injection diagnostics, Rollout.concat, DAPO dynamic sampling."""

import math
import random

import pytest
import torch

from mmrl.algorithms import ADVANTAGES, RATIO_TRANSFORMS
from mmrl.algorithms.offpolicy import injection_diagnostics
from mmrl.config import AlgoConfig
from mmrl.data import Rollout, micro_batches


def _ro(mask, n_groups=1, a=None):
    mask = torch.tensor(mask, dtype=torch.bool)
    n = mask.shape[0]
    return Rollout(group_id=torch.arange(n) // (n // n_groups), old_log_prob=torch.zeros(mask.shape),
                   action_mask=mask, examples=[{}] * n, outputs=["x"] * n,
                   extras={"completion_ids": torch.ones(mask.shape, dtype=torch.long)})


def test_gspo_value_is_sequence_ratio_and_gradient_is_token_level():
    ro = _ro([[1, 1, 0], [1, 1, 1]])
    old = torch.tensor([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    logp = torch.tensor([[-0.5, -2.5, -9.0], [-1.0, -0.7, -1.6]], requires_grad=True)
    out = RATIO_TRANSFORMS["gspo"](logp, old, ro, None)
    # sample 0: mean over its 2 tokens of (0.5, -0.5) = 0; sample 1: mean(0, 0.3, -0.6) = -0.1
    ratio = torch.exp(out - old)
    assert ratio[0, :2].tolist() == pytest.approx([1.0, 1.0])
    assert ratio[1].tolist() == pytest.approx([math.exp(-0.1)] * 3)
    ratio[1].sum().backward()  # d/d logp_t of s_i * (#tokens) = s_i per token (sg on the sequence ratio)
    assert logp.grad[1].tolist() == pytest.approx([math.exp(-0.1)] * 3)


def test_injection_diagnostics_by_hand():
    cfg = AlgoConfig()
    rewards = torch.tensor([0.0, 0.3, 0.35, 1.0])          # one group; the last row is injected
    off = torch.tensor([False, False, False, True])
    d = injection_diagnostics(rewards, torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), off,
                              lambda r, g, v: ADVANTAGES["grpo"](r, g, v, cfg)[0])
    assert d["offpolicy/group_mean_shift"] == pytest.approx(1.65 / 4 - 0.65 / 3)
    # group mean without the injected row 0.2167: signs (-, +, +); with it 0.4125: (-, -, -) -> 2 of 3 flip
    assert d["offpolicy/sign_flip_rate"] == pytest.approx(2 / 3)
    assert d["offpolicy/reward_mean"] == pytest.approx(1.0)


def test_rollout_concat_pads_actions_and_renumbers_groups():
    a, b = _ro([[1, 1], [1, 0]]), _ro([[1, 1, 1], [1, 1, 1]])
    c = Rollout.concat([a, b])
    assert c.group_id.tolist() == [0, 0, 1, 1] and c.action_mask.shape == (4, 3)
    assert c.action_mask[:2, 2].tolist() == [False, False] and c.extras["completion_ids"].shape == (4, 3)
    assert c.outputs == ["x"] * 4


def test_dynamic_sampling_refills_zero_std_groups(tmp_path):
    """A fake policy whose groups alternate between constant and varied rewards: DAPO keeps the varied ones."""
    class Fake:
        calls = 0

        def sample(self, examples, g, gen):
            Fake.calls += 1
            rows = [dict(ex, k=i) for ex in examples for i in range(g)]
            return Rollout(group_id=torch.arange(len(rows)) // g, old_log_prob=torch.zeros(len(rows), 1),
                           action_mask=torch.ones(len(rows), 1, dtype=torch.bool), examples=rows,
                           outputs=[r["prompt"] for r in rows])

    class Task:
        n = 0

        def sample(self, n, rng):
            Task.n += n
            return [{"prompt": f"p{Task.n - n + i}"} for i in range(n)]

    def reward(outputs, examples):  # even prompts: all 1 (zero std); odd prompts: 0/1
        vals = [1.0 if int(e["prompt"][1:]) % 2 == 0 else float(e["k"] % 2) for e in examples]
        return {"overall": torch.tensor(vals)}

    from mmrl.compose import load_config
    from mmrl.reward import RewardRunner

    cfg = load_config(None, ["train.prompts_per_iter=4", "train.group_size=2", "algo.dynamic_sampling=true",
                             "algo.dynamic_sampling_tries=3", f"log.out_dir={tmp_path}"])
    from mmrl.parallel.distributed import Distributed
    from mmrl.metrics import Timer
    from mmrl.rollout.collect import Collector

    collect = Collector(cfg, Fake(), Task(), RewardRunner(reward), Distributed(), Timer())
    ro, rewards, valid, m = collect(random.Random(0), torch.Generator().manual_seed(0))
    assert len(ro) == 8 and m["dynamic/informative_groups"] == 4 and m["dynamic/rounds"] == 4  # found 2, 1, 0, 1
    assert all(int(e["prompt"][1:]) % 2 == 1 for e in ro.examples)
    assert ro.group_id.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_deferred_old_log_prob_trains_identically(tiny_vl, tiny_world, tmp_path):
    """One optimizer step per epoch: old log-probs taken from the trainer's first forward (no extra pass)
    give the same update as those recomputed at rollout time; with 2 steps per epoch nothing is deferred."""
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    def trainer(minibatches, out):
        return Trainer(load_config("configs/tiny/vlm_smoke.yaml", [
            f"model.path={tiny_vl}", f"task.kwargs.root={tiny_world}", "task.kwargs.train_videos=6",
            "task.kwargs.test_videos=3", f"train.minibatches={minibatches}", "train.inner_epochs=2",
            f"log.out_dir={tmp_path / out}", "log.tensorboard=false"]))

    deferred, eager = trainer(1, "a"), trainer(1, "b")
    assert deferred.policy.defer_old_log_prob
    eager.policy.defer_old_log_prob = False
    ma, mb = deferred.step(0), eager.step(0)
    assert ma["train/optimizer_steps"] == mb["train/optimizer_steps"] == 2
    assert abs(ma["train/ratio_mean"] - mb["train/ratio_mean"]) < 1e-6
    for p, q in zip(deferred.params, eager.params):
        assert torch.allclose(p, q, atol=1e-6)
    assert not trainer(2, "c").policy.defer_old_log_prob


def test_token_micro_batches_give_the_whole_minibatch_update(tiny_vl, tiny_world, tmp_path):
    """train.micro_batch=2 sequences: generation runs one prompt (3 samples) at a time and training accumulates
    parts of 2 rows; from one rollout, the accumulated gradient equals the un-split one."""
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    def trainer(micro, out):
        torch.manual_seed(0)
        return Trainer(load_config("configs/tiny/vlm_smoke.yaml", [
            f"model.path={tiny_vl}", f"task.kwargs.root={tiny_world}", "task.kwargs.train_videos=6",
            "task.kwargs.test_videos=3", "train.minibatches=1", f"train.micro_batch={micro}",
            f"log.out_dir={tmp_path / out}", "log.tensorboard=false"]))

    whole, parts = trainer(0, "a"), trainer(2, "b")
    exs = parts.task.sample(2, random.Random(0))
    ro = parts.policy.sample(exs, 3, torch.Generator().manual_seed(0))
    assert ro.extras["completion_ids"].shape[0] == 6
    adv = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.7, -1.0])
    for tr in (whole, parts):  # keep the step's gradient: no update, no zeroing
        tr.policy.defer_old_log_prob = False
        tr.opt.step, tr.opt.zero_grad = (lambda: None), (lambda set_to_none=True: None)
        tr.optimize(ro.select(torch.arange(6)), adv)
    scale = max(p.grad.abs().max().item() for p in whole.params)
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(whole.params, parts.params))
    assert scale > 0 and diff < 1e-5 * scale
    assert len(list(micro_batches(ro.action_mask, torch.arange(6), parts.cfg.train.micro_batch, False))) == 3


# ------------------------------------------------------------------------------------- T-GRPO (Video-R1)
def test_temporal_contrast_by_hand():
    from mmrl.algorithms.shaping import temporal_contrast

    r = torch.tensor([0.6, 0.2, 0.7, 0.1, 0.9, 0.8])
    gid = torch.tensor([0, 0, 1, 1, 2, 2])
    # contrast (shuffled frames): group 0 all correct (p~ 1), group 1 half (p~ 0.5), group 2 none (p~ 0)
    rc, gc = torch.tensor([0.6, 0.6, 0.1, 0.6, 0.0, 0.4]), torch.tensor([0, 0, 1, 1, 2, 2])
    out, stats = temporal_contrast(r, gid, rc, gc, alpha=0.3, mu=0.8, threshold=0.5)
    # group 0: p 0.5 < 0.8 x 1.0 -> no bonus; group 1: p 0.5 >= 0.8 x 0.5 = 0.4 -> +0.3 on its correct sample;
    # group 2: p 1 >= 0 -> +0.3 on both
    torch.testing.assert_close(out, torch.tensor([0.6, 0.2, 1.0, 0.1, 1.2, 1.1]))
    assert stats["tgrpo/bonus_group_frac"] == pytest.approx(2 / 3)
    assert stats["tgrpo/correct_ordered"] == pytest.approx(4 / 6) and stats["tgrpo/correct_shuffled"] == pytest.approx(3 / 6)


def test_shuffled_frames_reach_the_model_and_tgrpo_trains(tiny_vl, tiny_world, tmp_path):
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    tr = Trainer(load_config("configs/tiny/vlm_smoke.yaml", [
        f"model.path={tiny_vl}", f"task.kwargs.root={tiny_world}", "task.kwargs.train_videos=6",
        "task.kwargs.test_videos=3", "algo.shaping.name=tgrpo", "log.eval_at_start=false",
        f"log.out_dir={tmp_path}", "log.tensorboard=false"]))
    ex = tr.task.sample(1, random.Random(0))[0]
    plain, shuffled = tr.policy.encode_prompt(ex), tr.policy.encode_prompt({**ex, "shuffle_frames": 3})
    assert plain["pixel_values_videos"].shape == shuffled["pixel_values_videos"].shape
    assert not torch.equal(plain["pixel_values_videos"], shuffled["pixel_values_videos"])
    assert torch.equal(shuffled["pixel_values_videos"],
                       tr.policy.encode_prompt({**ex, "shuffle_frames": 3})["pixel_values_videos"])
    metrics = tr.step(0)
    assert "contrast/reward_mean" in metrics and metrics["train/optimizer_steps"] == 2


# --------------------------------------------------------------------- truncated importance sampling (engines)
def test_truncated_is_by_hand():
    """w = min(pi_old / pi_engine, cap); an action without an engine log-prob (NaN) keeps weight 1."""
    from mmrl.algorithms.weighting import truncated_is

    old = torch.log(torch.tensor([[0.5, 0.2, 0.3]]))
    engine = torch.log(torch.tensor([[0.25, 0.4, float("nan")]]))
    w, cut = truncated_is(old, engine, cap=1.5)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.5, 1.0]]))   # raw 2.0 -> 1.5, 0.5, NaN -> 1
    assert cut.tolist() == [[True, False, False]]


def test_prefix_cache_engine_log_probs_and_tis_in_training(tiny_vl, tiny_world, tmp_path):
    """The prefix-cache engine keeps the log-prob of every token it samples: equal to the policy's own (fp32, same
    weights), so TIS weights are 1 and engine_ratio_dev ~0; engine log-probs made 2x likelier than the trainer's
    halve the loss (capped weights below 1 scale the gradient), and injected rows carry none (NaN)."""
    from mmrl.compose import load_config
    from mmrl.trainer import Trainer

    def trainer(out, *over):
        torch.manual_seed(0)
        return Trainer(load_config("configs/tiny/vlm_smoke.yaml", [
            f"model.path={tiny_vl}", f"task.kwargs.root={tiny_world}", "task.kwargs.train_videos=6",
            "task.kwargs.test_videos=3", "train.minibatches=1", f"log.out_dir={tmp_path / out}",
            "log.tensorboard=false", *over]))

    tr = trainer("a", "algo.objective.tis_cap=2")
    exs = tr.task.sample(2, random.Random(0))
    tr.policy.defer_old_log_prob = False
    ro = tr.policy.sample(exs, 3, torch.Generator().manual_seed(0))
    engine = ro.extras["rollout_log_prob"]
    known = ro.action_mask & torch.isfinite(engine)
    assert known.sum() == ro.action_mask.sum()                   # every sampled token has one
    assert (engine[known] - ro.old_log_prob[known]).abs().max() < 1e-4
    injected = tr.policy.replace_outputs(ro, torch.tensor([0]), ["<answer>1.0 to 2.0</answer>"])
    assert torch.isnan(injected.extras["rollout_log_prob"][0]).all()
    adv = torch.tensor([1.0, -0.5, -0.5, 0.3, 0.7, -1.0])
    grads = []
    for shift in (0.0, math.log(2.0)):  # the engine's log-probs as they are, then 2x likelier: w = 1/2
        t = trainer(f"b{shift}", "algo.objective.tis_cap=2", "train.max_grad_norm=1e9")  # no clipping: grads compare
        t.opt.step, t.opt.zero_grad = (lambda: None), (lambda set_to_none=True: None)
        r = ro.select(torch.arange(6))
        r.extras["rollout_log_prob"] = r.extras["rollout_log_prob"] + shift
        m = t.optimize(r, adv)
        grads.append([p.grad.clone() for p in t.params])
        assert m["train/tis_weight"] == pytest.approx(1.0 if shift == 0 else 0.5, abs=1e-3)
        assert m["train/engine_ratio_dev"] == pytest.approx(0.0 if shift == 0 else 0.5, abs=1e-3)
    scale = max(g.abs().max().item() for g in grads[0])
    assert scale > 0 and max((a - 2 * b).abs().max().item() for a, b in zip(*grads)) < 1e-4 * scale
    with pytest.raises(ValueError, match="sampler.engine=hf does not record"):
        load_config("configs/tiny/vlm_smoke.yaml", [f"model.path={tiny_vl}", "sampler.engine=hf", "algo.objective.tis_cap=2"])
