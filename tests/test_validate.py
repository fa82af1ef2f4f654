"""`mmrl validate` is the whole pre-flight (mmrl/preflight.py) and user errors are one message (mmrl/cli.py): broken
configs each get every problem named with its fix, no weights load, and the time is printed (`pytest -s`); a
plain reward function and a plugin beside the config load; a reward that fails stops the start evaluation at its
first failure with its own error and traceback. Every train-time input error (each `raise` of a UserError where train
builds the task, the weight-free rewards and takes the run folder, found in the source) is reported by validate with
no model built."""

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
    import mmrl.policy.flow_build as flow_build

    def refuse(*a, **k):
        raise AssertionError("validate loaded weights")

    monkeypatch.setattr(pipelines, "load_flow_model", refuse)
    monkeypatch.setattr(flow_build, "load_flow_model", refuse)


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


# ------------------------------------------------------------------ validate = train's checks, enumerated
# The input checks train runs before its first forward, beyond the config's keys (already enumerated above): where
# the task, the weight-free rewards and the run folder are built / checked. Every `raise <UserError>(...)` in these
# functions is found by reading the source (ast), so a check added there without a case below fails this test.
TRAIN_TIME_CHECKS = {
    "mmrl/task.py": None,  # every function: building task.name=prompt_file
    "mmrl/reward.py": ("weight_schedule", "MultiReward.__init__"),
    "rewards/shapes.py": ("ShapesReward.__init__",),
    "rewards/motion.py": ("MotionReward.__init__",),
    "rewards/grounding.py": ("GroundingReward.__init__",),
    "rewards/video.py": ("FrameReward.__init__",),
    "mmrl/runs.py": ("prepare_run_dir",),
    "tasks/geneval.py": ("read_metadata", "GenEvalTask.__init__"),
    "tasks/arithmetic.py": ("problems",),
}
NOT_HERE = {  # raise sites no CPU test can reach, and why
    "mmrl/task.py:read_dataset#2": "a saved DatasetDict without the split: needs the datasets library (not installed)",
    "mmrl/task.py:read_dataset#3": "a dataset without the prompt column: needs the datasets library (not installed)",
}


def raise_sites() -> list[str]:
    """'file:Class.function#k' of the k-th `raise X(...)` (X a mmrl.errors.UserError) in each TRAIN_TIME_CHECKS
    function."""
    import ast
    import importlib

    from mmrl.errors import UserError

    sites = []
    for file, names in TRAIN_TIME_CHECKS.items():
        module = importlib.import_module(file[:-3].replace("/", "."))
        tree = ast.parse(open(os.path.join(ROOT, file)).read())
        funcs = [(f"{c.name}.{f.name}", f) for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body
                 if isinstance(f, ast.FunctionDef)] + [(f.name, f) for f in tree.body if isinstance(f, ast.FunctionDef)]
        for qual, fn in funcs:
            if names is not None and qual not in names:
                continue
            raises = [n for n in ast.walk(fn) if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)
                      and isinstance(n.exc.func, ast.Name)]
            raises = [n for n in sorted(raises, key=lambda n: n.lineno)
                      if isinstance(getattr(module, n.exc.func.id, None), type)
                      and issubclass(getattr(module, n.exc.func.id), UserError)]
            sites += [f"{file}:{qual}#{k}" for k in range(1, len(raises) + 1)]
    return sites


