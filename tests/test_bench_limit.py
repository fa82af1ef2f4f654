"""benchmarks/bench_limit.py: --help works; its quick mode ends with one JSON line whose model calls are the real
loop's (counted by hooks: sampling, old log-prob and training calls of each policy), each replayed, with a positive
finite ratio of the iteration to its model calls."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "benchmarks/bench_limit.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_help():
    r = run("--help")
    assert r.returncode == 0 and "usage" in r.stdout
    assert "sys.path" not in open(os.path.join(ROOT, "benchmarks/bench_limit.py")).read()


def check(res: dict) -> None:
    """Each figure is the smallest over the timed iterations: a sum of parts is at most the smallest whole (equal to
    it with one timed iteration), up to the clock's reading of each part on a loaded machine (2% + 50 ms)."""
    assert math.isfinite(res["ratio"]) and res["ratio"] > 0 and res["model_s"] > 0
    assert sum(res["phase_wall_s"].values()) <= 1.02 * res["iteration_s"] + 0.05
    assert sum(res["model_by_kind_s"].values()) <= 1.02 * res["model_s"] + 0.05
    assert sum(res["model_by_phase_s"].values()) <= 1.02 * res["model_s"] + 0.05


def test_quick_token():
    """1 prompt x 4 completions of 16 tokens, 2 minibatches: sampling is the prompt's prefill and 15 decode steps,
    then the old log-probs (prefill + completion, no grad: two minibatches, one optimizer step each); training is a
    prefill and a completion call per minibatch, both backpropagated."""
    r = run("--quick", "--policy", "token", "--iterations", "1", "--replays", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])["token"]
    check(res)
    assert res["iteration_s"] == pytest.approx(sum(res["phase_wall_s"].values()), rel=0.02, abs=0.05)
    assert res["calls"] == {"lm/rollout/no_grad": 18, "lm/train/grad+backward": 4}
    assert set(res["model_by_kind_s"]) == {"sampling_forward", "train_forward", "train_backward"}


@pytest.mark.slow  # ~1 minute: both policies' quick mode
def test_quick_both():
    """Flow: CFG 4.5 with cfg_grad=cond, 4 steps (one batched [uncond | cond] call each), an SDE window of 3 of which
    the 2 above the last step train in 2 minibatches: per minibatch one unconditional forward without grad and one
    conditional forward with a backward; the prompts encoded once."""
    r = run("--quick")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for kind in ("flow", "token"):
        check(out[kind])
    assert out["flow"]["calls"] == {"text_encoder_0/rollout/no_grad": 1, "transformer/rollout/no_grad": 4,
                                    "transformer/train/no_grad": 2, "transformer/train/grad+backward": 2}
