"""Experiment trackers beside TensorBoard (log.report_to; mmrl/metrics.py, docs/trackers.md): every tracker gets
the scalars with their steps, the image grids / video strips and the completion tables, on rank 0 only; a resumed
run continues its tracker run; unknown names and missing libraries are refused with the fix.

The base install has neither library (they are extras), so most tests run against small fake `wandb` / `mlflow`
modules put in sys.modules that record what they receive; the real libraries are tested where installed (W&B in
offline mode, MLflow in its local SQLite store)."""

import glob
import importlib.machinery
import json
import os
import sys
import types
from collections import namedtuple

import pytest
import torch

from mmrl.metrics import RUN_IDS, Logger, _mlflow_key, check_report_to

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = {"train": {"lr": 1e-4, "kwargs": {}}, "task": {"name": "shapes", "prompts": ["x" * 900]}}


class Received:
    """What a fake tracker library was given: scalars by step, images and tables as (step, tag, ...), the runs
    it started (their init arguments / run ids), texts by artifact file, how often a run was closed."""

    def __init__(self):
        self.scalars, self.images, self.tables, self.starts, self.texts, self.closed = {}, [], [], [], {}, 0
        self.params: dict[str, dict] = {}  # mlflow: run id -> params

    def scalar(self, step, key, value):
        self.scalars.setdefault(step, {})[key] = value


def _module(monkeypatch, name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)  # importlib.util.find_spec finds it
    monkeypatch.setitem(sys.modules, name, m)
    return m


def fake_wandb(monkeypatch, got: Received) -> None:
    wandb = _module(monkeypatch, "wandb")

    class Image:
        def __init__(self, data, caption=None):
            self.data, self.caption = data, caption

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        def log(self, data, step):
            for k, v in data.items():
                if isinstance(v, Image):
                    got.images.append((step, k, v.data, v.caption))
                elif isinstance(v, Table):
                    got.tables.append((step, k, v.columns, v.data))
                else:
                    got.scalar(step, k, v)

        def finish(self):
            got.closed += 1

    wandb.Image, wandb.Table = Image, Table
    wandb.init = lambda **kw: got.starts.append(kw) or Run()


def fake_mlflow(monkeypatch, got: Received) -> None:
    mlflow, entities = _module(monkeypatch, "mlflow"), _module(monkeypatch, "mlflow.entities")
    entities.Metric, entities.Param = namedtuple("Metric", "key value timestamp step"), namedtuple("Param", "key value")
    ns = types.SimpleNamespace

    class MlflowClient:
        def __init__(self, tracking_uri=None):
            got.uri = tracking_uri

        def get_experiment_by_name(self, name):
            return None

        def create_experiment(self, name, artifact_location=None):
            got.experiment = (name, artifact_location)
            return "0"

        def create_run(self, experiment_id, run_name=None):
            run_id = f"run{len(got.params)}"
            got.params[run_id] = {}
            return ns(info=ns(run_id=run_id))

        def update_run(self, run_id, status=None):
            got.starts.append(run_id)

        def get_run(self, run_id):
            return ns(data=ns(params=dict(got.params[run_id])))

        def log_batch(self, run_id, metrics=(), params=()):
            got.params[run_id].update((p.key, p.value) for p in params)
            for m in metrics:
                got.scalar(m.step, m.key, m.value)

        def log_image(self, run_id, image, key=None, step=None):
            got.images.append((step, key, image, None))

        def log_text(self, run_id, text, artifact_file):
            got.texts[artifact_file] = text

        def set_terminated(self, run_id):
            got.closed += 1

    mlflow.MlflowClient = MlflowClient


FAKES = {"wandb": fake_wandb, "mlflow": fake_mlflow}


@pytest.fixture
def fake(monkeypatch):
    """fake(name) -> the Received of a fake library put in place of the real one."""
    def install(name: str) -> Received:
        got = Received()
        FAKES[name](monkeypatch, got)
        return got
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return install


