"""Context (sequence) parallelism through diffusers' own API (mmrl/parallel/context_parallel.py), gloo on CPU: a tiny Wan2.1 and
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
    from mmrl.parallel.context_parallel import add_sequence_check, check_backend, check_cp, sequence_length

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


# wan21 at cp 2 also runs inside the dp2 x cp2 test below, so only its own 2-process run is kept out of the default set
@pytest.mark.parametrize("model", [pytest.param("wan21", marks=pytest.mark.slow), "wan22"])
def test_cp2_matches_one_process(model, tmp_path):
    check_report(run_worker(tmp_path / "cp.json", "--model", model, "--cp", "2"), world=2, dp=1)


def test_dp2_x_cp2_matches_one_process(tmp_path):
    """4 processes: dp rows 0 and 1, each split over 2 cp ranks; gradients summed over cp, averaged over dp."""
    check_report(run_worker(tmp_path / "dpcp.json", "--cp", "2", procs=4), world=4, dp=2)


@pytest.mark.slow  # ~15 s
def test_ring_attention_does_not_run_on_cpu_in_diffusers(tmp_path):
    """The finding behind check_backend: diffusers' ring calls the forward op for the log-sum-exp, which its native
    (SDPA) backend, the only cp backend on CPU, refuses."""
    got = run_worker(tmp_path / "ring.json", "--kind", "ring", "--unguarded")
    assert got["error"] == "ValueError: Native attention does not support return_lse=True"


# ------------------------------------------------------------------------------------- through the trainer
MATRIX = os.path.join(ROOT, "tests/workers/dist_matrix.py")
# 226 UMT5 tokens (not the pipeline's 512, most of them zero padding): measured at 512, the plain DDP cp2 run ends
# 1.5e-5 from one process after 2 iterations, at 226 6e-8; likely AdamW turning the cp split's rounding of the
# near-zero gradients of parameters that only see padding into lr-sized steps. What this test checks, the cp split
# of the video tokens, is the same at either length.
WAN_TASK = ["task.name=motion", "reward.name=temporal_consistency", "model.sample_size=4", "model.num_frames=5",
            "sampler.shift=3.0", "task.eval_prompts=5", "model.text_max_length=226"]


@pytest.fixture(scope="module")
def wan_folders(tmp_path_factory):
    from mmrl.models.tiny_pipelines import build_tiny

    root = tmp_path_factory.mktemp("cp_wan")
    build_tiny("wan").save_pretrained(str(root / "wan21"))
    build_tiny("wan", two_experts=True).save_pretrained(str(root / "wan22"))
    return root


def train(model, out, parallel, features, procs, *extra):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
        if procs > 1 else [sys.executable]
    flags = [x for x in extra if x.startswith("--")]
    r = subprocess.run([*launch, MATRIX, str(model), str(out), "--parallel", parallel, "--features", features, *flags,
                        "--set", *WAN_TASK, *[x for x in extra if x not in flags]], cwd=ROOT, env={**ENV, "ACCELERATE_USE_CPU": "true"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def max_diff(a, b) -> float:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


@pytest.mark.slow  # ~2 minutes; the cp collectives and one step are checked by the faster cp2 / dp2 x cp2 tests
def test_the_trainer_with_context_parallelism_ends_where_one_process_ends(wan_folders, tmp_path):
    """train.context_parallel=2 on a tiny Wan2.1 (full fine-tuning, micro-batches, LoRA, KL to a frozen copy,
    BranchGRPO trees) and Wan2.2 A14B's two experts: 2 iterations under DDP and FSDP2 on 2 processes (one cp group)
    and under DDP on 4 (dp 2 x cp 2) end with the single-process parameters; the sharded evaluation gives the
    single-process figures. Tolerance 2e-6 in fp32: attention over token chunks and the cp sum of partial
    gradients round differently (measured up to 1.0e-6)."""
    features = "plain,micro,lora,kl_base,tree"
    train(wan_folders / "wan21", tmp_path / "one", "none", features, 1, "--eval")
    for mode in ("ddp", "fsdp"):
        train(wan_folders / "wan21", tmp_path / mode, mode, features, 2, "--eval", "train.context_parallel=2")
    train(wan_folders / "wan21", tmp_path / "dp2cp2", "ddp", "plain,micro", 4, "train.context_parallel=2")
    diffs = {}
    for run, feats in (("ddp", features), ("fsdp", features), ("dp2cp2", "plain,micro")):
        for f in feats.split(","):
            diffs[f"{run}/{f}"] = max_diff(tmp_path / "one" / f"{f}.safetensors", tmp_path / run / f"{f}.safetensors")
    one, two = (json.load(open(tmp_path / m / "plain.json")) for m in ("one", "fsdp"))
    assert two["eval/n"] == one["eval/n"] == 5 and two["eval/overall"] == pytest.approx(one["eval/overall"], abs=1e-4)
    assert two["reward/overall_mean"] == pytest.approx(one["reward/overall_mean"])
    train(wan_folders / "wan22", tmp_path / "one22", "none", "plain,kl_base", 1)
    train(wan_folders / "wan22", tmp_path / "ddp22", "ddp", "plain,kl_base", 2, "train.context_parallel=2")
    for f in ("plain", "kl_base"):
        diffs[f"wan22-ddp/{f}"] = max_diff(tmp_path / "one22" / f"{f}.safetensors", tmp_path / "ddp22" / f"{f}.safetensors")
    print(json.dumps(diffs))
    assert all(d < 2e-6 for d in diffs.values()), diffs


def test_context_parallel_configs_are_refused_before_loading(wan_folders, tmp_path):
    from mmrl.compose import load_config
    from mmrl.parallel.distributed import check_parallel_config

    def cfg(*over, path=wan_folders / "wan21"):
        return load_config(None, [f"model.path={path}", "train.parallel=ddp", *WAN_TASK, *over])

    check_parallel_config(cfg("train.context_parallel=2", "train.prompts_per_iter=2"), 4)
    with pytest.raises(ValueError, match="launch a multiple of 2"):
        check_parallel_config(cfg("train.context_parallel=2"), 1)
    with pytest.raises(ValueError, match="2 attention heads over cp_degree 4"):
        check_parallel_config(cfg("train.context_parallel=4"), 4)
    with pytest.raises(ValueError, match="video tokens do not split into 2"):  # 1 latent frame x 3 x 3 patches
        check_parallel_config(cfg("train.context_parallel=2", "model.sample_size=6", "model.num_frames=1"), 2)
    with pytest.raises(ValueError, match="prompts_per_iter=1 groups for 2 data-parallel ranks"):
        check_parallel_config(cfg("train.context_parallel=2", "train.prompts_per_iter=1", "train.group_size=4"), 4)
    with pytest.raises(ValueError, match="needs a diffusers pipeline folder with transformer/config.json"):
        check_parallel_config(cfg("train.context_parallel=2", path=tmp_path), 2)
    with pytest.raises(ValueError, match=r"denoising steps \(model.policy=flow\): set train.context_parallel=1"):
        load_config(None, ["model.policy=token", "train.context_parallel=2"])
