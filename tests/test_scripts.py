"""Entry-point scripts: --help works, quick modes run and end with one JSON line."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    """A script as a user runs it: the installed package, no PYTHONPATH, no sys.path edits in the script."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("script", ["scripts/bench_shapes.py", "scripts/pretrain_world.py", "scripts/bench_grounding.py",
                                    "scripts/sft_grounding.py", "benchmarks/bench_vlm_step.py", "benchmarks/bench_prefix.py",
                                    "scripts/export_smollm2.py", "benchmarks/bench_rollout.py", "scripts/bench_motion.py",
                                    "scripts/bench_pairwise.py", "benchmarks/bench_reward_server.py",
                                    "benchmarks/bench_memory.py", "scripts/gpu_check.py", "scripts/compare_flow_rl.py",
                                    "scripts/bench_text_length.py", "scripts/bench_judges.py",
                                    "scripts/bench_vlm_rewards.py", "scripts/geneval_agreement.py",
                                    "scripts/turn_rule_noise.py", "scripts/flux_nan_matrix.py",
                                    "benchmarks/bench_cfg_grad.py", "benchmarks/bench_compile.py",
                                    "scripts/architecture_counts.py"])
def test_help(script):
    r = run(script, "--help")
    assert r.returncode == 0 and "usage" in r.stdout
    assert "sys.path" not in open(os.path.join(ROOT, script)).read()


