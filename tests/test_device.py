"""Device correctness without a GPU: the trainer's real step (rollout, reward, advantages, loss, backward,
optimizer step) on the fake accelerator of mmrl.testing.fake_device, for both policies and the option
combinations that add tensors of their own (KL reference, trees, Guard, TempFlow, ground-truth injection).
A CPU tensor meeting an accelerator tensor anywhere raises DeviceMismatch, as it would on CUDA."""

import contextlib

import pytest
import torch

from mmrl.compose import load_config
from mmrl.testing.fake_device import DeviceMismatch, fake_accelerator
from mmrl.trainer import Trainer


def step_on_fake(config: str, items: list[str], device: str = "meta"):
    """One trainer step on CPU and one on the accelerator (the fake one, or "cuda" on a GPU machine): the second
    must not mix devices; on the fake accelerator, which computes on CPU, its rewards, loss and gradient norm
    must also equal the CPU step's."""
    runs = {}
    for dev in ("cpu", device):
        cfg = load_config(config, [*items, f"model.device={dev}"])
        with fake_accelerator() if dev == "meta" else contextlib.nullcontext():
            tr = Trainer(cfg)
            assert all(p.device.type == torch.device(dev).type for p in tr.params)
            runs[dev] = tr.step(0)
    m = runs[device]
    assert m["train/optimizer_steps"] >= 1
    assert not {k: v for k, v in m.items() if not torch.isfinite(torch.tensor(float(v)))}
    if device != "meta":  # a GPU's kernels round differently: samples, and so rewards, may differ
        return
    assert m["reward/overall_mean"] == pytest.approx(runs["cpu"]["reward/overall_mean"], rel=1e-5, abs=1e-7)
    # the second minibatch follows an Adam step, whose first update is about lr * sign(grad): rounding-level
    # differences in near-zero gradients (a different attention kernel) move it by more than rounding
    for k in ("train/loss", "train/grad_norm"):
        assert m[k] == pytest.approx(runs["cpu"][k], rel=1e-2, abs=1e-6), k


def test_the_fake_accelerator_catches_a_mix():
    with fake_accelerator() as dev:
        x = torch.ones(3, 2, device=dev)
        assert (x * torch.tensor(2.0)).sum().item() == 12  # a CPU scalar is fine, as on CUDA
        assert x[torch.tensor([0, 2])].device == dev       # so is a CPU index
        with pytest.raises(DeviceMismatch):
            x * torch.ones(3, 2)
        with pytest.raises(TypeError, match="cpu"):
            x.numpy()
        assert x.cpu().numpy().sum() == 6


@pytest.mark.parametrize("items", [
    [],
    ["model.lora.enabled=true", "model.lora.rank=4", "algo.kl_coef=0.1"],
    ["algo.kl_coef=0.1", "algo.kl=k3", "train.gradient_checkpointing=true", "train.ema_decay=0.5"],
    ["algo.kl_coef=0.1", "model.offload=true", "train.micro_batch=4"],
    ["algo.ratio=guard", "algo.weighting=tempflow+guard_dt", "sampler.sde_window_size=1", "sampler.shared_noise=true"],
    ["tree.split_steps=[0,1]", "tree.branch=2", "train.group_size=4", "algo.loss_agg=token_mean",
     "tree.width_prune=1", "tree.fusion=softmax"],
    ["algo.objective.name=nft", "sampler.cfg_scale=1.0", "sampler.kind=ode", "train.micro_batch=3"],
    ["sampler.ode_solver=dpm2m", "sampler.ode_stride=2", "algo.kl_coef=0.1", "algo.kl=flow_velocity",
     "algo.kl_reference=ema", "train.ema_decay=0.5", "sampler.window_schedule=sliding"],
])
def test_flow_step_on_an_accelerator(tiny_pixel_model, tmp_path, items):
    step_on_fake("configs/tiny/flow_smoke.yaml", [f"model.path={tiny_pixel_model}", f"log.out_dir={tmp_path}",
                                                  "log.tensorboard=false", "log.eval_at_start=false", *items])


