import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from mmrl.checkpoint import atomic_dir, latest, prune


def test_atomic_dir_replaces_only_on_success(tmp_path):
    target = tmp_path / "ck"
    with atomic_dir(str(target)) as tmp:
        open(os.path.join(tmp, "a.txt"), "w").write("v1")
    assert (target / "a.txt").read_text() == "v1"
    with pytest.raises(RuntimeError):
        with atomic_dir(str(target)) as tmp:
            open(os.path.join(tmp, "a.txt"), "w").write("half-written")
            raise RuntimeError("killed mid-save")
    assert (target / "a.txt").read_text() == "v1"
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temp folders left behind


def test_latest_and_prune(tmp_path):
    for i in (2, 10, 7):
        (tmp_path / f"iter-{i:06d}").mkdir()
    (tmp_path / "notes").mkdir()
    assert latest(str(tmp_path)).endswith("iter-000010")
    prune(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path)) == ["iter-000007", "iter-000010", "notes"]
    assert latest(str(tmp_path / "missing")) is None


# ----------------------------------------------------------------------------------- sharded trainer checkpoints
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests/workers/reshard.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONPATH": ROOT}


def tiny_run(model, out, *over):
    """A 2-iteration tiny flow run with EMA, a checkpoint after each iteration."""
    from mmrl.compose import load_config
    from mmrl.runs import train

    return train(load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"), [
        f"model.path={model}", f"log.out_dir={out}", "log.tensorboard=false", "task.eval_prompts=2",
        "train.prompts_per_iter=2", "train.group_size=2", "train.iterations=2", "log.save_every=1",
        "train.ema_decay=0.9", *over]))


def test_each_trained_tensor_is_stored_once_raw_and_once_as_ema(tiny_pixel_model, tmp_path):
    """state/ (DCP) holds the raw weights, the EMA shadow and AdamW's moments, one entry per trained parameter; an
    intermediate checkpoint has no policy/ (no third copy) and gets one built from its EMA when asked; the run's
    last checkpoint carries policy/ (the export, = the EMA); manifest.json lists every file."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from mmrl.checkpoint import checkpoints, policy_folder, read_trainer_state
    from mmrl.checkpoint_state import files, verify

    tiny_run(tiny_pixel_model, tmp_path / "run")
    last, first = checkpoints(tmp_path / "run" / "checkpoints")
    state = read_trainer_state(first)
    n = len(state["params"])
    keys = FileSystemReader(os.path.join(first, "state")).read_metadata().state_dict_metadata
    assert sum(k.startswith("model.") for k in keys) == sum(k.startswith("ema.") for k in keys) == n
    assert sum(k.startswith("optim.state.") and k.endswith(".exp_avg") for k in keys) == n
    assert state["iteration"] == 1 and state["world"] == 1 and not os.path.exists(os.path.join(first, "policy"))
    assert os.path.isfile(os.path.join(last, "policy", "mmrl_policy.json"))
    manifest = json.load(open(os.path.join(last, "manifest.json")))["files"]
    assert sorted(manifest) == files(last) and "state/.metadata" in manifest and not verify(last)
    # policy/ of the first checkpoint, built from its shards: the EMA weights, and the folder stays intact
    assert policy_folder(first) == os.path.join(first, "policy") and not verify(first)
    built = load_file(os.path.join(first, "policy", "transformer", "diffusion_pytorch_model.safetensors"))
    ema = dict(zip(state["names"], state["ema"]))
    assert all(torch.equal(built[k.removeprefix("0.")], v) for k, v in ema.items())  # (+ buffers, not trained)
    assert any(not torch.equal(a, b) for a, b in zip(state["params"], state["ema"]))  # EMA is not the raw weights


def test_a_damaged_checkpoint_is_refused_in_one_line_and_a_run_uses_the_previous(tiny_pixel_model, tmp_path, caplog):
    import logging

    from mmrl.checkpoint import checkpoints, policy_folder
    from mmrl.cli import main
    from mmrl.errors import DamagedCheckpoint

    tiny_run(tiny_pixel_model, tmp_path / "run")
    last, first = checkpoints(tmp_path / "run" / "checkpoints")
    weights = os.path.join(last, "policy", "transformer", "diffusion_pytorch_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 100)
    with caplog.at_level(logging.WARNING):  # a run folder: its newest intact checkpoint, with a warning naming both
        assert policy_folder(str(tmp_path / "run")) == os.path.join(first, "policy")
    assert f"{last}: policy/transformer/diffusion_pytorch_model.safetensors is " in caplog.text
    assert f"using {first} instead" in caplog.text
    with pytest.raises(DamagedCheckpoint, match=f"checkpoint {last} is damaged: .* bytes, the manifest says .*; "
                                                f"{first} is intact"):
        policy_folder(os.path.join(last, "policy"))
    # the command line: one line (no traceback, exit status 2), before any model loads
    for argv in (["eval", "configs/tiny/flow_smoke.yaml", last], ["export", last, str(tmp_path / "merged")]):
        assert main(argv) == 2
    shutil.rmtree(first)
    with pytest.raises(DamagedCheckpoint, match="no intact checkpoint to resume from: .*iter-000002"):
        policy_folder(str(tmp_path / "run"))


def run_worker(*args, procs: int = 1):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"] \
        if procs > 1 else [sys.executable]
    r = subprocess.run([*launch, WORKER, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def max_diff(a, b) -> float:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


def resumed_elsewhere(model, tmp_path, first: tuple, then: tuple) -> float:
    """Run 3 iterations on `first` = (processes, parallel) with a checkpoint after 2; resume that checkpoint on
    `then` for the last iteration. The largest difference of the parameters and EMA between the two ends."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_worker(model, str(straight), str(tmp_path / "straight.safetensors"), "--parallel", first[1], procs=first[0])
    shutil.copytree(straight / "checkpoints", resumed / "checkpoints")
    run_worker(model, str(resumed), str(tmp_path / "resumed.safetensors"), "--parallel", then[1], "--resume",
               procs=then[0])
    return max_diff(tmp_path / "straight.safetensors", tmp_path / "resumed.safetensors")


