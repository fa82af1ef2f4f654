"""`mmrl plan`: real-size architectures on the meta device, the per-GPU split over --world and --cp by hand, and
its memory estimates against the peaks measured on CPU (the shapes world's SD3 transformer, the motion world's Wan
transformer, a small Qwen2.5-VL; a VAE decode)."""

import json
import random
import subprocess
import sys

import pytest

from mmrl.compose import load_config
from mmrl.plan import plan
from mmrl.plan_rows import rank_share
from mmrl.testing.memory import measure

# published sizes of the trained networks (diffusers transformers; Qwen2.5-VL-7B as a whole)
PUBLISHED = {"sd35-medium": ("configs/t2i/sd35_geneval_lora.yaml", 2.24e9),
             "flux1-dev": ("configs/t2i/flux_lora.yaml", 11.90e9),
             "wan21-14b": ("configs/t2v/wan_lora.yaml", 14.29e9),
             "wan22-a14b": ("configs/t2v/wan22_a14b_lora.yaml", 2 * 14.29e9),  # two experts held in memory
             "qwen25-vl-7b": ("configs/grounding/charades_qwen25vl_lora.yaml", 8.29e9),
             # the model card's "20 B MMDiT"; its diffusers config instantiates 20.43 B
             "qwen-image": ("configs/t2i/qwen_image_nft_lora.yaml", 20.43e9),
             "z-image-turbo": ("configs/t2i/z_image_awm_lora.yaml", 6.19e9)}  # the model card's "6 B"


def test_every_family_architecture_is_planned_here():
    """A family's published architectures appear in `mmrl plan --arch` (and this file checks the built-in ones)."""
    from mmrl.models.families import all_architectures

    builtin = {"sd35-medium", "flux1-dev", "wan21-14b", "wan22-a14b", "qwen25-vl-7b", "qwen-image", "z-image-turbo"}
    assert builtin <= set(all_architectures()) and builtin <= set(PUBLISHED)


@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a == "qwen-image" else a
                                  for a in sorted(PUBLISHED)])  # qwen-image: ~20 s
def test_published_architectures_at_real_size(arch):
    config, params = PUBLISHED[arch]
    p = plan(load_config(config, ["model.lora.enabled=false", "train.micro_batch=1", "train.mixed_precision=bf16"]),
             arch)
    assert p["params"] == pytest.approx(params, rel=0.01)
    assert p["trainable_params"] == p["params"] and p["adamw_state_fp32_gib"] == pytest.approx(8 * params / 2**30, rel=0.01)
    lora = plan(load_config(config, ["train.micro_batch=1", "model.lora.enabled=true"]), arch)
    assert 0 < lora["trainable_params"] < 0.03 * lora["params"]
    assert lora["activations_per_micro_batch_checkpointed_gib"] < lora["activations_per_micro_batch_gib"]
    assert lora["tflop_per_iter_training"] > 0


def test_rows_follow_the_objective_and_the_sampler():
    """DiffusionNFT trains K noise levels per sample and pays K velocity forwards when sampling; MixGRPO-Flash's
    strided ODE samples with fewer calls than the chain for the same trained window."""
    nft = plan(load_config("configs/t2i/qwen_image_nft_lora.yaml", ["train.micro_batch=1"]), "qwen-image")
    rows = 32 * 16  # CFG-free: one row per sample
    assert nft["rows_trained_per_iter"] == rows * 9 and nft["rows_sampled_per_iter"] == rows * (10 + 9)
    flash = plan(load_config("configs/t2i/sd35_mixgrpo_flash_lora.yaml", ["train.micro_batch=1"]), "sd35-medium")
    rows = 32 * 12 * 2  # CFG doubles every row; cfg_grad=cond trains the conditional half, the other runs without grad
    assert flash["rows_trained_per_iter"] == rows // 2 * 4 == flash["rows_forward_only_per_iter"]
    assert flash["rows_sampled_per_iter"] == rows * (4 + 7) and flash["micro_batch_rows"] == 1


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