def test_bench_shapes_quick(tiny_pixel_model):
    r = run("scripts/bench_shapes.py", tiny_pixel_model, "--quick", "--steps", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    out = res["results"][tiny_pixel_model]
    assert res["n_prompts"] == 60 and out["n"] == 60 and set(out["per_category"]) == {
        "single_object", "two_object", "counting", "colors", "position", "color_attr"}


def test_pretrain_tiny_writes_loadable_model(tmp_path):
    out = str(tmp_path / "base")
    r = run("scripts/pretrain_world.py", "--size", "tiny", "--minutes", "0.05", "--batch", "8", "--eval-n", "6",
            "--out", out, "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    from mmrl.models.pipelines import load_flow_model

    model = load_flow_model(out)
    assert model.generate(["a red circle"], [0], num_steps=2).shape == (1, 3, 36, 36)  # the default world size
    assert os.path.isfile(out + ".train_state.pt")


def test_pretrain_motion_and_bench_motion(tmp_path):
    """The video world end to end in miniature: pretrain a tiny Wan clip model, benchmark it."""
    out = str(tmp_path / "motion")
    r = run("scripts/pretrain_world.py", "--world", "motion", "--size", "tiny", "--minutes", "0.03", "--batch", "4",
            "--eval-n", "4", "--out", out, "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run("scripts/bench_motion.py", out, "--quick", "--steps", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])["results"][out]
    assert res["n"] == 32 and set(res["per_category"]) == {"left", "right", "up", "down"} and 0 <= res["correct"] <= 1


def test_pretrain_init_widens_to_coordinates(tiny_motion_model, tmp_path):
    """--init from a video base without coordinate channels: the widened model computes what the base did."""
    import importlib.util

    import torch

    from mmrl.models.pixel_t2i import build_pipeline_parts, save_pipeline_parts
    from mmrl.models.pipelines import load_flow_model
    from tasks import motion

    spec = importlib.util.spec_from_file_location("pretrain_world", os.path.join(ROOT, "scripts/pretrain_world.py"))
    pretrain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain)
    words = ["only", "other", "words"]  # the tokenizer and text encoder must come from the init folder
    parts = build_pipeline_parts(words, "tiny", 16, patch_size=4, frames=motion.FRAMES, coordinates=True)
    pretrain.init_from(parts, tiny_motion_model)
    save_pipeline_parts(parts, str(tmp_path / "widened"))
    base, widened = load_flow_model(tiny_motion_model), load_flow_model(str(tmp_path / "widened"))
    assert widened.transformer.config.in_channels == 6 and base.transformer.config.in_channels == 3
    texts = ["a red circle moving left", "a blue square moving up"]
    torch.testing.assert_close(widened.generate(texts, [0, 1], 3, 1.0), base.generate(texts, [0, 1], 3, 1.0))
    with pytest.raises(ValueError, match="shape"):
        pretrain.init_from(build_pipeline_parts(words, "tiny", 16, patch_size=2, frames=motion.FRAMES), tiny_motion_model)


@pytest.mark.slow  # ~25 s of a benchmark's quick mode
def test_bench_rollout_quick():
    """Chain vs BranchGRPO variants on the shapes SD3 transformer: tree rollouts cost fewer transformer rows."""
    r = run("benchmarks/bench_rollout.py", "--quick", "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    assert set(res) == {"chain", "branch", "branch_pruned", "branch_mix", "chain_window", "mixgrpo_flash"}
    # 8 steps, splits 0-3: 1 + 2 + 4 + 8 + 16 * 4 = 79 rows per tree against 16 * 8 for the chain
    assert res["chain"]["sample_rows"] == 128 and res["branch"]["sample_rows"] == 79
    assert res["branch_pruned"]["train_rows"] < res["branch"]["train_rows"] < res["chain"]["train_rows"]
    # MixGRPO-Flash: the window chain's trained transitions with fewer sampling rows (8 steps, window 4, stride 3:
    # the 3 steps after the window in 1 call)
    flash, window = res["mixgrpo_flash"], res["chain_window"]
    assert flash["train_rows"] == window["train_rows"] and flash["sample_rows"] < window["sample_rows"] == 128


@pytest.mark.slow  # ~25 s of a benchmark's quick mode
def test_bench_prefix_quick():
    """Shared-prefix vs naive scoring on a small video prompt: both timed, log-probs and gradients equal."""
    r = run("benchmarks/bench_prefix.py", "--quick", "--frames", "8", "--side", "56", "--repeats", "1", "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["group"] == 4 and res["naive_s"] > 0 and res["shared_s"] > 0
    assert res["max_abs_logprob_diff"] < 1e-5 and res["max_abs_grad_diff"] < 1e-5


def test_bench_pairwise_quick(tiny_pixel_model):
    r = run("scripts/bench_pairwise.py", "--quick", "--model", tiny_pixel_model, "--prompts", "4", "--group", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["judge_pairs"] == 8 * 6 and {"near_tie", "other"} <= set(res)


def test_bench_reward_server_quick():
    """Loopback load on a real server process, then the killed server fails within its bound."""
    r = run("benchmarks/bench_reward_server.py", "--quick", "--clients", "2", "--batch", "4")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["load"]["requests"] > 0 and res["load"]["client_errors"] == 0
    assert res["load"]["server_requests"] == res["load"]["requests"]
    k = res["killed_server"]
    assert k["error"] and k["tries"] == 3 and k["seconds_to_error"] < k["bound_s"]


@pytest.mark.slow  # ~250 s: 20 recipes, each 3 iterations, 3 evaluations, 3 saves, a resume; every config still
def test_gpu_check_runs_every_gpu_config_on_cpu():  # loads and validates in test_config.py
    """The GPU acceptance script's runs (bf16, gradient checkpointing, micro-batches; 2 iterations, each saved and
    evaluated, then a resume that trains iteration 3) on CPU: every real recipe on its tiny stand-ins, with rewards
    that vary within groups, moves every trained module in 2 iterations (each Wan2.2 expert by name) with non-zero
    advantages; on a machine without CUDA the default (--device cuda) refuses with exit code 2."""
    r = run("scripts/gpu_check.py", "--device", "cpu", "--quick")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from gpu_check import GPU_CONFIGS
    finally:
        sys.path.pop(0)
    assert res["ok"] and sorted(res["configs"]) == sorted(GPU_CONFIGS) and len(GPU_CONFIGS) == 20
    assert all(c["unchanged_modules"] == [] and c["trained_modules"] > 0 and any(c["adv_abs_mean"])
               for c in res["configs"].values())
    wan22 = res["configs"]["t2v/wan22_a14b_lora"]
    assert wan22["experts"] == ["transformer", "transformer_2"]
    assert all(c["optimizer_steps"] == 2 and c["params_dtypes"] == ["torch.float32"] for c in res["configs"].values())
    assert all(c["resumed_at_iteration"] == c["iterations"] == 3 and c["eval"]["n"] > 0 and
               c["checkpoints"] == ["iter-000002", "iter-000003"] for c in res["configs"].values())
    if not res["cuda_available"]:
        assert run("scripts/gpu_check.py", "--quick").returncode == 2


def test_bench_grounding_reports_the_ood_splits_side_by_side(tiny_vl, tmp_path):
    from tasks.grounding_world import OOD_VIDEOS, build_world

    world = str(tmp_path / "ood")
    build_world(world, {**OOD_VIDEOS, "train": 8, "test": 4, "long": 3, "novel": 3, "crowded": 4}, ood=True)
    r = run("scripts/bench_grounding.py", tiny_vl, "--world", world, "--ood", "--max-new-tokens", "8", "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert list(res["results"]) == ["id", "long", "novel", "crowded"]
    assert res["n_queries"]["crowded"] == 4 and res["n_queries"]["long"] >= 6
    for split in res["results"].values():
        assert set(split) == {"constant_baseline", tiny_vl} and 0 <= split[tiny_vl]["mIoU"] <= 1


@pytest.mark.slow
@pytest.mark.parametrize("world", ["shapes", "motion"])
def test_compare_flow_rl_quick(tmp_path, world):
    """Two methods and the control trained side by side for a minute each, evaluated halfway and at the end (about 2
    minutes per world)."""
    r = run("scripts/compare_flow_rl.py", "--quick", "--world", world, "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(res["methods"]) == {"grpo", "nft"} and res["eval_prompts"] == 24
    assert res["world"] == world and res["metric"] == {"shapes": "strict", "motion": "correct"}[world]
    assert res["control"]["per_seed"][0]["iterations"] > 0 and 0 <= res["control"]["full"] <= 1
    for m in res["methods"].values():
        run_ = m["per_seed"][0]
        assert run_["iterations"] > 0 and run_["half"] is not None and 0.4 < run_["half_at"] / 0.5 < 2
        assert m["gain_full"] == pytest.approx(m["full"] - res["base"])


def test_compare_flow_rl_matched_on_iterations(tmp_path):
    """--iterations: each method runs exactly that many iterations, evaluated on the fixed grid; the machine's load
    and each run's wall minutes are recorded (about a minute)."""
    r = run("scripts/compare_flow_rl.py", "--quick", "--methods", "nft", "--iterations", "2", "--eval-every-it", "1",
            "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    nft = res["methods"]["nft"]["per_seed"][0]
    assert res["iterations"] == 2 and nft["iterations"] == 2
    assert [it for it, _ in nft["curve"]] == [1, 2] and nft["full"] == nft["curve"][-1][1]
    assert nft["peak"] == max(a for _, a in nft["curve"]) and nft["wall_min"] > 0
    assert res["load"]["0"]["load_samples"] >= 1


def test_bench_text_length_quick():
    r = run("scripts/bench_text_length.py", "--quick")
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got["seconds"]) == {"256", "128"} and got["speedup"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("script", ["scripts/bench_judges.py", "scripts/bench_vlm_rewards.py",
                                    "scripts/geneval_agreement.py"])
def test_reward_benchmarks_quick(script):
    r = run(script, "--quick")
    assert r.returncode == 0, r.stderr[-2000:]
    assert isinstance(json.loads(r.stdout.strip().splitlines()[-1]), dict)


def test_turn_rule_noise_by_hand():
    import importlib.util

    spec = importlib.util.spec_from_file_location("turn_rule_noise", os.path.join(ROOT, "scripts/turn_rule_noise.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # two evaluations: the other minus the last is N(0, 2 sigma^2), so P = 1 - Phi(3 / (2 sqrt 2)) = 1 - Phi(1.0607)
    assert mod.p_fail(2, 3.0, 2.0) == pytest.approx(0.14443, abs=1e-4)
    assert mod.p_fail(3, 0.0, 1.0) == pytest.approx(2 / 3, abs=1e-6)  # margin 0: fails unless the last is the max
    assert mod.p_fail(1, 3.0, 2.0) == 0.0
    # groups (1, 3) and (2, 4, 6): squares about the means 2 + 8 over 1 + 2 degrees of freedom
    assert mod.pooled_sd([[1, 3], [2, 4, 6]]) == pytest.approx((10 / 3) ** 0.5)
    r = run("scripts/turn_rule_noise.py", "--scores", "1,3;2,4,6", "--plateau", "2", "--draws", "1", "4")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and out["sigma"] == pytest.approx((10 / 3) ** 0.5, abs=1e-4)
    assert [row["draws"] for row in out["rows"]] == [1, 4] and out["rows"][1]["p_seed"] < out["rows"][0]["p_seed"]


def test_architecture_counts_names_where_each_check_sits():
    """scripts/architecture_counts.py: no policy-kind name is compared outside mmrl/policy (the one hit is a
    transformers model_type, not a kind), and each counted line is named."""
    r = run("scripts/architecture_counts.py")
    assert r.returncode == 0, r.stderr[-2000:]
    c = json.loads(r.stdout.strip().splitlines()[-1])
    assert c["where_kind"] == [x for x in c["where_kind"] if x.startswith("mmrl/plan_models.py")]
    assert c["parallel_checks"] == len(c["where_parallel"]) and "parallel" in c["top_level"]