@pytest.mark.parametrize("items", [
    [],
    ["model.lora.enabled=true", "model.lora.rank=4", "model.reference=auto", "algo.kl_coef=0.1", "algo.kl=k3"],
    ["algo.offpolicy=ground_truth", "algo.shaping.name=tempsamp", "algo.objective.sft_coef=1.0", "algo.ratio=gspo"],
    ["sampler.engine=hf", "model.shared_prefix=false", "algo.dynamic_sampling=true"],
    ["train.gradient_checkpointing=true", "train.micro_batch=2"],  # with the default shared-prefix scoring
])
def test_token_step_on_an_accelerator(tiny_vl, tiny_world, tmp_path, items):
    step_on_fake("configs/tiny/vlm_smoke.yaml", [
        f"model.path={tiny_vl}", f"task.kwargs.root={tiny_world}", "task.kwargs.train_videos=6",
        "task.kwargs.test_videos=3", f"log.out_dir={tmp_path}", "log.tensorboard=false", "log.eval_at_start=false",
        *items])


def test_offloaded_parts_wait_on_cpu(tiny_pixel_model, tmp_path):
    """model.offload: the text encoder and the reference copy run on the accelerator and rest on the CPU."""
    cfg = load_config("configs/tiny/flow_smoke.yaml", [
        f"model.path={tiny_pixel_model}", f"log.out_dir={tmp_path}", "log.tensorboard=false",
        "log.eval_at_start=false", "model.device=meta", "model.offload=true", "algo.kl_coef=0.1"])
    with fake_accelerator() as dev:
        tr = Trainer(cfg)
        tr.step(0)
        parked = [*tr.policy.model.text_modules, *tr.policy._ref_copy.values()]
        assert all(p.device.type == "cpu" for m in parked for p in m.parameters())
        assert all(p.device == dev for p in tr.policy.transformer.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.py runs it on a GPU machine)")
@pytest.mark.parametrize("policy", ["flow", "token"])
def test_step_on_cuda(policy, request, tmp_path):
    # fixtures by name: the token policy's world needs PyAV (its mp4 files), the flow policy's model does not
    common = [f"log.out_dir={tmp_path}", "log.tensorboard=false", "log.eval_at_start=false"]
    if policy == "flow":
        tiny_pixel_model = request.getfixturevalue("tiny_pixel_model")
        step_on_fake("configs/tiny/flow_smoke.yaml", [f"model.path={tiny_pixel_model}", "algo.kl_coef=0.1", *common],
                     "cuda")
    else:
        tiny_vl, tiny_world = request.getfixturevalue("tiny_vl"), request.getfixturevalue("tiny_world")
        step_on_fake("configs/tiny/vlm_smoke.yaml", [f"model.path={tiny_vl}", f"task.kwargs.root={tiny_world}",
                                                     "task.kwargs.train_videos=6", "task.kwargs.test_videos=3", *common],
                     "cuda")


def test_offloaded_vae_decodes_on_the_accelerator(tmp_path):
    """model.offload with a latent family (FLUX.1: its VAE is among the frozen parts): the VAE rests on the CPU and
    visits the accelerator to decode the rollout's images (it was left on the CPU: 'Input type (CUDABFloat16Type)
    and weight type (CPUBFloat16Type)' on an H200, configs/t2i/flux2_dev_lora.yaml)."""
    from mmrl.models.families import families

    flux = next(f for f in families() if f.name == "flux")
    path = str(tmp_path / "flux")
    flux.tiny(0).save_pretrained(path)
    cfg = load_config("configs/tiny/flow_smoke.yaml", [
        f"model.path={path}", f"log.out_dir={tmp_path / 'run'}", "log.tensorboard=false", "log.eval_at_start=false",
        "model.device=meta", "model.offload=true", "model.sample_size=8"])
    with fake_accelerator() as dev:
        tr = Trainer(cfg)
        assert tr.policy.autoencoders
        tr.step(0)
        tr.evaluate(1)  # the held-out images decode too (the H200 run failed there after the rollout's fix)
        assert all(p.device.type == "cpu" for m in tr.policy.autoencoders for p in m.parameters())
        assert all(p.device == dev for p in tr.policy.transformer.parameters())