def test_rank_share_by_hand():
    """4 rows, 2 of them the rank's, a minibatch of 2: P(X = 0, 1, 2) = 1/6, 4/6, 1/6."""
    assert rank_share(4, 2, 2, p=0.1) == (1.0, 2, 2)   # P(X > 1) = 1/6 >= 0.1
    assert rank_share(4, 2, 2, p=0.2) == (1.0, 1, 2)   # P(X > 1) = 1/6 < 0.2
    assert rank_share(64, 64, 16) == (16.0, 16, 16)    # one process: the whole minibatch


def test_world_and_cp_split_by_hand():
    """The motion world (a pixel Wan transformer, B = 16, G = 8): FSDP shards the trained state over world x cp,
    DDP replicates it; cp divides the activations; a rank samples ceil(B / world) whole groups."""
    items = ["train.micro_batch=4"]
    one = plan(load_config("configs/t2v/motion_grpo.yaml", items))
    fsdp = plan(load_config("configs/t2v/motion_grpo.yaml", items + ["train.parallel=fsdp"]), world=3, cp=2)
    ddp = plan(load_config("configs/t2v/motion_grpo.yaml", items + ["train.parallel=ddp"]), world=3, cp=2)
    for k in ("weights_frozen_gib", "weights_trained_fp32_gib", "gradients_fp32_gib", "adamw_state_fp32_gib"):
        assert fsdp[k] == pytest.approx(one[k] / 6) and ddp[k] == pytest.approx(one[k])
    assert fsdp["activations_per_micro_batch_gib"] == pytest.approx(one["activations_per_micro_batch_gib"] / 2)
    assert fsdp["fsdp_gathered_blocks_gib"] > 0 == ddp["fsdp_gathered_blocks_gib"]
    assert fsdp["rows_per_rank"] == 6 * 8 and fsdp["groups_per_rank"] == 6 and one["rows_per_rank"] == 128
    assert fsdp["rollout_storage_gib"] == pytest.approx(one["rollout_storage_gib"] * 48 / 128)
    assert fsdp["rows_sampled_per_rank_per_iter"] == round(one["rows_sampled_per_iter"] * 48 / 128)
    assert fsdp["total_gib"] == max(fsdp["peak_sampling_gib"], fsdp["peak_training_gib"])


def test_layouts_the_run_refuses():
    cfg = load_config("configs/t2v/motion_grpo.yaml")
    with pytest.raises(ValueError, match="train.parallel=ddp"):
        plan(cfg, world=2)
    with pytest.raises(ValueError, match="prompts_per_iter >= 32"):
        plan(load_config("configs/t2v/motion_grpo.yaml", ["train.parallel=fsdp"]), world=32)
    with pytest.raises(ValueError, match="SD3Transformer2DModel has no context-parallel plan"):
        plan(load_config("configs/t2i/shapes_grpo.yaml", ["train.parallel=fsdp"]), cp=2)


def test_frozen_parts_at_real_size():
    """Text encoders and VAE as the released folders instantiate them (parameters), counted at model.dtype."""
    p = plan(load_config("configs/t2v/wan22_a14b_lora.yaml", ["train.micro_batch=1"]), "wan22-a14b")
    assert p["text_encoder_params"] == pytest.approx(5.68e9, rel=0.01) and p["vae_params"] == pytest.approx(127e6, rel=0.01)
    assert p["text_encoders_gib"] == pytest.approx(2 * 5.68e9 / 2**30, rel=0.01)
    assert p["vae_decode_rows"] == 1 and p["vae_decode_transient_gib"] > 0 and p["rollout_storage_gib"] > 0
    sd3 = plan(load_config("configs/t2i/sd35_geneval_lora.yaml"), "sd35-medium")
    assert sd3["text_encoder_params"] == pytest.approx(5.58e9, rel=0.01) and sd3["vae_params"] == pytest.approx(84e6, rel=0.01)


@pytest.mark.slow  # ~25 s, three measured processes; the flow, token and VAE-decode estimates are measured in the default run
def test_wan_estimate_within_25_percent_of_measured(tmp_path):
    """The motion world's pixel Wan transformer (8-frame 16 x 16 clips): 24 transitions per training forward."""
    items = ["train.prompts_per_iter=4", "train.group_size=8", "train.micro_batch=24", "train.minibatches=1",
             "task.eval_prompts=8", f"log.out_dir={tmp_path}", "log.tensorboard=false", "log.progress=false"]
    p = plan(load_config("configs/t2v/motion_grpo.yaml", items))
    estimate = (p["activations_per_micro_batch_gib"] + p["gradients_fp32_gib"]) * 1024
    # The smallest of three fresh processes (single ones measured 157-175 MiB against the estimate's 128; the bound is
    # 171): the estimate runs 18-27 % under single measurements here, near its bound, not far inside it.
    measured = measure("configs/t2v/motion_grpo.yaml", items, repeats=3)["train_peak_mib"]
    assert abs(estimate - measured) <= 0.25 * measured, (estimate, measured)


