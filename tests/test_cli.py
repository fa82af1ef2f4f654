"""The real CLI: a 2-iteration smoke train, and resume that ends bit-identical to an uninterrupted run."""

import json
import os
import subprocess
import sys

import pytest
import torch

from mmrl.checkpoint import read_trainer_state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mmrl(*args):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "mmrl.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    return r


def final_params(out_dir):
    ck = sorted(os.listdir(os.path.join(out_dir, "checkpoints")))[-1]
    return read_trainer_state(os.path.join(out_dir, "checkpoints", ck))  # whole tensors from the DCP shards


def full_and_resumed(common, tmp_path, part_only=()):
    """Train 3 iterations straight, and 2 then --resume to 3 (with the overrides part_only, which must not change
    training). Returns (stdout and out_dir of the straight run, the final trainer states of the straight and the
    resumed run)."""
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    r = mmrl("train", *common, "train.iterations=3", f"log.out_dir={full}", "--json")  # JSON on stdout
    assert r.returncode == 0, r.stderr[-3000:]
    rp = mmrl("train", *common, *part_only, "train.iterations=2", f"log.out_dir={part}")  # the table for people
    assert rp.returncode == 0 and "verdict: " in rp.stdout and f"checkpoints: {part}/checkpoints" in rp.stdout
    assert not rp.stdout.lstrip().startswith("{")
    r2 = mmrl("train", *common, *part_only, "train.iterations=3", f"log.out_dir={part}", "--resume")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "resumed from" in r2.stderr
    a, b = final_params(full), final_params(part)
    assert a["iteration"] == b["iteration"] == 3
    return r.stdout, full, a, b


def test_smoke_train_and_resume_bit_identical(tiny_pixel_model, tmp_path):
    common = ["configs/tiny/flow_smoke.yaml", f"model.path={tiny_pixel_model}", "train.ema_decay=0.9",
              "train.lr_warmup=2", "train.lr_cooldown=0.5", "train.lr=1e-4"]
    # the resumed run evaluates on 2 noise draws (log.eval_draws): its weights still end where the straight run's do
    stdout, full, a, b = full_and_resumed(common, tmp_path, part_only=["log.eval_draws=2"])
    res = json.loads(stdout.strip().splitlines()[-1])
    assert res["iterations"] == 3 and 0.0 <= res["eval_end"]["strict"] <= 1.0
    lines = [json.loads(ln) for ln in open(os.path.join(full, "metrics.jsonl"))]
    train_lines = [ln for ln in lines if "reward/overall_mean" in ln]
    assert len(train_lines) == 3 and all("train/clip_frac" in ln and "ratio_per_action/0" in ln for ln in train_lines)
    # warm-up over 2 iterations, then a linear decay over the last half of 3: 1/2, min(1, (2/3)/0.5), (1/3)/0.5
    assert [ln["train/lr"] for ln in train_lines] == pytest.approx([0.5e-4, 1e-4, 2 / 3 * 1e-4])
    assert os.listdir(os.path.join(full, "tb"))  # TensorBoard event files
    for x, y in zip(a["params"] + a["ema"], b["params"] + b["ema"]):
        assert torch.equal(x, y)
    # mmrl eval of the final checkpoint (its EMA policy) at the trainer's eval seeds gives the trainer's own figure
    ck = os.path.join(full, "checkpoints", "iter-000003")
    r = mmrl("eval", "--json", "configs/tiny/flow_smoke.yaml", f"model.path={common[1].split('=', 1)[1]}", ck, "--seed", "10000")
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads(r.stdout.strip().splitlines()[-1])
    assert list(ev["results"]) == [f"base ({common[1].split('=', 1)[1]})", ck] and len(r.stdout.strip().splitlines()) == 1
    assert ev["results"][ck]["strict"] == res["eval_end"]["strict"] and ev["n"] == res["eval_end"]["n"]
    # --draws 2: the draws are the evaluations at seeds 10000 and 10001, and their mean
    r2 = mmrl("eval", "--json", "configs/tiny/flow_smoke.yaml", f"model.path={common[1].split('=', 1)[1]}", ck, "--draws", "2",
              "--no-base")
    table = mmrl("eval", "configs/tiny/flow_smoke.yaml", f"model.path={common[1].split('=', 1)[1]}", ck, "--draws", "2",
                 "--no-base")  # without --json: the table alone
    assert "overall per draw" in table.stdout and not table.stdout.lstrip().startswith("{")
    r3 = mmrl("eval", "--json", "configs/tiny/flow_smoke.yaml", f"model.path={common[1].split('=', 1)[1]}", ck, "--seed",
              "10001", "--no-base")
    assert r2.returncode == 0 and r3.returncode == 0, (r2.stderr + r3.stderr)[-3000:]
    two = json.loads(r2.stdout.strip().splitlines()[-1])["results"][ck]
    other = json.loads(r3.stdout.strip().splitlines()[-1])["results"][ck]["overall"]
    assert two["draws"]["overall"] == [res["eval_end"]["overall"], other] and len(r2.stdout.strip().splitlines()) == 1
    assert two["overall"] == pytest.approx((res["eval_end"]["overall"] + other) / 2, abs=1e-4)
    # the trainer's own evaluation with log.eval_draws=2 is the same two draws
    trained = json.load(open(tmp_path / "part" / "results.json"))["eval_end"]
    assert trained["draws"]["overall"] == two["draws"]["overall"] and trained["overall"] == two["overall"]


