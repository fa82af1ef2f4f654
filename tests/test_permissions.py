"""Files mmrl writes get the user's umask: a checkpoint (torch.distributed.checkpoint shards, the policy's
safetensors, JSON) and an `mmrl export` folder are readable by the group and others under umask 022, as `ls -l`
shows for any file the user writes (safetensors 0.8 alone writes 0600; mmrl.checkpoint.share widens it)."""

import os
import stat

import torch

from mmrl.checkpoint import share
from mmrl.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def listing(folder) -> dict[str, str]:
    """{relative path: `ls -l` mode string} of every file and folder under `folder`."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = stat.filemode(os.lstat(path).st_mode)
    return out


def test_a_checkpoint_and_an_export_are_readable_under_umask_022(tiny_pixel_model, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        run, merged = tmp_path / "run", tmp_path / "merged"
        assert main(["train", f"{ROOT}/configs/tiny/flow_smoke.yaml", f"model.path={tiny_pixel_model}",
                     f"log.out_dir={run}", "train.iterations=1", "task.eval_prompts=2", "log.eval_at_start=false",
                     "log.tensorboard=false"]) == 0
        assert main(["export", str(run), str(merged)]) == 0
        capsys.readouterr()
        for folder in (run / "checkpoints" / "iter-000001", merged):
            modes = listing(folder)
            with capsys.disabled():
                print(f"\n{folder}:\n" + "\n".join(f"  {m} {p}" for p, m in sorted(modes.items())))
            assert any(p.endswith(".safetensors") for p in modes) and any(p.endswith(".distcp") for p in modes) \
                or folder == merged
            wrong = {p: m for p, m in modes.items() if m not in ("-rw-r--r--", "drwxr-xr-x")}
            assert not wrong, f"not the umask's permissions in {folder}: {wrong}"
    finally:
        os.umask(old)


def test_share_widens_to_the_umask_and_leaves_links_alone(tmp_path):
    old = os.umask(0o027)
    try:
        (tmp_path / "sub").mkdir(mode=0o700)
        (tmp_path / "sub" / "w.safetensors").write_bytes(b"x")
        os.chmod(tmp_path / "sub" / "w.safetensors", 0o600)
        (tmp_path / "base.bin").write_bytes(b"y")
        os.chmod(tmp_path / "base.bin", 0o600)
        os.link(tmp_path / "base.bin", tmp_path / "sub" / "linked.bin")  # a base model's file, hard-linked
        share(str(tmp_path / "sub"))
        modes = listing(tmp_path)
        assert modes["sub"] == "drwxr-x---" and modes["sub/w.safetensors"] == "-rw-r-----"
        assert modes["base.bin"] == "-rw-------"  # not ours to widen
    finally:
        os.umask(old)


def test_the_embedded_worlds_export_loads_and_samples_in_diffusers(tiny_pixel_model, tmp_path, capsys):
    """`mmrl export` of a pixel image model writes a diffusers pipeline folder (model_index.json naming each
    component, mmrl's pipeline.py beside it) and prints how to load it; DiffusionPipeline.from_pretrained with
    custom_pipeline samples what mmrl's own evaluation samples (same seed, CFG 2, 4 steps)."""
    from diffusers import DiffusionPipeline

    from mmrl.policy.flow import load_policy_checkpoint

    run, merged = tmp_path / "run", tmp_path / "merged"
    assert main(["train", f"{ROOT}/configs/tiny/flow_smoke.yaml", f"model.path={tiny_pixel_model}",
                 f"log.out_dir={run}", "train.iterations=1", "task.eval_prompts=2", "log.eval_at_start=false",
                 "log.tensorboard=false"]) == 0
    capsys.readouterr()
    assert main(["export", str(run), str(merged)]) == 0
    assert f'load it with: DiffusionPipeline.from_pretrained("{merged}", custom_pipeline="{merged}", ' \
           f'trust_remote_code=True)' in capsys.readouterr().out
    pipe = DiffusionPipeline.from_pretrained(str(merged), custom_pipeline=str(merged), trust_remote_code=True)
    pipe.set_progress_bar_config(disable=True)
    got = pipe(["a red circle", "two blue squares"], num_inference_steps=4, guidance_scale=2.0,
               generator=[torch.Generator().manual_seed(s) for s in (7, 8)], output_type="pt").images
    want = load_policy_checkpoint(str(run / "checkpoints" / "iter-000001")).generate(
        ["a red circle", "two blue squares"], [7, 8], 4, 2.0)
    assert got.shape == want.shape == (2, 3, 24, 24)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert len(pipe(["a red circle"], num_inference_steps=2).images) == 1  # PIL images by default
    from mmrl.models.pipelines import load_flow_model  # mmrl still reads the folder as a base model

    again = load_flow_model(str(merged)).generate(["a red circle", "two blue squares"], [7, 8], 4, 2.0)
    torch.testing.assert_close(again, want, rtol=0, atol=1e-6)