_DECODE = """
import json, sys, torch, diffusers
from mmrl.plan import decode_peak
from mmrl.testing.memory import reset_peak, rss_kib
torch.set_num_threads(1)
cfg = dict(latent_channels=16, block_out_channels=[64, 128, 128, 128], down_block_types=["DownEncoderBlock2D"] * 4,
           up_block_types=["UpDecoderBlock2D"] * 4)
vae = diffusers.AutoencoderKL(**cfg).eval()
with torch.no_grad():
    vae.decode(torch.randn(1, 16, 8, 8))  # kernels' one-time allocations before the measurement
z = torch.randn(4, 16, 32, 32)
before = reset_peak()
with torch.no_grad():
    out = vae.decode(z).sample
measured = (rss_kib("VmHWM") - before) * 1024
with torch.device("meta"):
    meta = diffusers.AutoencoderKL(**cfg).eval()
print(json.dumps([decode_peak(meta, z.to("meta"))[0], measured]))
"""


def test_vae_decode_transient_within_25_percent_of_measured():
    """4 rows of a 4-level VAE decoded to 256 px on CPU (a fresh process) against the meta live-tensor peak."""
    out = subprocess.run([sys.executable, "-c", _DECODE], capture_output=True, text=True)
    assert not out.returncode, out.stderr[-2000:]
    estimate, measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(estimate - measured) <= 0.25 * measured, (estimate, measured)


# ------------------------------------------------------------------------------ measured phases (fake tensors)
_FULL = ["model.lora.enabled=false", "model.reference=auto", "algo.kl_coef=0.04", "train.ema_decay=0.9",
         "train.prompts_per_iter=2", "train.group_size=4", "train.minibatches=1", "train.micro_batch=4",
         "sampler.num_steps=4", "sampler.sde_window_size=2", "sampler.sde_window_range=[0,2]", "task.eval_prompts=4"]


def test_measured_phases_shard_over_a_fake_world():
    """The shapes model fully fine-tuned with KL and EMA, a rank of 2 under FSDP2 (fake process group): it holds
    half the fp32 weights, reference and EMA at start-up (the by-hand split), with the frozen parts whole; a save adds
    the largest trained tensor gathered whole (fp32); the peak is the largest phase."""
    from mmrl.plan_models import flow_model

    cfg = load_config("configs/t2i/shapes_grpo.yaml", _FULL + ["train.parallel=fsdp"])
    p = plan(cfg, world=2, measured=True, device="cpu")
    half = p["weights_trained_fp32_gib"] + p["kl_reference_copy_gib"] + p["ema_fp32_gib"]  # already / 2
    assert p["startup_gib"] == pytest.approx(half + p["text_encoders_gib"] + p["vae_gib"], rel=0.03)
    largest = max(q.numel() for q in flow_model(cfg, None)[0].parameters())
    assert p["save_added_gib"] == pytest.approx(4 * largest / 2**30, rel=0.05)
    phases = ("startup", "sampling", "decode", "train", "save")
    assert p["peak_gib"] == p["total_gib"] == max(p[f"{k}_gib"] for k in phases)
    assert p["train_gib"] > p["startup_gib"] + p["adamw_state_fp32_gib"]  # + AdamW, gradients, activations


