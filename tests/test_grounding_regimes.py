"""The grounding regimes of the pre-registered protocol (docs/results.md, "Where RL should beat supervised training"):
label pools and label noise shared by SFT and GRPO, coarse rewards, the RFT / DPO pieces, the difficulty filter,
the plateau rule, and the driver's arms and decision rule. Tiny worlds, no training runs."""

import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from mmrl.config import TaskConfig
from rewards.grounding import GroundingReward
from tasks.grounding import (GroundingWorldTask, apply_label_noise, keep_queries, random_span, select_label_pool,
                             shifted_span)
from tasks.grounding_metrics import tiou

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_OOD = {"train": 8, "test": 2, "long": 1, "novel": 1, "crowded": 1}


def script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ood_world(tmp_path_factory) -> str:
    from tasks.grounding_world import build_world

    root = str(tmp_path_factory.mktemp("regimes") / "gw")
    build_world(root, SMALL_OOD, ood=True)
    return root


def fake_examples(n=200, duration=8.0, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        s = float(rng.randint(0, 5))
        out.append({"qid": f"V{i:04d}#1", "duration": duration, "windows": [[s, s + rng.randint(1, 3)]]})
    return out


def grpo_task(config, world, *overrides):
    """The task a GRPO config builds (mmrl train), on the tiny world."""
    from mmrl import compose

    cfg = compose.load_config(os.path.join(ROOT, config), [f"task.kwargs.root={world}", "task.eval_prompts=100",
                                                           *overrides])
    return compose.build_task(cfg.task)


def sft_task(world, *argv):
    """The task scripts/sft_grounding.py trains on with these options."""
    sft = script("sft_grounding")
    return sft.make_task(sft.parse_args(["--ood", "--world", world, "--eval-n", "100", *argv]))


# ------------------------------------------------------------------ A: scarce labels
def test_label_pool_is_seeded_order_free_and_shared_by_sft_and_grpo(ood_world):
    full = GroundingWorldTask(TaskConfig(eval_prompts=100), root=ood_world, ood=True)
    n = len(full.train)
    pool = select_label_pool(full.train, 7, seed=0)
    assert len(pool) == 7 and pool == select_label_pool(full.train, 7, seed=0)
    assert {e["qid"] for e in select_label_pool(full.train[::-1], 7, seed=0)} == {e["qid"] for e in pool}
    assert {e["qid"] for e in select_label_pool(full.train, 7, seed=1)} != {e["qid"] for e in pool}
    assert [e["qid"] for e in pool] == [e["qid"] for e in full.train if e in pool]  # original order kept
    # a bigger pool from the same seed is drawn independently, but always within the training queries
    assert {e["qid"] for e in select_label_pool(full.train, n, seed=0)} == {e["qid"] for e in full.train}
    with pytest.raises(ValueError, match="label_pool"):
        select_label_pool(full.train, n + 1)
    # GRPO's config and SFT's options give the same pool; held-out queries are untouched
    grpo = grpo_task("configs/grounding/regime_a_grpo.yaml", ood_world, "task.kwargs.label_pool=7")
    sft = sft_task(ood_world, "--label-pool", "7", "--pool-seed", "0")
    assert [e["qid"] for e in grpo.train] == [e["qid"] for e in sft.train] == [e["qid"] for e in pool]
    assert grpo.eval == full.eval and len(grpo.train_clean) == n
    assert grpo.label_info == {"train_queries": n, "label_pool": 7, "pool_seed": 0, "used_queries": 7}
    # sampling draws from the pool only
    assert {e["qid"] for e in grpo.sample(200, random.Random(0))} <= {e["qid"] for e in pool}


# ------------------------------------------------------------------ B: noisy labels
def test_label_noise_fraction_halves_and_bounds():
    clean = fake_examples(200)
    noisy = apply_label_noise(clean, 0.3, seed=0)
    assert clean == fake_examples(200)  # inputs untouched
    changed = [(c, x) for c, x in zip(clean, noisy) if "label_noise" in x]
    assert len(changed) == 60  # exactly round(0.3 * 200)
    assert sum(x["label_noise"] == "shifted" for _, x in changed) == 30
    assert sum(x["label_noise"] == "random" for _, x in changed) == 30
    assert all(c is x for c, x in zip(clean, noisy) if "label_noise" not in x)
    for c, x in changed:
        (s, e), (a, b) = c["windows"][0], x["windows"][0]
        assert 0 <= a < b <= 8.0 and x["qid"] == c["qid"] and x["duration"] == c["duration"]
        assert abs(a * 10 - round(a * 10)) < 1e-6 and abs(b * 10 - round(b * 10)) < 1e-6  # on the 0.1 s grid
        if x["label_noise"] == "shifted":
            shift = (a + b - s - e) / 2 if 0 < a and b < 8.0 else None  # not clipped: the whole span moved
            if shift is not None:
                assert abs(b - a - (e - s)) < 0.11 and 0.2 * 8 - 0.06 <= abs(shift) <= 0.5 * 8 + 0.06
            else:  # clipped at an end of the video: it moved by at least 20% of the duration at the other end
                assert max(abs(a - s), abs(b - e)) >= 0.2 * 8 - 0.06
    assert apply_label_noise(clean, 0.3, seed=0) == noisy and apply_label_noise(clean, 0.3, seed=1) != noisy
    assert apply_label_noise(clean[::-1], 0.3, seed=0)[::-1] == noisy  # order-free
    odd = apply_label_noise(fake_examples(11), 0.5, seed=0)  # 6 replaced: 3 shifted + 3 random
    assert [sum(x.get("label_noise") == k for x in odd) for k in ("shifted", "random")] == [3, 3]
    assert apply_label_noise(clean, 0.0) == clean
    with pytest.raises(ValueError, match="label_noise"):
        apply_label_noise(clean, 1.5)


def test_noisy_span_helpers():
    rng = random.Random(0)
    for _ in range(500):
        for w in ([0.0, 8.0], [6.0, 8.0], [0.0, 1.0], [3.0, 5.0]):
            a, b = shifted_span(w, 8.0, rng)
            assert 0 <= a < b <= 8.0 and (a, b) != tuple(w)
        a, b = random_span(16.0, rng)
        assert 0 <= a < b <= 16.0
    starts = [random_span(8.0, rng)[0] for _ in range(2000)]
    assert 2.4 < sum(starts) / len(starts) < 2.9  # min of two uniforms on [0, 8]: mean 8 / 3


def test_noisy_spans_reach_sft_targets_and_grpo_reward_and_held_out_stays_true(ood_world):
    full = GroundingWorldTask(TaskConfig(eval_prompts=100), root=ood_world, ood=True)
    grpo = grpo_task("configs/grounding/regime_b_grpo.yaml", ood_world)
    sft = sft_task(ood_world, "--label-noise", "0.3", "--noise-seed", "0")
    assert [e["windows"] for e in grpo.train] == [e["windows"] for e in sft.train]
    noisy = [e for e in grpo.train if "label_noise" in e]
    assert len(noisy) == round(0.3 * len(full.train)) and grpo.label_info["noisy"] == len(noisy)
    assert [e["windows"] for e in grpo.train_clean] == [e["windows"] for e in full.train]
    assert grpo.eval == full.eval and sft.eval == GroundingWorldTask(TaskConfig(eval_prompts=100), root=ood_world,
                                                                      ood=True).eval
    ex = noisy[0]
    clean = next(e for e in full.train if e["qid"] == ex["qid"])
    # the SFT target / TempSamp-R1's injected answer is the noisy span, and the reward pays for it
    target = sft.reference_output(next(e for e in sft.train if e["qid"] == ex["qid"]))
    assert target == grpo.reference_output(ex) != full.reference_output(clean)
    assert GroundingReward()([target], [ex])["iou"].item() == pytest.approx(1.0)
    # the blind baseline still fits on the true spans
    fit = [t.baselines()["constant answer"]["window_fraction"] for t in (grpo, full)]
    assert fit[0] == fit[1]


# ------------------------------------------------------------------ C: reward only
def test_coarse_rewards_by_hand():
    ex = {"duration": 10.0, "windows": [[4.0, 8.0]]}
    answers = ["4 to 8", "4 to 7", "4 to 6", "3 to 8", "2 to 6", "5 to 6", "0 to 1", None]
    texts = [f"<think></think><answer>{a}</answer>" if a else "no answer" for a in answers]
    ious = [1.0, 0.75, 0.5, 0.8, 1 / 3, 0.25, 0.0, 0.0]
    fmt = [1.0] * 7 + [0.0]
    plain = GroundingReward()(texts, [ex] * len(texts))
    assert plain["iou"].tolist() == pytest.approx(ious) and "coarse" not in plain
    bit = GroundingReward(coarse="bit")(texts, [ex] * len(texts))
    assert bit["coarse"].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert bit["overall"].tolist() == pytest.approx([c + 0.1 * f for c, f in zip(bit["coarse"].tolist(), fmt)])
    bucket = GroundingReward(coarse="bucket", format_weight=0.0)(texts, [ex] * len(texts))
    assert bucket["coarse"].tolist() == [1.0, 0.75, 0.5, 0.75, 0.25, 0.25, 0.0, 0.0]
    assert bucket["overall"].tolist() == bucket["coarse"].tolist()
    for out in (bit, bucket):  # the raw components are still there, for the logs
        assert out["iou"].tolist() == pytest.approx(ious) and out["r1@0.5"].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    # a tIoU of 1/2 computed as 0.49999999999999994 still earns the bit and the 0.5 bucket
    near = (["<answer>0.1 to 0.9</answer>"], [{"duration": 1.0, "windows": [[0.3, 0.7]]}])
    assert tiou((0.1, 0.9), (0.3, 0.7)) < 0.5
    assert GroundingReward(coarse="bit")(*near)["coarse"].item() == 1.0
    assert GroundingReward(coarse="bucket")(*near)["coarse"].item() == 0.5
    with pytest.raises(ValueError, match="coarse"):
        GroundingReward(coarse="bits")


def test_reward_only_configs_show_no_span():
    from mmrl import compose

    for name, coarse in (("regime_c_bit", "bit"), ("regime_c_bucket", "bucket")):
        cfg = compose.load_config(os.path.join(ROOT, "configs/grounding", name + ".yaml"))
        assert cfg.algo.offpolicy == "none" and cfg.algo.objective.sft_coef == 0 and cfg.reward.kwargs["coarse"] == coarse
        assert cfg.algo.shaping.name == "none" and cfg.reward.eval_name == "grounding"
        assert "coarse" not in cfg.reward.eval_kwargs and cfg.task.kwargs.get("ood") is True
        assert compose.build_reward(cfg.reward.name, cfg.reward.kwargs).coarse == coarse


def test_rft_keeps_the_bit_and_dpo_pairs_best_and_worst():
    sft = script("sft_grounding")
    ex = {"duration": 10.0, "windows": [[4.0, 8.0]]}
    ro = SimpleNamespace(outputs=["<answer>4 to 8</answer>", "<answer>0 to 1</answer>", "<answer>4 to 6</answer>", ""],
                         examples=[ex] * 4)
    kept = sft.rft_keep(GroundingReward(coarse="bit"), ro)
    assert [t for _, t in kept] == ["<answer>4 to 8</answer>", "<answer>4 to 6</answer>"] and kept[0][0] is ex
    overall = torch.tensor([0.1, 1.1, 0.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.7])
    gid = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    w, lo = sft.best_worst_pairs(overall, gid)
    assert w.tolist() == [1, 3, 8] and lo.tolist() == [2, 4, 6]  # group 1's tie: the first lowest


def test_dpo_loss_starts_at_log2_and_trains(tiny_vl, tiny_world):
    from mmrl.config import LoraConfig, SamplerConfig
    from mmrl.policy.token import TokenPolicy, load_token_model
    from mmrl.video import VideoOptions

    sft = script("sft_grounding")
    model, proc = load_token_model(tiny_vl)
    pol = TokenPolicy(model=model, processor=proc, sampler_cfg=SamplerConfig(temperature=1.0, max_new_tokens=6),
                      lora_cfg=LoraConfig(), video=VideoOptions(min_pixels=56 * 56, max_pixels=56 * 56), freeze_vision=False, reference="auto")
    pol.defer_old_log_prob = True
    task = GroundingWorldTask(TaskConfig(eval_prompts=2), root=tiny_world)
    ro = pol.sample(task.train[:2], 3, torch.Generator().manual_seed(0))
    w, lo = torch.tensor([0, 3]), torch.tensor([1, 4])
    loss = sft.dpo_loss(pol, ro, w, lo, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5)  # the policy is its reference at the start
    loss.backward()
    grads = [p.grad for p in pol.trainable_parameters() if p.grad is not None]
    assert grads and (ro.outputs[0] == ro.outputs[1] or any(g.abs().max() > 0 for g in grads))


# ------------------------------------------------------------------ D: after a plateau
def test_plateau_rule_on_a_scripted_sequence():
    sft = script("sft_grounding")
    p = sft.Plateau(3)
    seq = [0.50, 0.60, 0.60, 0.59, 0.61, 0.61, 0.55, 0.60, 0.70]
    flags, stop_at = [], None
    for i, x in enumerate(seq):
        flags.append(p.update(x))
        if p.stop:
            stop_at = i
            break
    assert flags == [True, True, False, False, True, False, False, False]  # equal is not a rise
    assert stop_at == 7 and p.best == 0.61 and p.best_index == 4


def test_until_plateau_saves_the_best_and_stops(ood_world, tmp_path, monkeypatch):
    """sft_grounding.py --until-plateau with a scripted held-out mIoU: it stops after `patience` evaluations
    without a rise and --out holds the best model (evaluation 1), scored on the id queries only."""
    import rewards.grounding as grounding

    sft = script("sft_grounding")
    scripted, seen = iter([0.1, 0.2, 0.2, 0.15, 0.9]), []

    def fake_eval(policy, examples, batch_size=32, progress=True):
        seen.append({e.get("category") for e in examples})
        return {"mIoU": next(scripted), "R1@0.3": 0.0, "R1@0.5": 0.0, "R1@0.7": 0.0, "parsed": 1.0, "format": 1.0,
                "n": len(examples)}

    monkeypatch.setattr(grounding, "evaluate", fake_eval)
    out = str(tmp_path / "plateau")
    sft.main(["--ood", "--world", ood_world, "--size", "tiny", "--batch", "2", "--threads", "1", "--minutes", "5",
              "--eval-every", "0", "--eval-n", "3", "--until-plateau", "--patience", "2", "--out", out])
    summary = json.load(open(os.path.join(out, "plateau.json")))
    assert summary["stopped"] == "plateau" and summary["history"] == [0.1, 0.2, 0.2, 0.15]
    assert summary["best_evaluation"] == 1 and summary["steps"] == 3
    info = json.load(open(os.path.join(out, "sft_info.json")))
    assert info["best_mIoU"] == 0.2 and info["evaluation"] == 1 and info["step"] == 1
    assert all(cats == {"id"} for cats in seen)


def test_difficulty_filter_on_a_stub(ood_world, tmp_path):
    regimes = script("grounding_regimes")
    exs = [{"qid": q, "duration": 8.0, "windows": [[2.0, 6.0]]} for q in ("always", "never", "half", "once")]
    answers = {"always": ["2 to 6"] * 8, "never": ["7 to 8"] * 8, "half": ["2 to 6", "0 to 1"] * 4,
               "once": ["2 to 5"] + ["6 to 8"] * 7}

    class Stub:
        def sample(self, examples, group_size, generator):
            assert group_size == 8
            return SimpleNamespace(outputs=[f"<answer>{a}</answer>" for ex in examples for a in answers[ex["qid"]]],
                                   examples=[ex for ex in examples for _ in range(group_size)],
                                   group_id=torch.arange(len(examples)).repeat_interleave(group_size))

    keep, rates = regimes.difficulty_filter(Stub(), exs, samples=8)
    assert rates == {"always": 1.0, "never": 0.0, "half": 0.5, "once": 0.125} and keep == ["half", "once"]
    assert regimes.success_rates(Stub(), exs[:3], chunk=2) == {"always": 1.0, "never": 0.0, "half": 0.5}
    # the task kwarg keeps exactly the listed training queries; ids of another world are an error
    full = GroundingWorldTask(TaskConfig(eval_prompts=4), root=ood_world, ood=True)
    ids = [full.train[1]["qid"], full.train[4]["qid"]]
    path = tmp_path / "filter.json"
    path.write_text(json.dumps(ids))
    task = grpo_task("configs/grounding/regime_d_grpo.yaml", ood_world, f"task.kwargs.difficulty_filter={path}")
    assert [e["qid"] for e in task.train] == ids and task.eval == GroundingWorldTask(
        TaskConfig(eval_prompts=100), root=ood_world, ood=True).eval
    path.write_text(json.dumps(ids + ["NOPE#1"]))
    with pytest.raises(ValueError, match="not training queries"):
        grpo_task("configs/grounding/regime_d_grpo.yaml", ood_world, f"task.kwargs.difficulty_filter={path}")
    with pytest.raises(ValueError, match="keeps no"):
        keep_queries(full.train, [])


# ------------------------------------------------------------------ the driver
def test_driver_help_and_arms():
    r = subprocess.run([sys.executable, "scripts/grounding_regimes.py", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "usage" in r.stdout and "--regime" in r.stdout
    regimes = script("grounding_regimes")

    def args(regime, **kw):
        base = dict(regime=regime, minutes=6.0, out="/o", world="/w", pools=[256, 1024], noise=0.3, no_dpo=False,
                    sft_lr=1e-3, train_eval_n=20, grpo_overrides=[])
        return SimpleNamespace(**{**base, **kw})

    a = regimes.arms_for(args("A"), 1, "/base")
    assert [x.name for x in a] == ["sft@256", "grpo@256", "sft_grpo@256", "sft@1024", "grpo@1024", "sft_grpo@1024"]
    sft_grpo = a[2]
    assert len(sft_grpo.steps) == 2 and "3" == sft_grpo.steps[0][sft_grpo.steps[0].index("--minutes") + 1]
    assert "train.time_budget_min=3" in sft_grpo.steps[1] and "model.path=/o/sft_half256_s1" in sft_grpo.steps[1]
    assert all("task.kwargs.label_pool=256" in s for s in a[1].steps + a[2].steps[1:])
    assert all(s[s.index("--label-pool") + 1] == "256" for s in a[0].steps + a[2].steps[:1])
    assert {x.comparison for x in a} == {"pool 256", "pool 1024"}
    c = regimes.arms_for(args("C"), 0, "/base")
    assert [x.name for x in c] == ["grpo_bit", "grpo_bucket", "rft", "dpo"]
    assert "--rft" in c[2].steps[0] and "--dpo" in c[3].steps[0]
    assert [x.kind for x in c] == ["rl", "rl", "baseline", "baseline"]
    d = regimes.arms_for(args("D"), 2, "/plateau", "/o/filter.json")
    assert "task.kwargs.difficulty_filter=/o/filter.json" in d[1].steps[0]
    assert "model.path=/plateau" in d[1].steps[0] and d[0].steps[0][d[0].steps[0].index("--init") + 1] == "/plateau"


def test_decision_rule_and_summary():
    regimes = script("grounding_regimes")
    assert regimes.decide([0.60, 0.62, 0.64], [0.55, 0.58, 0.60])["verdict"] == "rl wins"
    assert regimes.decide([0.60, 0.62, 0.64], [0.59, 0.60, 0.62])["verdict"] == "tie"  # +0.017 < 0.03
    assert regimes.decide([0.65, 0.52, 0.63], [0.55, 0.57, 0.58])["verdict"] == "tie"  # +0.033 but se 0.044
    assert regimes.decide([0.50, 0.52, 0.53], [0.55, 0.58, 0.60])["verdict"] == "baseline ahead"
    assert regimes.decide([0.9], [0.1])["verdict"] == "undecided (1 seed)"

    def res(ood, idm=0.7):
        cats = {s: {"iou": idm if s == "id" else ood, "r1@0.5": 0.5, "r1@0.7": 0.25} for s in regimes.SPLITS}
        return {"iou": 0.0, "per_category": cats}

    arms = [regimes.Arm(n, s, k, "C", [], f"/{n}{s}") for s in (0, 1, 2)
            for n, k in (("grpo_bit", "rl"), ("rft", "baseline"), ("dpo", "baseline"))]
    ood = {"grpo_bit": [0.60, 0.62, 0.64], "rft": [0.55, 0.58, 0.60], "dpo": [0.50, 0.50, 0.50]}
    results = {f"/{n}{s}": res(v[s]) for n, v in ood.items() for s in range(3)}
    results["base (/b)"] = res(0.5)
    out = regimes.summarize(arms, results, {})
    assert out["arms"]["rft"]["mean"]["ood_mean"] == pytest.approx(0.5767, abs=1e-4)
    assert out["arms"]["grpo_bit"]["mean"]["id"] == {"mIoU": 0.7, "R1@0.5": 50.0, "R1@0.7": 25.0}
    (dec,) = out["decisions"]
    assert dec["rl"] == "grpo_bit" and dec["baseline"] == "rft" and dec["verdict"] == "rl wins"
    assert out["rows"]["base"]["ood_mean"] == 0.5
