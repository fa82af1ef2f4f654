"""Real timing on 2 processes (torchrun, gloo): a rank that starts late, a SIGTERM in the middle of an iteration,
a worker that dies under torchrun --max-restarts. Every run goes through `mmrl train` as a user launches it."""

import glob
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs/tiny/flow_smoke.yaml")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true",
       "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests/workers")])}


def mmrl_train(out, model, *overrides, procs=2, env=(), launcher=(), resume=False, timeout=600):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", *launcher]
    cmd = [*launch, "-m", "mmrl.cli", "train", CONFIG, f"model.path={model}", f"log.out_dir={out}",
           "log.tensorboard=false", "log.eval_at_start=false", "train.parallel=ddp", "train.threads=1",
           "train.prompts_per_iter=2", *overrides, *(["--resume"] if resume else [])]
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **dict(env)}, capture_output=True, text=True, timeout=timeout)


def policy_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(checkpoint, "policy", "**", "*.safetensors"), recursive=True))
    assert files, f"no policy weights in {checkpoint}"
    return {f"{os.path.relpath(f, checkpoint)}:{k}": v for f in files for k, v in load_file(f).items()}


def assert_identical(a: str, b: str) -> None:
    x, y = policy_weights(a), policy_weights(b)
    assert x.keys() == y.keys()
    diff = max((x[k] - y[k]).abs().max().item() for k in x)
    assert diff == 0.0, f"{a} and {b} differ by {diff}"


def test_a_rank_that_starts_late_ends_with_the_others(tiny_pixel_model, tmp_path):
    """Rank 1's reward model takes 8 s longer to load, so rank 0 reaches the loop 8 s earlier. A time budget, timed
    evaluations and a time-based lr cooldown are decided from rank 0's clock for both ranks (Distributed.decide):
    the run ends by itself (before: rank 0 stopped and evaluated while rank 1 trained on, a hang; or the ranks'
    learning rates differed and the first save found their weights apart), both ranks at one iteration, the
    weights in sync at every save (checked by the save) and the same lr on both."""
    r = mmrl_train(tmp_path / "run", tiny_pixel_model, "reward.name=timing_rewards:Late", "train.iterations=1000",
                   "train.time_budget_min=0.25", "log.eval_every_min=0.1", "train.lr_cooldown=0.5", "log.save_every=4",
                   env={"MMRL_TEST_LATE_S": "8"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.load(open(tmp_path / "run/results.json"))
    assert 1 <= res["iterations"] < 1000 and res["eval_timed"], res
    assert "time_budget_min=0.25 reached" in r.stderr
    lines = [json.loads(x) for x in open(tmp_path / "run/metrics.jsonl")]
    lrs = [x["train/lr"] for x in lines if "train/lr" in x]
    assert lrs[-1] < lrs[0]  # the cooldown ran


@pytest.fixture(scope="module")
def uninterrupted(tiny_pixel_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    r = mmrl_train(out, tiny_pixel_model, "reward.name=timing_rewards:Preempt", "train.iterations=3",
                   "log.save_every=100", env={"MMRL_TEST_SIGNAL_AT": "-1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_sigterm_saves_and_resume_continues_bit_identical(tiny_pixel_model, uninterrupted, tmp_path):
    """SIGTERM reaches torchrun (which forwards it to both workers) in the middle of iteration 2 of 3: the ranks
    finish that iteration, save it, and exit with 143 and a line saying how to continue; --resume then ends
    bit-identical to the run that was never interrupted."""
    out = tmp_path / "run"
    args = (out, tiny_pixel_model, "reward.name=timing_rewards:Preempt", "train.iterations=3", "log.save_every=100")
    r = mmrl_train(*args, env={"MMRL_TEST_SIGNAL_AT": "1"})
    assert r.returncode != 0
    assert "SIGTERM received" in r.stderr and "stopped by SIGTERM after iteration 2" in r.stderr, r.stderr[-3000:]
    assert "--resume" in r.stderr
    assert sorted(os.listdir(out / "checkpoints")) == ["iter-000002"]
    r = mmrl_train(*args, env={"MMRL_TEST_SIGNAL_AT": "-1"}, resume=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert_identical(uninterrupted / "checkpoints/iter-000003", out / "checkpoints/iter-000003")


@pytest.mark.slow  # ~60 s: two torchrun starts
def test_a_torchrun_restart_resumes_by_itself(tiny_pixel_model, uninterrupted, tmp_path):
    """Rank 1 dies in iteration 2 on the first start; torchrun --max-restarts 1 starts both workers again with the
    same command line (no --resume): the run continues from its newest checkpoint and ends bit-identical."""
    out = tmp_path / "run"
    r = mmrl_train(out, tiny_pixel_model, "reward.name=timing_rewards:Crash", "train.iterations=3", "log.save_every=1",
                   env={"MMRL_TEST_CRASH_AT": "1"}, launcher=["--max-restarts", "1"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "a worker dies (test)" in r.stderr and "torchrun restart 1: resuming" in r.stderr
    assert "resumed from" in r.stderr and "iter-000001" in r.stderr
    assert_identical(uninterrupted / "checkpoints/iter-000003", out / "checkpoints/iter-000003")


def test_a_second_signal_exits_at_once(tmp_path):
    """The first SIGINT only raises the flag the trainer reads at the next iteration boundary; a second one ends
    the process at once with 128 + its number."""
    code = ("import os, signal, time\n"
            "from mmrl.preemption import StopRequests\n"
            "with StopRequests() as s:\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(0.2)\n"
            "    print('flag', s.signum, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(5)\n"
            "    print('not reached', flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == f"flag {int(signal.SIGINT)}"
    assert r.returncode == 128 + signal.SIGINT and "second SIGINT" in r.stderr