def train_time_errors(tmp_path) -> list[tuple[str, list, str]]:
    """(raise site, validate's arguments, what validate must print) for each train-time input error."""
    t = tmp_path

    def write(name, text):
        (t / name).write_text(text) if isinstance(text, str) else (t / name).write_bytes(text)
        return t / name

    empty, two = write("empty.txt", "\n# only a comment\n"), write("two.txt", "a red circle\na blue square\n")
    one = write("one.txt", "a red circle\na red circle\n")
    bad_jsonl = write("bad.jsonl", '{"prompt": "a red circle"}\n{"prompt": "a blue square"\n')
    no_prompt = write("no_prompt.jsonl", '{"prompt": "a red circle"}\n{"text": "a blue square"}\n')
    json_file, latin1 = write("p.json", '[{"prompt": "a"}]'), write("l.txt", "un carré\n".encode("latin-1"))
    no_col, big = write("no_col.csv", "text\na red circle\n"), write("big.csv", "prompt\n" + "x" * 140_000 + "\n")
    held, changed = t / "held", t / "changed"
    held.mkdir()
    (held / "metrics.jsonl").write_text("{}\n")
    changed.mkdir()
    (changed / "config.json").write_text('{"model": {"path": "/some/other/model"}}')
    no_rows = write("no_rows.jsonl", "\n")
    pf, ge, ar = [SHAPES, "task.name=prompt_file"], [SHAPES, "task.name=geneval"], [SHAPES, "task.name=arithmetic"]
    gr = [SHAPES, "reward.name=grounding"]
    multi, comp = "reward.name=multi", "reward.kwargs={components: {s: {name: shapes, weight: %s}}}"
    return [
        ("mmrl/task.py:PromptFileTask.__init__#1", pf + [f"task.prompt_file={two}", "task.kwargs={dataset: x/y}"],
         "give task.prompt_file or task.kwargs.dataset, not both"),
        ("mmrl/task.py:PromptFileTask.__init__#2",
         pf + [f"task.prompt_file={two}", f"task.kwargs={{eval_file: {two}, heldout_fraction: 0.5}}"],
         "give task.kwargs.eval_file (a held-out file) or task.kwargs.heldout_fraction"),
        # the config check names it first (a missing eval_file: the path check), the same input error
        ("mmrl/task.py:read_prompts#1", pf, "task.name=prompt_file needs task.prompt_file=PATH"),
        ("mmrl/task.py:read_prompts#2", pf + [f"task.prompt_file={json_file}"], ".json is not read; write one object"),
        ("mmrl/task.py:read_prompts#3", pf + [f"task.prompt_file={empty}"],
         f"task.prompt_file='{empty}' has no prompts"),
        # the byte is named by validate's line-by-line UTF-8 check, which comes first (the same input error)
        ("mmrl/task.py:_decode#1", pf + [f"task.prompt_file={latin1}"], f"{latin1}:1: not UTF-8"),
        ("mmrl/task.py:jsonl_rows#1", pf + [f"task.prompt_file={bad_jsonl}"], f"{bad_jsonl}:2: not valid JSON"),
        ("mmrl/task.py:_read_csv#1", pf + [f"task.prompt_file={no_col}"], f"{no_col}:1: no 'prompt' column"),
        ("mmrl/task.py:_read_csv#2", pf + [f"task.prompt_file={big}"], "field larger than field limit"),
        ("mmrl/task.py:_example#1", pf + [f"task.prompt_file={no_prompt}"],
         f"{no_prompt}:2: expected a row with a non-empty 'prompt' string"),
        ("mmrl/task.py:read_dataset#1", pf + ["task.kwargs={dataset: x/y}"], "needs the Hugging Face datasets library"),
        ("mmrl/task.py:split_heldout#1", pf + [f"task.prompt_file={two}", "task.kwargs={heldout_fraction: 1.5}"],
         "heldout_fraction must be in (0, 1), got 1.5"),
        ("mmrl/task.py:split_heldout#2", pf + [f"task.prompt_file={one}", "task.kwargs={heldout_fraction: 0.5}"],
         "needs at least 2 distinct prompts, got 1"),
        ("mmrl/reward.py:weight_schedule#1", [SHAPES, multi, comp % ".nan"],
         "a weight must be finite"),
        ("mmrl/reward.py:weight_schedule#2", [SHAPES, multi, comp % "x"],
         "give a number or a list of [iteration, weight] points"),
        ("mmrl/reward.py:weight_schedule#3",
         [SHAPES, multi, comp % "[[5, 1], [2, 0]]"],
         "the points need iterations >= 0 in increasing order"),
        ("mmrl/reward.py:MultiReward.__init__#1", [SHAPES, multi, "reward.kwargs={components: {}}"],
         "reward.name=multi needs reward.kwargs.components"),
        ("mmrl/reward.py:MultiReward.__init__#2", [SHAPES, multi, "reward.kwargs={components: {a/b: {name: shapes}}}"],
         "reward component label 'a/b' must not contain '/'"),
        ("rewards/shapes.py:ShapesReward.__init__#1", [SHAPES, "reward.kwargs={strict_weight: 2}"],
         "strict_weight must be in [0, 1], got 2"),
        ("rewards/motion.py:MotionReward.__init__#1",
         [SHAPES, "reward.name=motion", "reward.kwargs={correct_weight: 2}"],
         "correct_weight must be in [0, 1], got 2"),
        ("rewards/grounding.py:GroundingReward.__init__#1", gr + ["reward.kwargs={accuracy: f1}"],
         "accuracy must be 'iou' or 'iou_v2', got 'f1'"),
        ("rewards/grounding.py:GroundingReward.__init__#2", gr + ["reward.kwargs={coarse: x}"],
         "coarse must be one of"),
        ("rewards/grounding.py:GroundingReward.__init__#3",
         gr + ["reward.kwargs={hit_threshold: 0}"], "hit_threshold must be in (0, 1], got 0"),
        ("rewards/video.py:FrameReward.__init__#1",
         [SHAPES, "reward.name=video_frames", "reward.kwargs={reward: shapes, agg: max}"], "FrameReward agg='max'"),
        ("tasks/geneval.py:read_metadata#1", ge + [f"task.kwargs={{metadata: {t / 'nope.jsonl'}}}"],
         f"task.kwargs.metadata='{t / 'nope.jsonl'}' does not exist; give a GenEval"),
        ("tasks/geneval.py:read_metadata#2", ge + [f"task.kwargs={{metadata: {no_rows}}}"],
         f"{no_rows} has no metadata rows"),
        ("tasks/geneval.py:GenEvalTask.__init__#1", ge + [f"task.prompt_file={two}"],
         "task.name=geneval reads GenEval metadata from task.kwargs.metadata"),
        ("tasks/geneval.py:GenEvalTask.__init__#2", ge + ["task.kwargs={tags: [colour_fun]}"],
         "task.kwargs.tags has ['colour_fun']"),
        ("tasks/arithmetic.py:problems#1", ar + ["task.kwargs={ops: '+%'}"], "ops='+%': unknown operators ['%']"),
        ("tasks/arithmetic.py:problems#2", ar + ["task.kwargs={lo: 50, hi: 10}"], "operand range [50, 10] is empty"),
        ("mmrl/runs.py:prepare_run_dir#1", [SHAPES, f"log.out_dir={held}", "--resume", "--overwrite"],
         "--resume continues the run in log.out_dir and --overwrite deletes it: give one"),
        ("mmrl/runs.py:prepare_run_dir#2", [SHAPES, f"log.out_dir={held}"],
         f"log.out_dir='{held}' already holds a run (logs, no checkpoint). Continue it with --resume"),
        ("mmrl/runs.py:prepare_run_dir#3", [SHAPES, f"log.out_dir={changed}", "--resume"],
         "--resume with a config that changes the saved state"),
    ]