def log_a_run(out, report_to, resume=None, config=CONFIG) -> None:
    """Two steps of scalars, an image grid (2 x 2 of 8 x 8), video strips (2 videos of 5 frames) and a table."""
    lg = Logger(str(out), tensorboard=False, report_to=report_to, resume=resume, config=config)
    lg.scalars(0, {"train/loss": 1.0, "perf/samples_per_s": 3.0})
    lg.images(0, "samples", torch.rand(4, 3, 8, 8) * 2 - 1, ["a", "b", "c", "d"], nrow=2)
    lg.images(1, "videos", torch.rand(2, 3, 5, 8, 8) * 2 - 1, ["v1", "v2"])
    lg.texts(1, "completions", ["p|1", "p2"], ["o\n1", "o2"], [0.5, 1.0])
    lg.scalars(1, {"train/loss": 0.5, "eval/reward_mean": 0.25})
    lg.close()


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_scalars_images_and_tables_reach_each_tracker(name, fake, tmp_path):
    got = fake(name)
    log_a_run(tmp_path, [name])
    assert got.scalars == {0: {"train/loss": 1.0, "perf/samples_per_s": 3.0},
                           1: {"train/loss": 0.5, "eval/reward_mean": 0.25}}
    assert [(step, tag, img.size) for step, tag, img, _ in got.images] == [
        (0, "samples", (2 * 9 + 1, 2 * 9 + 1)),  # a 2 x 2 grid with 1-pixel padding
        (1, "videos", (5 * 8 + 2, 2 * 9 + 1))]  # one strip of 5 frames per row
    if name == "wandb":
        assert got.images[0][3] == "row 0: a | b  \nrow 1: c | d"
        assert got.tables == [(1, "completions", ["prompt", "completion", "reward"],
                               [["p|1", "o\n1", 0.5], ["p2", "o2", 1.0]])]
        assert got.starts[0]["config"] == CONFIG and got.starts[0]["dir"] == str(tmp_path)
    else:
        assert got.uri == f"sqlite:///{tmp_path}/mlflow.db"
        assert got.experiment == ("mmrl", (tmp_path / "mlartifacts").as_uri())
        assert got.texts["samples/step_000000_prompts.md"] == "row 0: a | b  \nrow 1: c | d"
        assert got.texts["completions/step_000001.md"].splitlines()[2:] == ["| p\\|1 | o 1 | 0.500 |",
                                                                            "| p2 | o2 | 1.000 |"]
        params = got.params["run0"]
        assert params["train.lr"] == "0.0001" and params["train.kwargs"] == "{}"
        assert len(params["task.prompts"]) == 500  # MLflow's param value limit
    assert got.closed == 1


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_a_resumed_run_continues_its_tracker_run(name, fake, tmp_path):
    got = fake(name)
    Logger(str(tmp_path), report_to=[name], tensorboard=False).close()  # opened, never used: no tracker run
    Logger(str(tmp_path), report_to=[name], tensorboard=False, enabled=False).scalars(0, {"a": 1.0})  # rank 1
    assert got.starts == [] and got.closed == 0
    log_a_run(tmp_path, [name])
    log_a_run(tmp_path, [name], resume=(2, 1), config={"train": {"lr": 1e-3}})
    log_a_run(tmp_path, [name])  # a new run (--overwrite): a new tracker run
    ids = [s["id"] for s in got.starts] if name == "wandb" else got.starts
    assert ids[0] == ids[1] != ids[2] and json.load(open(tmp_path / RUN_IDS)) == {name: ids[2]}
    if name == "wandb":
        assert {s["resume"] for s in got.starts} == {"allow"}
    else:
        assert got.params[ids[0]]["train.lr"] == "0.0001"  # MLflow keeps a param's first value
    assert got.closed == 3


