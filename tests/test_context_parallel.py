"""Context (sequence) parallelism through diffusers' own API (mmrl/context_parallel.py), gloo on CPU: a tiny Wan2.1 and
a tiny Wan2.2 TI2V transformer split over cp = 2 processes sample the same chain, compute the same log-probs and,
gradients summed over the cp group, the same gradients as one process; a dp = 2 x cp = 2 mesh matches too. The
numbers are printed (pytest -s)."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests/workers/cp_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def run_worker(out, *args, procs: int = 2) -> list[dict] | dict:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    r = subprocess.run([*launch, WORKER, str(out), *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.load(open(out))


def tiny_wan():
    sys.path.insert(0, os.path.join(ROOT, "tests/workers"))
    from cp_worker import build

    return build("wan21")  # 2 heads x 12, patch (1, 2, 2)


def test_checks_refuse_layouts_diffusers_cannot_run():
    from mmrl.context_parallel import add_sequence_check, check_backend, check_cp, sequence_length

    check_cp(2, 4, num_heads=24, seq_len=27280)  # Wan2.2 5B, 121 frames at 704 x 1280: 31 x 22 x 40 tokens
    with pytest.raises(ValueError, match="must divide the world size 4"):
        check_cp(3, 4)
    with pytest.raises(ValueError, match="2 attention heads over cp_degree 4"):
        check_cp(4, 4, num_heads=2)
    check_cp(4, 4, num_heads=2, kind="ring")  # ring does not split heads
    with pytest.raises(ValueError, match="27280 video tokens do not split into 3"):
        check_cp(3, 6, num_heads=24, seq_len=27280)
    with pytest.raises(ValueError, match="valid: ulysses, ring"):
        check_cp(2, 2, kind="usp")

    transformer = tiny_wan()
    assert sequence_length(transformer, (1, 16, 4, 8, 8)) == 4 * 4 * 4
    with pytest.raises(ValueError, match="'native' attention backend does not return"):
        check_backend(transformer, "ring")  # SDPA: the only cp backend on CPU has no log-sum-exp
    check_backend(transformer, "ulysses")
    add_sequence_check(transformer, 2)
    with pytest.raises(ValueError, match="9 video tokens do not split into 2"):
        transformer(hidden_states=torch.randn(1, 16, 1, 6, 6), timestep=torch.ones(1),
                    encoder_hidden_states=torch.randn(1, 6, 32))


def check_report(reports: list[dict], world: int, dp: int):
    assert len(reports) == world and all(r["world"] == world and r["dp"] == dp for r in reports)
    for r in reports:
        d = r["max_abs_diff"]
        # the same bits up to the rounding of another batch size (dp splits rows) and of the cp sum of gradients
        assert max(d["velocity"], d["latents"]) < 1e-5, d
        assert max(d["sample_log_prob"], d["train_log_prob"]) < 1e-6, d
        assert d["grads"] < 1e-4 * d["grad_scale"], d  # ~1e-9 against gradients of ~3e-3
        # the blocks' activations are split: well under the one-process bytes (fixed parts: text K/V, timestep
        # embeddings, the input convolution, the gathered output)
        assert r["saved_bytes_transformer_cp"] < 0.7 * r["saved_bytes_transformer_one_process"], r
    print(json.dumps(reports[0]))


@pytest.mark.parametrize("model", ["wan21", "wan22"])
def test_cp2_matches_one_process(model, tmp_path):
    check_report(run_worker(tmp_path / "cp.json", "--model", model, "--cp", "2"), world=2, dp=1)


def test_dp2_x_cp2_matches_one_process(tmp_path):
    """4 processes: dp rows 0 and 1, each split over 2 cp ranks; gradients summed over cp, averaged over dp."""
    check_report(run_worker(tmp_path / "dpcp.json", "--cp", "2", procs=4), world=4, dp=2)


def test_ring_attention_does_not_run_on_cpu_in_diffusers(tmp_path):
    """The finding behind check_backend: diffusers' ring calls the forward op for the log-sum-exp, which its native
    (SDPA) backend, the only cp backend on CPU, refuses."""
    got = run_worker(tmp_path / "ring.json", "--kind", "ring", "--unguarded")
    assert got["error"] == "ValueError: Native attention does not support return_lse=True"