def test_every_train_time_input_error_is_reported_by_validate_without_a_model(tmp_path, capsys, no_weights,
                                                                               monkeypatch):
    from mmrl import compose

    monkeypatch.setattr(compose, "build_policy", lambda *a, **k: pytest.fail("validate built the policy"))
    cases = train_time_errors(tmp_path)
    sites = raise_sites()
    covered = [c[0] for c in cases] + list(NOT_HERE)
    assert sorted(covered) == sorted(sites), f"raise sites without a case: {sorted(set(sites) - set(covered))}; " \
        f"cases without a site: {sorted(set(covered) - set(sites))}"
    for site, args, says in cases:
        rc, err, _ = validate(capsys, *args)
        assert rc == 2 and says in err and "Traceback" not in err, f"{site}: {err}"
    with capsys.disabled():
        print(f"\n{len(cases)} train-time input errors, each reported by validate ({len(NOT_HERE)} raise sites need "
              f"the datasets library)")


def test_settings_that_contradict_a_component_are_refused_by_its_declaration(tmp_path, tiny_pixel_model, capsys,
                                                                               no_weights):
    """Combinations that used to fail only after the model loaded (or trained the wrong thing) are refused by
    `mmrl validate` in one line naming the fix, written from the components' declarations: a forward-process
    objective under CFG (composed from the SD3.5 GenEval recipe), a weighting / KL that reads flow statistics on a
    token policy. algo.kl=auto resolves from the same declarations."""
    from mmrl.compose import load_config

    token = os.path.join(ROOT, "configs/grounding/synthetic_grpo.yaml")
    cases = [
        ([os.path.join(ROOT, "configs/t2i/sd35_geneval_lora.yaml"), "algo.objective.name=nft",
          f"model.path={tiny_pixel_model}"], "set sampler.cfg_scale=1"),
        ([os.path.join(ROOT, "configs/t2i/shapes_awm.yaml"), "sampler.cfg_scale=4.0"], "set sampler.cfg_scale=1"),
        ([token, "algo.weighting=tempflow"], "set algo.weighting to one of ['none']"),
        ([token, "algo.kl_coef=0.1", "algo.kl=flow_mean", "model.reference=auto"], "set algo.kl to one of"),
    ]
    for args, fix in cases:
        rc, err, _ = validate(capsys, *args)
        lines = [line for line in err.splitlines() if fix in line]  # a config error, or the one problem preflight lists
        assert rc == 2 and len(lines) == 1 and ("mmrl validate: error" in err or "1 problem(s)" in err), (args, err)
    assert load_config(token, ["algo.kl_coef=0.1", "model.reference=auto"]).algo.kl == "k3"
    assert load_config(os.path.join(ROOT, "configs/t2i/shapes_nft.yaml"), ["algo.kl=auto"]).algo.kl == "flow_velocity"
    assert load_config(SHAPES, ["algo.kl_coef=0.1"]).algo.kl == "flow_mean"