def test_cli_config_error_is_clear(tmp_path):
    r = mmrl("train", "configs/tiny/flow_smoke.yaml", "algo.advantage=nope")
    assert r.returncode == 2
    assert "algo.advantage: unknown advantage estimator 'nope'; valid: ['dr_grpo', 'grpo']" in r.stderr


def test_cli_overrides_may_follow_resume():
    """`--resume` before the overrides still reads them (here one with a bad value, so nothing runs)."""
    r = mmrl("train", "configs/tiny/flow_smoke.yaml", "--resume", "algo.advantage=nope")
    assert r.returncode == 2 and "unknown advantage estimator 'nope'" in r.stderr
    r = mmrl("train", "configs/tiny/flow_smoke.yaml", "--resume", "--no-such-flag")
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr


def test_vlm_smoke_train_and_resume_bit_identical(tiny_vl, tiny_world, tmp_path):
    """The token policy through the same CLI and loop: a tiny Qwen2.5-VL on the tiny grounding world."""
    common = ["configs/tiny/vlm_smoke.yaml", f"model.path={tiny_vl}", f"task.kwargs.root={tiny_world}",
              "task.kwargs.train_videos=6", "task.kwargs.test_videos=3"]
    stdout, full, a, b = full_and_resumed(common, tmp_path)
    res = json.loads(stdout.strip().splitlines()[-1])
    assert res["iterations"] == 3 and 0.0 <= res["eval_end"]["iou"] <= 1.0
    lines = [json.loads(ln) for ln in open(os.path.join(full, "metrics.jsonl"))]
    assert sum("reward/iou_mean" in ln for ln in lines) == 3
    for x, y in zip(a["params"], b["params"]):
        assert torch.equal(x, y)
    # mmrl eval: the base, the checkpoint (= the trainer's final eval) and the task's blind constant baseline
    ck = os.path.join(full, "checkpoints", "iter-000003")
    r = mmrl("eval", *common, ck, "--seed", "10000", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    ev = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    assert list(ev)[1:] == [ck, "constant answer"] and ev[ck]["iou"] == res["eval_end"]["iou"]
    assert 0 <= ev["constant answer"]["iou"] <= 1 and ev["constant answer"]["n"] == ev[ck]["n"]


def test_causal_lm_smoke_train(tmp_path, tiny_arithmetic_lm):
    """A text-only causal LM on the arithmetic task through the real CLI (the SmolLM2 recipe, tiny model)."""
    path = tiny_arithmetic_lm
    r = mmrl("train", "configs/text/smollm2_arithmetic.yaml", f"model.path={path}", "train.iterations=2",
             "train.prompts_per_iter=2", "train.group_size=3", "task.eval_prompts=4", "train.threads=1",
             "task.kwargs.hi=20", "log.progress=false", f"log.out_dir={tmp_path / 'run'}", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["iterations"] == 2 and 0.0 <= res["eval_end"]["correct"] <= 1.0


def test_user_errors_are_one_line_and_bugs_keep_their_traceback(tmp_path, capsys):
    """Issue 43: only mmrl's own input checks (mmrl.errors.UserError) print one line and exit 2; any other
    exception, here torch's ValueError from a deep call, keeps its traceback (status 1), even inside `validate`."""
    from mmrl.cli import main

    smoke = os.path.join(ROOT, "configs/tiny/flow_smoke.yaml")
    cases = [(["train", smoke, "train.lrr=1e-4"], "unknown config key 'train.lrr'"),
             (["train", smoke, "model.path=/no/such/model"], "model.path='/no/such/model' does not exist"),
             (["train", smoke, "reward.name=nope"], "reward.name: unknown reward 'nope'; valid: ["),
             (["train", smoke, "reward.name=no_such_module_here:score"],
              "reward 'no_such_module_here:score' could not be imported (ModuleNotFoundError"),
             (["export", str(tmp_path / "no_checkpoint"), str(tmp_path / "out")], str(tmp_path / "no_checkpoint"))]
    for argv, says in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (argv, err)
    with pytest.raises(ValueError, match="unknown config key 'train.lrr'"):  # --debug: the traceback, as before
        main(["train", smoke, "train.lrr=1e-4", "--debug"])
    # a bug: torch.cat([]) (torch raises ValueError) where preflight checks the process count; the real command
    bug = ("import sys, torch, mmrl.preflight as p\n"
           "p.check_parallel_config = lambda cfg, nproc: torch.cat([])\n"
           "from mmrl.cli import main\n"
           f"sys.exit(main(['validate', {smoke!r}]))\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", bug], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback (most recent call last)" in r.stderr and "mmrl/preflight.py" in r.stderr
    assert r.stderr.rstrip().endswith("ValueError: torch.cat(): expected a non-empty list of Tensors")
    assert "problem(s)" not in r.stderr and "mmrl validate: error" not in r.stderr
