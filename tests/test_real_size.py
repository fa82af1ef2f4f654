"""`scripts/gpu_check.py --real-size` (mmrl/testing/real_size.py): its CPU dry run on one recipe gives every column
finite, its real-size models (built on the meta device here) are the published architectures, and the script's
--help still parses."""

import math
import os
import subprocess
import sys

import pytest
import torch

from mmrl.testing import real_size as rs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_cpu_dry_run_gives_every_column(tmp_path):
    """SD3.5-M's recipe at reduced size, 2 iterations, save and resume (~10 s): every phase has its peak, the plan's
    figure and its seconds; seconds per iteration, non-finite steps and both MFUs are there and finite."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = rs.run(["t2i/sd35_geneval_lora"], "cpu", "reduced", plan_workers=0, tmp=str(tmp_path))
    finally:
        torch.set_num_threads(threads)
    res = report["recipes"]["t2i/sd35_geneval_lora"]
    assert report["ok"], res.get("traceback")
    assert set(res["phases"]) == set(rs.PHASES)
    for phase, row in res["phases"].items():
        assert all(_finite(row[k]) for k in ("peak_mib", "plan_mib", "seconds")), (phase, row)
        assert row["seconds"] > 0 and row["peak_mib"] >= 0 and row["plan_mib"] > 0, (phase, row)
    assert len(res["iteration_s"]) == 2 and all(_finite(s) and s > 0 for s in res["iteration_s"])
    assert res["nonfinite_steps"] == 0 and res["optimizer_steps"] > 0 and res["resumed_at_iteration"] == 2
    assert _finite(res["mfu_sampling"]) and _finite(res["mfu_training"]) and res["mfu_training"] > 0
    assert res["plan_error"] is None
    text = rs.table(report["recipes"], report["peak_flops_note"])
    for column in ("peak MiB", "plan MiB", "seconds", "non-finite", "MFU", "s / iter", "nominal"):
        assert column in text


@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.slow) if c.startswith("t2i/sd35") else c
                                    for c in rs.RECIPES])
def test_real_size_models_are_the_published_architectures(config, tmp_path):
    """The models the GPU run builds, here on the meta device and written as the run's stub folder: `mmrl plan` of
    that folder counts the published architecture's parameters (--arch), the text encoders at their real width."""
    from mmrl.compose import load_config
    from mmrl.plan import plan

    recipe = rs.RECIPES[config]
    stub = str(tmp_path / "model")
    if config.startswith("grounding/"):
        model, processor = rs.build_token_model(recipe, "real", torch.bfloat16, "meta", 100352)
        rs.write_stub(stub, config=model.config)
        assert processor.video_processor.size["longest_edge"] == 100352  # frames keep the recipe's pixels
    else:
        pipe = rs.build_pipeline(recipe, "real", torch.bfloat16, "meta")
        rs.write_stub(stub, pipe=pipe)
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            enc = getattr(pipe, name, None)
            if enc is not None:
                layers = getattr(enc.config, "num_hidden_layers", None) or enc.config.num_layers
                assert layers == rs.TEXT_LAYERS and enc.device.type == "meta"
    over = rs.overrides(config, recipe, "real", "cpu", stub, str(tmp_path / "run"), [])
    path = os.path.join(ROOT, "configs", config + ".yaml")
    ours = plan(load_config(path, over), None, world=1, measured=False, device="cpu")
    published = plan(load_config(path, over), recipe.arch, world=1, measured=False, device="cpu")
    assert ours["params"] == published["params"] and ours["class"] == published["class"]
    assert ours["tflop_per_iter_training"] == pytest.approx(published["tflop_per_iter_training"], rel=1e-6)
    if not config.startswith("grounding/"):
        assert 0 < ours["text_encoder_params"] < published["text_encoder_params"]


def test_gpu_check_help_names_real_size():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--help"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "--real-size" in out.stdout and "--scale" in out.stdout


def test_stand_in_reward_varies_within_a_group():
    reward = rs.StandInReward()
    images = reward(torch.randn(4, 3, 8, 8).clamp(-1, 1), [{}] * 4)["overall"]
    texts = reward(["a", "b", "c", "d"], [{}] * 4)["overall"]
    assert images.std() > 0 and texts.std() > 0 and texts.min() >= 0 and texts.max() < 1