_PHASES = """
import json, os, random, sys, torch
from mmrl.compose import load_config
from mmrl.testing.memory import reset_peak, rss_kib
from mmrl.trainer import Trainer
torch.set_num_threads(1)
torch.manual_seed(0)
peaks, cfg = {}, load_config("configs/t2i/shapes_grpo.yaml", json.loads(sys.argv[1]))
reset_peak()
tr = Trainer(cfg)
peaks["startup"] = rss_kib("VmHWM")
reset_peak()
rollout, _, _, _ = tr.collect(random.Random(0), torch.Generator().manual_seed(0))
peaks["sampling"] = rss_kib("VmHWM")
reset_peak()
tr.optimize(rollout, torch.linspace(-1, 1, len(rollout)))
peaks["train"] = rss_kib("VmHWM")
reset_peak()
tr.save()
peaks["save"] = rss_kib("VmHWM")
print(json.dumps({k: v / 1024 for k, v in peaks.items()}))  # MiB
"""


def _model_folder(path, layers: int | None) -> str:
    """The shapes base with a larger transformer (random init, saved), or the base itself (layers None)."""
    import shutil

    import torch
    from diffusers import SD3Transformer2DModel

    base = "tasks/assets/shapes-base"
    if layers is None:
        return base
    shutil.copytree(base, path, ignore=shutil.ignore_patterns("transformer"))
    config = {k: v for k, v in json.load(open(f"{base}/transformer/config.json")).items() if not k.startswith("_")}
    config.update(num_layers=layers, num_attention_heads=12, attention_head_dim=64, caption_projection_dim=768)
    torch.manual_seed(0)
    SD3Transformer2DModel(**config).save_pretrained(f"{path}/transformer")
    return str(path)


