"""The README's command lines run as written, in order, in a fresh working folder (configs and committed bases
linked in), with small overrides where the real command takes minutes: train, resume, override, validate, eval,
sample, plan, the quickstart."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# appended to the commands that train or generate, so each takes seconds (the README's own numbers are minutes)
SHORT = {"train": ["train.iterations=1", "train.prompts_per_iter=2", "train.group_size=2", "train.minibatches=1",
                   "task.eval_prompts=4", "log.save_every=1", "log.tensorboard=false"],
         "eval": ["task.eval_prompts=4"], "sample": ["--n", "2"]}


def readme_commands() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    return [m.strip() for m in re.findall(r"\.venv/bin/mmrl ([^`\n]+)", text)]


def test_the_readme_names_the_commands_a_user_needs():
    verbs = [c.split()[0] for c in readme_commands()]
    assert {"train", "eval", "sample", "validate", "plan"} <= set(verbs)
    assert any("--resume" in c for c in readme_commands()) and any("quickstart" in c for c in readme_commands())


@pytest.mark.slow
def test_the_readme_commands_run_as_written(tmp_path):
    for d in ("configs", "tasks", "rewards"):  # what the commands read; runs/ is written here
        os.symlink(os.path.join(ROOT, d), tmp_path / d)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    resumed = False
    for cmd in readme_commands():
        args = cmd.split()
        verb = args[0]
        extra = list(SHORT.get(verb, []))
        if "--resume" in args:  # one more iteration than the first run made
            extra = [x for x in extra if not x.startswith("train.iterations")] + ["train.iterations=2"]
            resumed = True
        r = subprocess.run([sys.executable, "-m", "mmrl.cli", *args, *extra], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"mmrl {cmd}\n{r.stderr[-3000:]}"
    assert resumed and (tmp_path / "runs" / "shapes_grpo" / "checkpoints" / "iter-000002").is_dir()
    assert (tmp_path / "runs" / "samples").is_dir() or any((tmp_path / "runs").rglob("contact_sheet.png"))