def test_an_fsdp_checkpoint_of_2_processes_resumes_in_one(tiny_pixel_model, tmp_path):
    """Measured: 1.5e-8 (fp32 reduction order: 2 ranks' sums against one process's)."""
    d = resumed_elsewhere(tiny_pixel_model, tmp_path, (2, "fsdp"), (1, "none"))
    assert d < 1e-6, f"2 -> 1: parameters differ from the uninterrupted run by {d}"


@pytest.mark.slow  # ~50 s: two more 2-process runs
def test_a_single_process_checkpoint_resumes_on_2_processes_and_ddp_resumes_under_fsdp(tiny_pixel_model, tmp_path):
    """Measured: 1 -> 2 (FSDP) 3.7e-9."""
    d = resumed_elsewhere(tiny_pixel_model, tmp_path / "a", (1, "none"), (2, "fsdp"))
    assert d < 1e-6, f"1 -> 2: parameters differ from the uninterrupted run by {d}"
    d = resumed_elsewhere(tiny_pixel_model, tmp_path / "b", (2, "ddp"), (2, "fsdp"))
    assert d < 1e-6, f"DDP -> FSDP: parameters differ from the uninterrupted run by {d}"


def test_a_run_folder_each_node_sees_alone_is_refused(tmp_path):
    """Two processes, each given its own folder (node-local log.out_dir): both refuse, naming the fix; one folder
    both see passes."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER,
                        str(tmp_path / "node0"), str(tmp_path / "node1"), "--shared-check"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: log.out_dir=" in r.stdout and "rank(s) [1] cannot see the file" in r.stdout
    assert "needs log.out_dir on a filesystem every node mounts" in r.stdout
    assert os.listdir(tmp_path / "node0") == []  # the token file is removed