@pytest.mark.slow  # two trainer runs and two measured plans: ~6 min on a loaded 2-core machine
def test_measured_phases_within_15_percent_of_the_trainer_on_cpu(tmp_path):
    """Memory attributed to the model (benchmarks/bench_memory_dist.py's 165 M-parameter shapes SD3, full
    fine-tuning with KL and EMA, 1 process: the peak of each phase minus the same phase's on the 2.3 M base), planned on fake tensors against the trainer's
    resident peaks (VmHWM, large tensors mmap'ed so freed memory leaves). The plan's training phase is a later
    iteration's (AdamW's state held during the backward); the measured one is the first (the state is made at its
    step), so they differ by the activations, which this model's weights dominate."""
    import os

    GiB = 2**30
    measured, planned = {}, {}
    for name, layers in (("big", 8), ("base", None)):
        items = _FULL + [f"model.path={_model_folder(tmp_path / name, layers)}", f"log.out_dir={tmp_path}/run-{name}",
                         "log.tensorboard=false", "log.progress=false", "log.eval_at_start=false"]
        out = subprocess.run([sys.executable, "-c", _PHASES, json.dumps(items)], capture_output=True, text=True,
                             env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"})
        assert not out.returncode, out.stderr[-3000:]
        measured[name] = json.loads(out.stdout.strip().splitlines()[-1])
        planned[name] = plan(load_config("configs/t2i/shapes_grpo.yaml", items), measured=True, device="cpu")
    model = {phase: (measured["big"][phase] - measured["base"][phase],
                     (planned["big"][f"{phase}_gib"] - planned["base"][f"{phase}_gib"]) * GiB / 2**20)
             for phase in ("startup", "sampling", "train", "save")}  # phase: (measured, planned) MiB
    print(model)
    assert all(abs(p - m) <= 0.15 * m for m, p in model.values()), model


def test_a_failed_measurement_keeps_the_by_hand_plan_and_names_the_failure(monkeypatch, caplog):
    """`mmrl plan --arch qwen-image` failed inside the fake-tensor measurement with a bare AssertionError: the
    by-hand figures still stand, so the plan prints them with a warning naming the failure."""
    import mmrl.plan as plan_module

    def broken(*a, **k):
        raise AssertionError("fake tensor meets a real one")

    monkeypatch.setattr(plan_module, "measure", broken)
    with caplog.at_level("WARNING"):
        p = plan(load_config("configs/t2v/motion_grpo.yaml", ["train.micro_batch=2"]), measured=True)
    assert p["measure_error"] == "AssertionError: fake tensor meets a real one" and "peak_gib" not in p
    assert p["total_gib"] > 0 and "the measured plan failed" in caplog.text


# ---------------------------------------------------------------------------------- Janus-Pro (model.policy: janus)
JANUS = "configs/t2i/janus_pro_geneval_lora.yaml"


@pytest.fixture(scope="module")
def tiny_janus_folder(tmp_path_factory) -> str:
    from test_janus import build_tiny_janus

    return build_tiny_janus(str(tmp_path_factory.mktemp("models") / "tiny-janus"))


@pytest.mark.parametrize("lora", [True, False])
def test_janus_plan_counts_what_the_policy_trains(tiny_janus_folder, lora):
    """The tiny Janus folder (a 2-layer Llama of width 32, 1 KV head of 16, A = 16 image tokens) planned and measured
    on fake tensors: the trainable parameters are the policy's own (build_janus_policy on the same config), the frozen
    parts are the SigLIP tower, its aligner (the text head is tied into the trained embeddings here) and the VQ model,
    and the KV cache, rows and FLOPs follow by hand."""
    from mmrl.policy.janus import build_janus_policy

    items = [f"model.path={tiny_janus_folder}", f"model.lora.enabled={str(lora).lower()}", "model.dtype=float32",
             "model.device=cpu", "train.prompts_per_iter=4", "train.group_size=2", "train.micro_batch=2"]
    cfg = load_config(JANUS, items)
    p = plan(cfg, measured=True, device="cpu")
    pol = build_janus_policy(cfg)
    count = lambda params: sum(x.numel() for x in params)  # noqa: E731
    m = pol.janus.model
    assert p["trainable_params"] == count(pol.trainable_parameters()) == (32768 if lora else 25024)
    assert p["params"] == count(pol.lm.parameters())
    assert p["text_encoder_params"] == count(m.vision_model.parameters()) + count(m.aligner.parameters())
    assert p["vae_params"] == count(m.vqmodel.parameters())
    # 2 samples per chunk x 2 CFG rows x (48 prompt + 16 image tokens) x 2 layers x (K, V) x 1 head x 16 x 4 bytes
    assert p["sampling_chain_gib"] * 2**30 == 2 * 2 * 64 * 2 * 2 * 1 * 16 * 4
    assert p["micro_batch_rows"] == 4 and p["rows_sampled_per_iter"] == p["rows_trained_per_iter"] == 16
    assert p["tflop_per_iter_training"] == pytest.approx(4 * p["tflop_per_iter_sampling"])  # checkpointed: 4 x fwd
    assert "measure_error" not in p and p["peak_gib"] == max(p[f"{k}_gib"] for k in ("startup", "sampling",
                                                                                       "decode", "train", "save"))
    assert p["train_gib"] > p["startup_gib"] and p["decode_added_gib"] > 0


def test_janus_rows_follow_cfg_grad_and_old_log_probs(tiny_janus_folder):
    """cfg_grad=cond trains the conditional rows and runs the unconditional ones without gradient; two minibatches
    cannot defer the old log-probs to the first training forward, so every CFG row pays one more forward."""
    base = [f"model.path={tiny_janus_folder}", "model.dtype=float32", "train.prompts_per_iter=4", "train.group_size=2",
            "train.micro_batch=2", "train.gradient_checkpointing=false"]
    cond = plan(load_config(JANUS, base + ["sampler.cfg_grad=cond"]))
    assert cond["rows_trained_per_iter"] == cond["rows_forward_only_per_iter"] == 8
    fwd = cond["forward_tflop_per_row"]
    assert cond["tflop_per_iter_training"] == pytest.approx(fwd * (8 * 3 + 8))
    two = plan(load_config(JANUS, base + ["train.minibatches=2"]))
    assert two["rows_sampled_per_iter"] == 8 * 2 * 2 and two["rows_trained_per_iter"] == 16


@pytest.mark.parametrize("arch, params, hidden, inter, layers", [("janus-pro-1b", 2.0766e9, 2048, 5632, 24),
                                                                 ("janus-pro-7b", 7.4078e9, 4096, 11008, 30)])
def test_janus_pro_architectures_at_real_size(arch, params, hidden, inter, layers):
    """The published Janus-Pro sizes on 8 GPUs under FSDP (by hand): the whole model, the recipe's LoRA (r = 32 on
    q, k, v, o, gate, up, down of every layer: r x (in + out) each), the KV cache of a sampling chunk (4 samples x 2
    CFG rows x (48 + 576) tokens, head dim 128, bf16), and full fine-tuning's KL copy at bf16, sharded like the live
    weights. Under FSDP both LoRA and full fine-tuning load into shards (no loading peak); under DDP every GPU loads
    the whole model (the frozen parts at bf16, the adapters fp32)."""
    lora = plan(load_config(JANUS, ["train.parallel=fsdp"]), arch, world=8)
    adapters = 32 * (4 * 2 * hidden + 2 * (hidden + inter) + (inter + hidden))
    assert lora["trainable_params"] == layers * adapters
    assert lora["params"] - lora["trainable_params"] + lora["text_encoder_params"] + lora["vae_params"] == \
        pytest.approx(params, rel=1e-4)
    assert lora["sampling_chain_gib"] * 2**30 == 4 * 2 * 624 * layers * 2 * hidden * 2
    assert lora["rows_per_rank"] == 16 and lora["micro_batch_rows"] == 8 and lora["kl_reference_copy_gib"] == 0
    assert lora["peak_loading_gib"] == 0
    assert lora["total_gib"] == max(lora["peak_sampling_gib"], lora["peak_training_gib"])
    ddp = plan(load_config(JANUS, ["train.parallel=ddp"]), arch, world=8)
    frozen = ddp["params"] - ddp["trainable_params"] + ddp["text_encoder_params"] + ddp["vae_params"]  # bf16
    assert ddp["peak_loading_gib"] * 2**30 == pytest.approx(2 * frozen + 4 * ddp["trainable_params"])
    full = plan(load_config(JANUS, ["train.parallel=fsdp", "model.lora.enabled=false"]), arch, world=8)
    assert full["trainable_params"] == full["params"]
    assert full["kl_reference_copy_gib"] == pytest.approx(2 * full["params"] / 8 / 2**30)
    assert full["peak_loading_gib"] == 0
    assert full["adamw_state_fp32_gib"] == pytest.approx(8 * full["params"] / 8 / 2**30)
    with pytest.raises(ValueError, match="--arch janus-pro-7b is a janus model"):
        plan(load_config("configs/grounding/charades_qwen25vl_lora.yaml"), "janus-pro-7b")


def test_janus_full_fine_tuning_under_fsdp_is_planned_sharded(tiny_janus_folder):
    """Full fine-tuning with KL under FSDP on 2 GPUs: build_janus_policy reads the ImageTokenLM into shards (no
    loading peak) and parallelize shards the reference copy, at model.dtype; under DDP both stay whole."""
    items = [f"model.path={tiny_janus_folder}", "model.lora.enabled=false", "model.dtype=bfloat16", "model.device=cpu",
             "algo.kl_coef=0.04", "train.prompts_per_iter=4", "train.group_size=2", "train.micro_batch=2"]
    fsdp = plan(load_config(JANUS, [*items, "train.parallel=fsdp"]), world=2, measured=True, device="cpu")
    ddp = plan(load_config(JANUS, [*items, "train.parallel=ddp"]), world=2, measured=True, device="cpu")
    assert "measure_error" not in fsdp and fsdp["peak_loading_gib"] == 0 < ddp["peak_loading_gib"]
    assert fsdp["kl_reference_copy_gib"] * 2**30 == fsdp["params"] * 2 / 2  # bf16, half on each of 2 GPUs
    assert ddp["kl_reference_copy_gib"] * 2**30 == ddp["params"] * 2
    assert fsdp["startup_gib"] < ddp["startup_gib"]


@pytest.mark.slow  # ~1 min: the 7 B model's iteration on fake tensors
def test_janus_pro_7b_measured_at_world_8():
    """`mmrl plan configs/t2i/janus_pro_geneval_lora.yaml --arch janus-pro-7b --world 8 train.parallel=fsdp`: at
    start-up a LoRA rank holds the whole model (build_janus_policy loads it onto the GPU, then FSDP shards the ImageTokenLM),
    the by-hand loading peak; sampling adds the KV cache and a forward, decoding the VQ decode of a 4-sample chunk."""
    p = plan(load_config(JANUS, ["train.parallel=fsdp"]), "janus-pro-7b", world=8, measured=True)
    assert "measure_error" not in p
    assert p["startup_gib"] == pytest.approx(p["peak_loading_gib"], rel=1e-3) and p["peak_gib"] == p["startup_gib"]
    assert p["sampling_added_gib"] > p["sampling_chain_gib"] and p["decode_added_gib"] == pytest.approx(
        p["vae_decode_transient_gib"], rel=0.05)


def test_two_experts_idle_rows_are_counted_where_they_run():
    """Wan2.2 under several processes (FlowPolicy._lockstep): a step whose last training forward holds one expert's
    transitions runs the other expert on one idle row with gradients under DDP and HSDP; FSDP2 decides per call and
    adds none while the ranks' micro-batches hold the same steps; one process adds none."""
    from types import SimpleNamespace

    from mmrl.plan_rows import idle_expert_rows, rows_of

    def idle(parallel, world, *items):
        cfg = load_config("configs/t2v/wan22_a14b_lora.yaml", [f"train.parallel={parallel}", *items])
        return idle_expert_rows(cfg, SimpleNamespace(experts=2, boundary=0.875), rows_of(cfg.train, world), 19, False)

    # 20 steps at shift 12: 13 trained steps of the high-noise expert, then 6; a micro-batch of 1 transition ends
    # each step on the low-noise expert alone: one idle row per optimizer step and rank
    steps = lambda t: t.minibatches // t.grad_accum * t.inner_epochs  # noqa: E731
    t = load_config("configs/t2v/wan22_a14b_lora.yaml").train
    assert idle("ddp", 8, "train.micro_batch=1") == idle("hsdp", 8, "train.micro_batch=1") == 8 * steps(t) > 0
    assert idle("fsdp", 8, "train.micro_batch=1") == 0 and idle("ddp", 1, "train.micro_batch=1") == 0
    assert idle("ddp", 8, "train.micro_batch=0") == 0                 # one forward of every step: both experts


@pytest.mark.slow  # ~70 s: plans SD3.5-M at ~140 rows per forward
def test_micro_batch_auto_is_the_largest_that_fits():
    """train.micro_batch=auto (mmrl/micro_batch.py): the planned peak at the pick fits HEADROOM of the device, one row
    more does not."""
    from mmrl.micro_batch import HEADROOM, fit_micro_batch

    cfg = load_config("configs/t2i/sd35_geneval_lora.yaml", ["train.micro_batch=auto", "train.parallel=ddp"])
    fit = fit_micro_batch(cfg, 40.0, "sd35-medium", 8)
    m = fit["micro_batch"]
    assert 4 < m < fit["whole"]
    at = lambda k: plan(load_config("configs/t2i/sd35_geneval_lora.yaml",  # noqa: E731
                                    [f"train.micro_batch={k}", "train.parallel=ddp"]), "sd35-medium", world=8)["total_gib"]
    assert at(m) <= HEADROOM * 40.0 < at(m + 1)


def test_micro_batch_auto_at_its_bounds():
    """On the shapes world: the pick's planned training peak fits HEADROOM of the device and one row more does not; a
    device that holds the rank's whole minibatch gets that share (one forward per minibatch); one that holds no row is
    refused, naming the fixes, and so is a token policy (its memory follows its prompts); a value that is neither a
    count nor auto is refused."""
    from mmrl.errors import ConfigError
    from mmrl.micro_batch import HEADROOM, fit_micro_batch

    cfg = load_config("configs/t2i/shapes_grpo.yaml", ["train.micro_batch=auto"])
    m = fit_micro_batch(cfg, 0.12)["micro_batch"]
    at = lambda k: plan(load_config("configs/t2i/shapes_grpo.yaml", [f"train.micro_batch={k}"]))  # noqa: E731
    assert m > 1 and at(m)["total_gib"] <= HEADROOM * 0.12 < at(m + 1)["total_gib"]
    whole = fit_micro_batch(cfg, 10_000.0)
    assert whole["micro_batch"] == whole["whole"] == 192                  # 32 rows x 6 trained steps per minibatch
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        fit_micro_batch(cfg, 0.05)
    with pytest.raises(ConfigError, match="flow policies"):
        fit_micro_batch(load_config("configs/grounding/synthetic_grpo.yaml", ["train.micro_batch=auto"]), 80.0)
    with pytest.raises(ConfigError, match="or auto"):
        load_config("configs/t2i/shapes_grpo.yaml", ["train.micro_batch=most"])
