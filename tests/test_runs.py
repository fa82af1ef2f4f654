"""Runs are never mixed or lost (mmrl/runs.py, mmrl/checkpoint.py, mmrl/metrics.py): a folder that holds a run is
refused without --resume / --overwrite; --resume refuses config changes that break the saved state before anything
is written; the logs of a killed run are cut back to its checkpoint; a damaged newest checkpoint falls back to the
previous intact one; checkpoints carry a base-model path that survives moving the project; runs get their own
folder by default."""

import json
import logging
import os
import re
import shutil
import stat

import pytest

from mmrl.checkpoint import checkpoints
from mmrl.checkpoint_state import verify
from mmrl.compose import load_config
from mmrl.runs import RunDirError, train
from mmrl.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cfg(model, out, *over):
    return load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"), [
        f"model.path={model}", f"log.out_dir={out}", "log.tensorboard=true", "task.eval_prompts=2",
        "train.prompts_per_iter=2", "train.group_size=2", *over])


def steps(out) -> list[int]:
    """The training steps in metrics.jsonl, in order (lines with a train/ metric)."""
    rows = [json.loads(ln) for ln in open(os.path.join(out, "metrics.jsonl"))]
    return [r["step"] for r in rows if any(k.startswith("train/") for k in r)]


def tb_steps(out, tag="train/loss") -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(out, "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


class Killed(BaseException):
    """Stands for a kill: nothing after it runs (not an Exception: no handler catches it)."""


def test_a_folder_with_a_run_is_refused_then_overwritten(tiny_pixel_model, tmp_path):
    out = tmp_path / "run"
    train(cfg(tiny_pixel_model, out))
    before = {f: os.path.getmtime(out / f) for f in ("metrics.jsonl", "config.json", "results.json")}
    with pytest.raises(RunDirError, match=r"already holds a run \(2 checkpoint\(s\), newest iter-000002\)."
                                          r" Continue it with --resume, start over with --overwrite"):
        train(cfg(tiny_pixel_model, out, "train.lr=1e-3"))
    assert before == {f: os.path.getmtime(out / f) for f in before}  # nothing written
    train(cfg(tiny_pixel_model, out, "train.iterations=1"), overwrite=True)
    assert steps(out) == [1] and [os.path.basename(c) for c in checkpoints(out / "checkpoints")] == ["iter-000001"]
    # checkpoints with the usual permissions (mkdtemp would make them 0700)
    mode = stat.S_IMODE(os.stat(checkpoints(out / "checkpoints")[0]).st_mode)
    assert mode == 0o777 & ~_umask()


def _umask():
    m = os.umask(0)
    os.umask(m)
    return m


def test_resume_checks_the_config_before_writing(tiny_pixel_model, tmp_path, caplog):
    out = tmp_path / "run"
    train(cfg(tiny_pixel_model, out))
    saved = open(out / "config.json").read()
    with pytest.raises(RunDirError, match=r"changes the saved state .*model.lora.enabled: False -> True"):
        train(cfg(tiny_pixel_model, out, "model.lora.enabled=true"), resume=True)
    with pytest.raises(RunDirError, match=r"algo.objective.name: 'ppo_clip' -> 'nft'"):
        train(cfg(tiny_pixel_model, out, "algo.objective.name=nft", "sampler.cfg_scale=1.0", "sampler.kind=ode"), resume=True)
    assert open(out / "config.json").read() == saved
    with caplog.at_level(logging.WARNING):
        res = train(cfg(tiny_pixel_model, out, "train.lr=0.01", "train.iterations=3"), resume=True)
    assert "train.lr: 0.0001 -> 0.01" in caplog.text and "train.iterations" not in caplog.text
    assert res["iterations"] == 3 and steps(out) == [1, 2, 3]
    assert res["eval_start"]["n"] == 2  # the base model's figures survive the resume
    with pytest.raises(RunDirError, match="give one"):
        train(cfg(tiny_pixel_model, out), resume=True, overwrite=True)


def test_a_killed_run_resumes_without_duplicated_steps(tiny_pixel_model, tmp_path, monkeypatch):
    """Killed during the 4th iteration of 6 (checkpoint at 2, step 3 logged after it): metrics.jsonl and
    TensorBoard hold steps 1..6 (the iterations done, as the log lines and eval/ count) once each, and a save killed half-way leaves no folder behind once the run goes on."""
    out = tmp_path / "run"
    c = cfg(tiny_pixel_model, out, "train.iterations=6", "log.save_every=2", "log.eval_every=2")
    step = Trainer.step

    def dies_at_3(self, it):
        if it == 3:
            raise Killed
        return step(self, it)

    monkeypatch.setattr(Trainer, "step", dies_at_3)
    with pytest.raises(Killed):
        train(c)
    assert steps(out) == [1, 2, 3] and tb_steps(out) == [1, 2, 3]  # step 3 was logged after the checkpoint at 2
    assert [os.path.basename(p) for p in checkpoints(out / "checkpoints")] == ["iter-000002"]
    os.makedirs(out / "checkpoints" / ".iter-000004.tmp-abc123")  # what a kill during a save leaves
    monkeypatch.setattr(Trainer, "step", step)
    res = train(c, resume=True)
    assert res["iterations"] == 6
    assert steps(out) == [1, 2, 3, 4, 5, 6]
    assert tb_steps(out) == [1, 2, 3, 4, 5, 6]
    evals = [json.loads(ln)["step"] for ln in open(out / "metrics.jsonl") if '"eval/overall"' in ln]
    assert evals == [0, 2, 4, 6] and sorted(tb_steps(out, "eval/overall")) == [0, 2, 4, 6]
    assert not [d for d in os.listdir(out / "checkpoints") if d.startswith(".")]


def test_a_finished_run_extended_keeps_its_last_evaluation(tiny_pixel_model, tmp_path):
    """A run that ended at iteration 2 (saved, then evaluated), resumed with train.iterations=4: its evaluation at 2
    was of the checkpoint's weights and stays in metrics.jsonl and TensorBoard; nothing is logged twice."""
    out = tmp_path / "run"
    train(cfg(tiny_pixel_model, out, "train.iterations=2", "log.save_every=2", "log.eval_every=2"))
    train(cfg(tiny_pixel_model, out, "train.iterations=4", "log.save_every=2", "log.eval_every=2"), resume=True)
    assert steps(out) == [1, 2, 3, 4]
    evals = [json.loads(ln)["step"] for ln in open(out / "metrics.jsonl") if '"eval/overall"' in ln]
    assert evals == [0, 2, 4] and sorted(tb_steps(out, "eval/overall")) == [0, 2, 4]


def test_resume_of_a_finished_run_changes_nothing(tiny_pixel_model, tmp_path, caplog):
    """--resume of a run that has done its train.iterations says so (and how to extend it) and changes no file: it
    re-ran the final evaluation, appended a second last row to metrics.jsonl and rewrote results.json."""
    out = tmp_path / "run"
    first = train(cfg(tiny_pixel_model, out, "train.iterations=2"))
    files = {f: open(out / f).read() for f in ("metrics.jsonl", "results.json", "config.json")}
    with caplog.at_level(logging.WARNING):
        again = train(cfg(tiny_pixel_model, out, "train.iterations=2"), resume=True)
    assert "is finished (2 of train.iterations=2 done): nothing to do" in caplog.text
    assert {f: open(out / f).read() for f in files} == files
    assert again["eval_end"] == first["eval_end"]


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tiny_pixel_model, tmp_path, caplog):
    out = tmp_path / "run"
    train(cfg(tiny_pixel_model, out, "train.iterations=3", "log.save_every=1", "log.keep_checkpoints=2"))
    newest, previous = checkpoints(out / "checkpoints")
    state = newest + "/state/__0_0.distcp"  # a shard cut short (a full disk, a kill mid-copy)
    with open(state, "r+b") as f:
        f.truncate(os.path.getsize(state) // 2)
    with caplog.at_level(logging.WARNING):
        res = train(cfg(tiny_pixel_model, out, "train.iterations=3", "log.save_every=1"), resume=True)
    assert f"{newest}: " in caplog.text and f"resuming from {previous} instead" in caplog.text
    assert res["iterations"] == 3 and steps(out) == [1, 2, 3]
    assert not any(verify(c) for c in checkpoints(out / "checkpoints"))  # every checkpoint intact again
    shutil.rmtree(checkpoints(out / "checkpoints")[1])
    open(checkpoints(out / "checkpoints")[0] + "/trainer_state.json", "w").close()
    with pytest.raises(RuntimeError, match="no intact checkpoint to resume from: .*iter-000003"):
        train(cfg(tiny_pixel_model, out, "train.iterations=3"), resume=True)


def test_a_moved_project_finds_its_base_model(tiny_pixel_model, tmp_path):
    from mmrl.policy.flow import load_policy_checkpoint

    proj = tmp_path / "proj"
    shutil.copytree(tiny_pixel_model, proj / "models" / "base")
    os.chdir(tmp_path)
    try:
        train(cfg("proj/models/base", "proj/runs/a", "train.iterations=1", "model.lora.enabled=true"))
    finally:
        os.chdir(ROOT)
    shutil.move(proj, tmp_path / "moved")
    policy = checkpoints(tmp_path / "moved" / "runs" / "a" / "checkpoints")[0] + "/policy"
    meta = json.load(open(policy + "/mmrl_policy.json"))
    assert meta["base_model_relative"] == "../../../../../models/base"
    assert load_policy_checkpoint(policy).transformer is not None
    shutil.rmtree(tmp_path / "moved" / "models")
    with pytest.raises(FileNotFoundError, match="its base model is neither at .* nor at .*relative to the checkpoint"):
        load_policy_checkpoint(policy)


def test_a_config_gets_its_own_run_folder(tmp_path):
    mine = tmp_path / "my_experiment.yaml"
    mine.write_text(f"base: {ROOT}/configs/t2i/shapes_grpo.yaml\ntrain:\n  mixed_precision: no\n")
    c = load_config(str(mine))
    assert c.log.out_dir == os.path.join("runs", "my_experiment") and c.train.mixed_precision == "no"
    assert load_config(str(mine), ["log.out_dir=elsewhere"]).log.out_dir == "elsewhere"
    assert load_config(os.path.join(ROOT, "configs/t2i/shapes_grpo.yaml")).log.out_dir == "runs/shapes_grpo"


def test_resume_of_an_older_run_and_of_a_run_without_checkpoints(tiny_pixel_model, tmp_path):
    """A key mmrl added after a run was saved counts as its default (no refusal); a run killed before its first
    checkpoint resumes from scratch with its logs cleared (no step twice)."""
    out = tmp_path / "run"
    train(cfg(tiny_pixel_model, out, "train.iterations=1"))
    for c in checkpoints(out / "checkpoints") + [str(out)]:  # as written before model.text_max_length existed
        saved = json.load(open(os.path.join(c, "config.json")))
        del saved["model"]["text_max_length"]
        json.dump(saved, open(os.path.join(c, "config.json"), "w"))
    assert train(cfg(tiny_pixel_model, out, "train.iterations=2"), resume=True)["iterations"] == 2
    shutil.rmtree(out / "checkpoints")  # killed before the first save: logs, no checkpoint
    train(cfg(tiny_pixel_model, out, "train.iterations=2"), resume=True)
    assert steps(out) == [1, 2] and tb_steps(out) == [1, 2]


def test_tensorboard_steps_are_the_logged_iterations(tiny_pixel_model, tmp_path, caplog):
    """Issue 44: the 'iteration N/M' log line, metrics.jsonl, TensorBoard and eval/ count the same way (N =
    iterations done); the evaluation line is for people; results.json holds the end-of-run summary."""
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        res = train(cfg(tiny_pixel_model, out, "train.iterations=2", "log.progress=false", "log.eval_every=1"))
    logged = [int(m) for m in re.findall(r"iteration (\d+)/2:", caplog.text)]
    assert logged == steps(out) == tb_steps(out) == [1, 2]
    assert sorted(tb_steps(out, "eval/overall")) == [0, 1, 2] and "eval at iteration 1: overall " in caplog.text
    assert "evaluating: 0/2" in caplog.text
    saved = json.load(open(out / "results.json"))
    assert saved["summary"] == res["summary"] and res["summary"]["iterations"] == 2
    assert res["summary"]["verdict"]["verdict"] in ("a real gain", "a real drop", "too few iterations to tell")