def test_unknown_names_and_missing_libraries_are_refused(fake, monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"unknown tracker\(s\) 'wandbb'; valid: wandb, mlflow$"):
        check_report_to(["wandbb"])
    with pytest.raises(ValueError, match=r"'trackio'; valid: wandb, mlflow; trackio is not supported"):
        Logger(str(tmp_path), report_to=["trackio"])
    with pytest.raises(ValueError, match=r"TensorBoard is log.tensorboard=true"):
        check_report_to(["tensorboard"])
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # not installed
        with pytest.raises(ImportError, match=rf"log.report_to={name} needs the {name} package: "
                                              rf"pip install 'mmrl\[{name}\]'"):
            Logger(str(tmp_path / name), report_to=[name])
        assert not os.path.exists(tmp_path / name / RUN_IDS)
    fake("wandb")
    assert check_report_to("wandb") == ["wandb"] and check_report_to(None) == []


def test_a_training_run_reports_the_same_scalars_as_metrics_jsonl(tiny_pixel_model, fake, tmp_path):
    from mmrl.compose import load_config
    from mmrl.runs import train

    got = {name: fake(name) for name in FAKES}
    out = tmp_path / "run"
    cfg = load_config(os.path.join(ROOT, "configs/tiny/flow_smoke.yaml"), [
        f"model.path={tiny_pixel_model}", f"log.out_dir={out}", "log.image_every=1", "task.eval_prompts=2",
        "train.prompts_per_iter=2", "train.group_size=2"])
    cfg.log.report_to = ["wandb", "mlflow"]  # set on the dataclass: the override log.report_to=[...] is refused
    train(cfg)  # by mmrl/config.py's type check of the bare `list` annotation
    rows = [json.loads(ln) for ln in open(out / "metrics.jsonl")]
    logged = {}  # step -> every scalar logged at it
    for r in rows:
        step, _ = r.pop("step"), r.pop("time")
        logged.setdefault(step, {}).update(r)
    assert any(k.startswith("perf/") for step in logged.values() for k in step)
    assert got["wandb"].scalars == logged
    assert got["mlflow"].scalars == {s: {_mlflow_key(k): v for k, v in d.items()} for s, d in logged.items()}
    for g in got.values():
        assert [(step, tag) for step, tag, *_ in g.images] == [(1, "samples"), (2, "samples")]  # steps = iterations done
        assert g.closed == 1
    assert got["wandb"].starts[0]["config"]["log"]["report_to"] == ["wandb", "mlflow"]


def test_real_wandb_offline(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    steps = []
    log = wandb.Run.log
    monkeypatch.setattr(wandb.Run, "log", lambda run, data, step=None, **kw: steps.append(step) or log(
        run, data, step=step, **kw))
    log_a_run(tmp_path / "run", ["wandb"])
    log_a_run(tmp_path / "run", ["wandb"], resume=(2, 1))
    run_id = json.load(open(tmp_path / "run" / RUN_IDS))["wandb"]
    runs = glob.glob(str(tmp_path / "wandb-files" / "wandb" / "offline-run-*"))  # a folder per start
    assert len(runs) == 2 and all(run_id in os.path.basename(r) for r in runs)  # one W&B run, continued
    media = {os.path.relpath(f, r + "/files/media").split("_")[0]
             for r in runs for f in glob.glob(r + "/files/media/*/*")}
    assert media == {"images/samples", "images/videos", "table/completions"}
    assert steps == [0, 0, 1, 1, 1] * 2


def test_real_mlflow_local_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    log_a_run(tmp_path, ["mlflow"])
    log_a_run(tmp_path, ["mlflow"], resume=(2, 1), config={"train": {"lr": 1e-3}})
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(json.load(open(tmp_path / RUN_IDS))["mlflow"])
    assert len(client.search_runs([run.info.experiment_id])) == 1 and run.info.status == "FINISHED"
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")) == [
        (0, 1.0), (0, 1.0), (1, 0.5), (1, 0.5)]  # a resumed run logs its steps again
    assert run.data.params["train.lr"] == "0.0001"
    files = {f.path for d in ("images", "samples", "completions") for f in client.list_artifacts(run.info.run_id, d)}
    assert "completions/step_000001.md" in files and sum(f.startswith("images/samples") for f in files) >= 2
