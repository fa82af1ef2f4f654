"""`mmrl plan`: real-size architectures on the meta device, and its memory estimate against the peak measured on
CPU for the same micro-batch (the shapes world's SD3 transformer, a small Qwen2.5-VL)."""

import random

import pytest

from mmrl.compose import load_config
from mmrl.plan import plan
from mmrl.testing.memory import measure

# published sizes of the trained networks (diffusers transformers; Qwen2.5-VL-7B as a whole)
PUBLISHED = {"sd35-medium": ("configs/t2i/sd35_geneval_lora.yaml", 2.24e9),
             "flux1-dev": ("configs/t2i/flux_lora.yaml", 11.90e9),
             "wan21-14b": ("configs/t2v/wan_lora.yaml", 14.29e9),
             "qwen25-vl-7b": ("configs/grounding/charades_qwen25vl_lora.yaml", 8.29e9),
             # the model card's "20 B MMDiT"; its diffusers config instantiates 20.62 B
             "qwen-image": ("configs/t2i/qwen_image_nft_lora.yaml", 20.62e9)}


@pytest.mark.parametrize("arch", sorted(PUBLISHED))
def test_published_architectures_at_real_size(arch):
    config, params = PUBLISHED[arch]
    p = plan(load_config(config, ["model.lora.enabled=false", "train.micro_batch=1", "train.mixed_precision=bf16"]),
             arch)
    assert p["params"] == pytest.approx(params, rel=0.01)
    assert p["trainable_params"] == p["params"] and p["adamw_state_fp32_gib"] == pytest.approx(8 * params / 2**30, rel=0.01)
    lora = plan(load_config(config, ["train.micro_batch=1"]), arch)
    assert 0 < lora["trainable_params"] < 0.03 * lora["params"]
    assert lora["activations_per_micro_batch_checkpointed_gib"] < lora["activations_per_micro_batch_gib"]
    assert lora["tflop_per_iter_training"] > 0


def test_rows_follow_the_objective_and_the_sampler():
    """DiffusionNFT trains K noise levels per sample and pays K velocity forwards when sampling; MixGRPO-Flash's
    strided ODE samples with fewer calls than the chain for the same trained window."""
    nft = plan(load_config("configs/t2i/qwen_image_nft_lora.yaml", ["train.micro_batch=1"]), "qwen-image")
    rows = 8 * 16
    assert nft["rows_trained_per_iter"] == rows * 2 and nft["rows_sampled_per_iter"] == rows * (10 + 2)
    flash = plan(load_config("configs/t2i/sd35_mixgrpo_flash_lora.yaml", ["train.micro_batch=1"]), "sd35-medium")
    rows = 48 * 24 * 2  # CFG doubles every row
    assert flash["rows_trained_per_iter"] == rows * 4 and flash["rows_sampled_per_iter"] == rows * (4 + 7)


def test_missing_model_names_the_arch_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="--arch"):
        plan(load_config(None, [f"model.path={tmp_path}/none"]))


def test_flow_estimate_within_25_percent_of_measured(tmp_path):
    """Without gradient checkpointing. (With it, the resident-memory measurement also holds the checkpointed
    blocks' forward transients, which the CPU allocator keeps: it is not a measure of the allocated peak.)"""
    items = ["train.prompts_per_iter=8", "train.micro_batch=48", "train.minibatches=1", "task.eval_prompts=6",
             f"log.out_dir={tmp_path}", "log.tensorboard=false", "log.progress=false"]
    p = plan(load_config("configs/t2i/shapes_grpo.yaml", items))
    estimate = (p["activations_per_micro_batch_gib"] + p["gradients_fp32_gib"]) * 1024
    measured = measure("configs/t2i/shapes_grpo.yaml", items)["train_peak_mib"]
    assert abs(estimate - measured) <= 0.25 * measured, (estimate, measured)


def test_token_estimate_within_25_percent_of_measured(tmp_path, tiny_world):
    from conftest import build_tiny_vl
    from mmrl.trainer import Trainer

    path = str(tmp_path / "small")
    build_tiny_vl(path, size="small")
    items = [f"model.path={path}", f"task.kwargs.root={tiny_world}", "task.kwargs.train_videos=6",
             "task.kwargs.test_videos=3", "train.prompts_per_iter=4", "train.group_size=8", "sampler.max_new_tokens=16",
             "model.shared_prefix=false", "train.minibatches=1", f"log.out_dir={tmp_path}/run", "log.tensorboard=false",
             "log.progress=false"]
    cfg = load_config("configs/tiny/vlm_smoke.yaml", items)
    tr = Trainer(cfg)
    prompt = tr.policy.encode_prompt(tr.task.sample(1, random.Random(0))[0])["input_ids"].shape[1]
    p = plan(cfg, prompt_tokens=prompt)
    estimate = (p["activations_per_micro_batch_gib"] + p["gradients_fp32_gib"]) * 1024
    measured = measure("configs/tiny/vlm_smoke.yaml", items)["train_peak_mib"]
    assert abs(estimate - measured) <= 0.25 * measured, (estimate, measured)
