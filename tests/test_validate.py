"""`mmrl validate` is the whole pre-flight (mmrl/preflight.py) and user errors are one message (mmrl/cli.py): broken
configs each get every problem named with its fix, no weights load, and the time is printed (`pytest -s`); a
plain reward function and a plugin beside the config load; a reward that fails stops the start evaluation at its
first failure with its own error and traceback."""

import logging
import os
import shutil
import time

import pytest

from mmrl.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = os.path.join(ROOT, "configs/t2i/shapes_grpo.yaml")


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight load fails the test: validate must not reach one."""
    import mmrl.models.pipelines as pipelines
    import mmrl.policy.flow as flow

    def refuse(*a, **k):
        raise AssertionError("validate loaded weights")

    monkeypatch.setattr(pipelines, "load_flow_model", refuse)
    monkeypatch.setattr(flow, "load_flow_model", refuse)


def validate(capsys, *args) -> tuple[int, str, float]:
    t0 = time.time()
    rc = main(["validate", *map(str, args)])
    err = capsys.readouterr().err
    return rc, err, time.time() - t0


def broken_configs(tmp_path, tiny_pixel_model):
    """(name, args, what the message must say) for ten broken configs."""
    latin1 = tmp_path / "prompts_latin1.txt"
    latin1.write_bytes("a red circle\nun carré rouge\n".encode("latin-1"))
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train:\n  lr: [1e-4\n")
    no_transformer = tmp_path / "no_transformer"
    shutil.copytree(tiny_pixel_model, no_transformer)
    shutil.rmtree(no_transformer / "transformer")
    beside = tmp_path / "cfgdir"
    beside.mkdir()
    (beside / "prompts.txt").write_text("a red circle\n")
    (beside / "mine.yaml").write_text(f"base: {SHAPES}\ntask: {{name: prompt_file, prompt_file: prompts.txt}}\n")
    return [
        ("missing model", [SHAPES, "model.path=/no/such/model"], "model.path='/no/such/model' does not exist"),
        ("missing prompts", [SHAPES, "task.name=prompt_file", "task.prompt_file=nope.txt"],
         "task.prompt_file='nope.txt' does not exist"),
        ("bad reward kwarg", [SHAPES, "reward.kwargs={strict_wieght: 1.0}"],
         "reward.kwargs ['strict_wieght'] not understood by reward 'shapes'; valid: ['min_area'"),
        ("non-UTF-8 prompts", [SHAPES, "task.name=prompt_file", f"task.prompt_file={latin1}"],
         f"{latin1}:2: not UTF-8"),
        ("world size", [SHAPES, "--nproc", "4"], "train.parallel=none on 4 processes"),
        ("TRL name", [SHAPES, "train.learning_rate=1e-4"], "Did you mean 'train.lr'?"),
        ("bad YAML", [bad_yaml], f"{bad_yaml}:3:1: not valid YAML"),
        ("hub id", [SHAPES, "model.path=someorg/somemodel"], "not a local folder and not in the Hugging Face cache"),
        ("deleted transformer", [SHAPES, f"model.path={no_transformer}"], "the folder has no transformer/"),
        ("path beside the config", [beside / "mine.yaml"],
         f"it exists next to the config file: use task.prompt_file={beside / 'prompts.txt'}"),
        ("bad task kwarg", [SHAPES, "task.kwargs={colour: red}"], "task.kwargs ['colour'] not understood by task"),
    ]


def test_ten_broken_configs_each_named_without_loading_weights(tmp_path, tiny_pixel_model, capsys, no_weights):
    times = {}
    for name, args, says in broken_configs(tmp_path, tiny_pixel_model):
        rc, err, seconds = validate(capsys, *args)
        times[name] = round(seconds, 2)
        assert rc == 2 and says in err, f"{name}: {err}"
        assert "Traceback" not in err
    with capsys.disabled():
        print("validate seconds per broken config:", times)
    # several problems at once, each on its own line
    rc, err, _ = validate(capsys, SHAPES, "model.path=/no/such/model", "reward.kwargs={strict_wieght: 1}",
                          "--nproc", "2")
    assert rc == 2 and "3 problem(s)" in err and err.count("\n  - ") == 3
    rc, err, _ = validate(capsys, SHAPES, "train.mixed_precision=no")  # YAML's `no` is the string here
    assert rc == 0


def test_errors_are_one_message_and_debug_brings_the_traceback(capsys, monkeypatch):
    from mmrl import compose

    def no_model(*a, **k):
        raise AssertionError("a missing checkpoint must be refused before the base model is loaded and scored")

    monkeypatch.setattr(compose, "build_policy", no_model)
    assert main(["eval", SHAPES, "runs/no_such_run_here"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint 'runs/no_such_run_here' does not exist" in err and "Traceback" not in err
    with pytest.raises(FileNotFoundError):
        main(["eval", SHAPES, "runs/no_such_run_here", "--debug"])
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and "mmrl 0." in capsys.readouterr().out


def test_a_plugin_beside_the_config_and_a_plain_reward_function(tmp_path, tiny_pixel_model, capsys, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def ink(outputs, examples):\n    return (1 - outputs.float().mean((1, 2, 3))).tolist()\n\n"
        "def broken(outputs, examples):\n    raise ValueError('my reward is broken')\n")
    (tmp_path / "mine.yaml").write_text(
        f"base: {ROOT}/configs/tiny/flow_smoke.yaml\nmodel: {{path: {tiny_pixel_model}}}\n"
        f"reward: {{name: 'my_rewards:ink', kwargs: {{}}}}\n"
        f"train: {{iterations: 1, prompts_per_iter: 2, group_size: 2, minibatches: 1}}\n"
        f"task: {{eval_prompts: 2}}\nlog: {{out_dir: {tmp_path / 'run'}, tensorboard: false}}\n")
    monkeypatch.chdir(ROOT)  # not the config's folder: the command finds my_rewards.py beside the config
    assert main(["validate", str(tmp_path / "mine.yaml")]) == 0
    assert main(["train", str(tmp_path / "mine.yaml")]) == 0
    assert (tmp_path / "run" / "results.json").is_file()
    capsys.readouterr()
    logging.getLogger("mmrl").handlers.clear()
    # the start evaluation stops at the first failure with the reward's own error: a bug in the user's code, not an
    # input mmrl checks, so it keeps its traceback (the mmrl command exits 1), --debug or not
    with pytest.raises(ValueError, match="my reward is broken"):
        main(["train", str(tmp_path / "mine.yaml"), "reward.name=my_rewards:broken", f"log.out_dir={tmp_path / 'run2'}"])
    assert capsys.readouterr().err.count("reward raised") <= 1
