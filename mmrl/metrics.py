"""Logging: TensorBoard event files (offline) + a JSONL copy of every scalar, image grids with prompts,
completion tables for token policies; the same to the experiment trackers named in log.report_to (W&B, MLflow;
docs/trackers.md)."""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
import json
import logging
import os
import pathlib
import re
import threading
import time
import uuid

import torch

from mmrl.config import flat
from mmrl.errors import ConfigError, MissingDependency

log = logging.getLogger(__name__)


def video_strips(videos: torch.Tensor, max_frames: int = 8) -> torch.Tensor:
    """[N, 3, F, H, W] -> [N, 3, H, F' * W]: F' <= max_frames evenly spaced frames side by side."""
    f = videos.shape[2]
    idx = torch.linspace(0, f - 1, min(f, max_frames)).round().long()
    return videos[:, :, idx].permute(0, 1, 3, 2, 4).flatten(3)


def _after_event_files(tb_dir: str) -> None:
    """Wait until the clock's second is past the creation second of every event file in `tb_dir`. TensorBoard reads
    a folder's files in name order (events.out.tfevents.<second>.<host>.<pid>.<counter>, the counter compared as
    text), and a resumed run's purge of the steps after its checkpoint only drops events of the files read before
    its own: a file of the same second could sort after it (counter 10 before 9) and keep what was purged."""
    seconds = [int(f.split(".")[3]) for f in os.listdir(tb_dir) if f.startswith("events.out.tfevents.")] \
        if os.path.isdir(tb_dir) else []
    while seconds and int(time.time()) <= max(seconds):
        time.sleep(0.05)


class Logger:
    """metrics.jsonl (every scalar, one JSON line per call) and TensorBoard under `out_dir`.

    resume: (lines, step) of the checkpoint a resumed run starts from: metrics.jsonl is cut back to the `lines`
    lines written before that checkpoint (what a killed run logged after it goes), and TensorBoard drops its
    events from `step` on (purge_step), then gets the kept lines at or after `step` again (an evaluation logged
    just before the save). No step is ever logged twice.

    report_to: the trackers (TRACKERS) that get the same scalars, image grids / video strips and completion
    tables; `config` (the run's Config or a dict) is their run config. With `resume` they continue the tracker
    run of the run folder (RUN_IDS)."""

    def __init__(self, out_dir: str, tensorboard: bool = True, enabled: bool = True,
                 resume: tuple[int, int] | None = None, report_to: list[str] = (), config=None):
        self.jsonl = self.tb = None
        self.lines = 0  # lines in metrics.jsonl (saved with each checkpoint)
        self.report_to: list[str] = []
        self._trackers: list[Tracker] | None = None  # started at their first use (the `trackers` property)
        if not enabled:  # ranks other than 0 of a multi-process run log nothing
            return
        self.report_to = check_report_to(report_to)
        self._tracker_args = (out_dir, _config_dict(config), resume is not None)
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "metrics.jsonl")
        kept = _truncate_lines(path, resume[0], resume[1]) if resume else []
        self.lines = len(kept) if resume else _count_lines(path)
        self.jsonl = open(path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            if resume:
                _after_event_files(os.path.join(out_dir, "tb"))
            self.tb = SummaryWriter(os.path.join(out_dir, "tb"), purge_step=resume[1] if resume else None)
            for row in kept:
                if row.get("step", -1) >= resume[1]:
                    for k, v in row.items():
                        if k not in ("step", "time"):
                            self.tb.add_scalar(k, v, row["step"])

    @property
    def trackers(self) -> list[Tracker]:
        """The report_to trackers, started at their first use: the trainer opens a Logger, then reopens it with
        `resume` when it continues a run; a tracker run started by the first one would be a new, empty one."""
        if self._trackers is None:
            self._trackers = [TRACKERS[name](*self._tracker_args) for name in self.report_to]
        return self._trackers

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.jsonl is None:
            return
        values = {k: float(v) for k, v in values.items()}
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self.jsonl.flush()
        self.lines += 1
        if self.tb:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        for t in self.trackers:
            t.scalars(step, values)

    def samples(self, step: int, outputs, examples: list[dict], rewards: torch.Tensor, group_size: int,
                limit: int = 32) -> None:
        """The first `limit` samples of a rollout: an image grid / video strips with their prompts (one group per
        row), or a table of completions with prompts and rewards."""
        k = min(len(examples), limit)
        prompts = [e["prompt"] for e in examples[:k]]
        if isinstance(outputs, torch.Tensor):
            self.images(step, "samples", outputs[:k], prompts, nrow=group_size)
        else:
            self.texts(step, "samples", prompts, list(outputs[:k]), rewards[:k].tolist())

    def images(self, step: int, tag: str, images: torch.Tensor, captions: list[str], nrow: int = 8) -> None:
        """images [N, 3, H, W] in [-1, 1] -> one grid image, and the captions in grid order as text.
        Videos [N, 3, F, H, W] become strips of at most 8 evenly spaced frames, one video per row."""
        if not self.tb and not self.trackers:
            return
        from torchvision.transforms.functional import to_pil_image
        from torchvision.utils import make_grid

        if images.dim() == 5:
            images, nrow = video_strips(images), 1
        grid = make_grid((images.detach().float().cpu().clamp(-1, 1) + 1) / 2, nrow=nrow, padding=1, pad_value=1.0)
        rows = [" | ".join(captions[i:i + nrow]) for i in range(0, len(captions), nrow)]
        caption = "  \n".join(f"row {r}: {t}" for r, t in enumerate(rows))
        if self.tb:
            self.tb.add_image(tag, grid, step)
            self.tb.add_text(tag + "/prompts", caption, step)
        if self.trackers:
            image = to_pil_image(grid)
            for t in self.trackers:
                t.image(step, tag, image, caption)

    def texts(self, step: int, tag: str, prompts: list[str], outputs: list[str], rewards: list[float]) -> None:
        """Completions with their prompts and rewards, as one table."""
        columns, rows = ["prompt", "completion", "reward"], [list(r) for r in zip(prompts, outputs, rewards)]
        if self.tb:
            self.tb.add_text(tag, markdown_table(columns, rows), step)
        for t in self.trackers:
            t.table(step, tag, columns, rows)

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        for t in self._trackers or ():
            t.close()
        self._trackers = []


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A markdown table; floats with 3 decimals, `|` and newlines in cells escaped."""
    def cell(x) -> str:
        return f"{x:.3f}" if isinstance(x, float) else str(x).replace("|", "\\|").replace("\n", " ")

    return "\n".join("| " + " | ".join(map(cell, r)) + " |" for r in [columns, ["---"] * len(columns), *rows])


# ---------------------------------------------------------------------- experiment trackers (log.report_to)

RUN_IDS = "trackers.json"  # in the run folder: {tracker name: its run id}, continued by a resumed mmrl run


class Tracker(abc.ABC):
    """An experiment tracker beside TensorBoard: gets what the Logger logs, on rank 0 only. Its __init__(out_dir,
    config dict, resume) starts its run, or continues the folder's one when resuming (_run_id); `package` is the
    library it needs, from the extra of the same name: pip install 'mmrl[<name>]'."""

    package = ""

    @abc.abstractmethod
    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    @abc.abstractmethod
    def image(self, step: int, tag: str, image, caption: str) -> None:
        """`image`: a PIL image (a grid of samples, or of video strips); `caption`: the prompts, row by row."""

    @abc.abstractmethod
    def table(self, step: int, tag: str, columns: list[str], rows: list[list]) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


def _run_id(out_dir: str, name: str, resume: bool, new_id) -> str:
    """The id of `name`'s run for this run folder: the kept one when resuming (where there is one), else new_id()
    (then kept in RUN_IDS for a later resume)."""
    path, ids = os.path.join(out_dir, RUN_IDS), {}
    if os.path.isfile(path):
        with open(path) as f:
            ids = json.load(f)
    if resume and name in ids:
        return ids[name]
    ids[name] = new_id()
    with open(path, "w") as f:
        json.dump(ids, f, indent=2)
    return ids[name]


class WandbTracker(Tracker):
    """Weights & Biases: project $WANDB_PROJECT (else "mmrl"), the run named after the run folder, its files in
    $WANDB_DIR (else the run folder)/wandb; WANDB_MODE=offline keeps everything there (`wandb sync` uploads it)."""

    package = "wandb"

    def __init__(self, out_dir: str, config: dict, resume: bool):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "mmrl", name=_run_name(out_dir),
                              dir=os.environ.get("WANDB_DIR") or out_dir, resume="allow",
                              config=config, allow_val_change=True,  # settings changed on --resume
                              id=_run_id(out_dir, "wandb", resume, lambda: uuid.uuid4().hex[:12]))

    def scalars(self, step, values):
        self.run.log(values, step=step)

    def image(self, step, tag, image, caption):
        self.run.log({tag: self.wandb.Image(image, caption=caption)}, step=step)

    def table(self, step, tag, columns, rows):
        self.run.log({tag: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self):
        self.run.finish()


class MlflowTracker(Tracker):
    """MLflow, local first: the server of $MLFLOW_TRACKING_URI where it is set, else a SQLite store in the run
    folder (mlflow.db, artifacts in mlartifacts/; MLflow 3 refuses plain mlruns/ folders); experiment
    $MLFLOW_EXPERIMENT_NAME (else "mmrl"); the config as params (flattened, values cut to PARAM_CHARS)."""

    package = "mlflow"
    PARAM_CHARS = 500  # the longest param value every MLflow server accepts (newer ones take 6000)

    def __init__(self, out_dir: str, config: dict, resume: bool):
        import mlflow
        from mlflow.entities import Metric, Param

        self.Metric, out = Metric, pathlib.Path(out_dir).absolute()
        local = not os.environ.get("MLFLOW_TRACKING_URI")
        self.client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}" if local else None)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "mmrl"
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            name, artifact_location=(out / "mlartifacts").as_uri() if local else None)
        new_run = lambda: self.client.create_run(exp_id, run_name=_run_name(out_dir)).info.run_id  # noqa: E731
        self.run_id = _run_id(out_dir, "mlflow", resume, new_run)
        self.client.update_run(self.run_id, status="RUNNING")
        logged = self.client.get_run(self.run_id).data.params  # a resumed run keeps its first values
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:self.PARAM_CHARS])
                                                   for k, v in flat(config).items() if k not in logged])

    def scalars(self, step, values):
        ms = int(time.time() * 1000)
        metrics = [self.Metric(_mlflow_key(k), v, ms, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def image(self, step, tag, image, caption):
        self.client.log_image(self.run_id, image, key=_mlflow_key(tag), step=step)
        self.client.log_text(self.run_id, caption, f"{tag}/step_{step:06d}_prompts.md")

    def table(self, step, tag, columns, rows):
        self.client.log_text(self.run_id, markdown_table(columns, rows), f"{tag}/step_{step:06d}.md")

    def close(self):
        self.client.set_terminated(self.run_id)


TRACKERS: dict[str, type[Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}
NOT_TRACKERS = {"tensorboard": "TensorBoard is log.tensorboard=true, on by default",
                "trackio": "trackio is not supported: it needs pillow<13 and mmrl pins pillow 13; mlflow is the "
                           "local-first tracker"}


def check_report_to(names) -> list[str]:
    """log.report_to checked before anything starts: a name not in TRACKERS -> ValueError listing them; a tracker
    whose library is not installed -> ImportError naming its extra. Returns the names (one string is one name)."""
    names = list(dict.fromkeys([names] if isinstance(names, str) else names or []))
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        hints = "".join(f"; {NOT_TRACKERS[n]}" for n in unknown if n in NOT_TRACKERS)
        raise ConfigError(f"log.report_to: unknown tracker(s) {', '.join(map(repr, unknown))}; valid: "
                          f"{', '.join(TRACKERS)}{hints}")
    for n in names:
        if importlib.util.find_spec(TRACKERS[n].package) is None:
            raise MissingDependency(f"log.report_to={n} needs the {TRACKERS[n].package} package: pip install 'mmrl[{n}]'")
    return names


def _run_name(out_dir: str) -> str:
    return os.path.basename(os.path.abspath(out_dir))


def _config_dict(config) -> dict:
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config or {})


def _mlflow_key(key: str) -> str:
    """MLflow keys take letters, digits and _ - . / and spaces: anything else becomes _."""
    return re.sub(r"[^\w\-. /]", "_", key)


def _count_lines(path: str) -> int:
    if not os.path.isfile(path):
        return 0
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _truncate_lines(path: str, n: int | None, step: int) -> list[dict]:
    """Cut the JSONL file at `path` back to its first n lines (a partial last line of a killed run goes too), but
    keep an evaluation at the checkpoint's own `step` logged after it: it scored the checkpoint's weights (a finished
    run evaluates after its last save; extended with --resume and more train.iterations, it would lose that point).
    n None (a checkpoint from before the count was saved): the lines logged before `step`. Returns them parsed."""
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        lines = [ln for ln in f.readlines() if ln.endswith(b"\n")]
    if n is None:
        lines = [ln for ln in lines if json.loads(ln).get("step", 0) < step]
    else:
        lines = lines[:n] + [ln for ln in lines[n:] if _evaluation_at(json.loads(ln), step)]
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.writelines(lines)
    os.replace(tmp, path)
    return [json.loads(ln) for ln in lines]


def _evaluation_at(row: dict, step: int) -> bool:
    """A metrics line with only evaluation scalars (eval/..., eval_by_category/...) at `step`."""
    keys = [k for k in row if k not in ("step", "time")]
    return row.get("step") == step and bool(keys) and all(k.startswith("eval") for k in keys)


def perf(t, seconds: float) -> dict:
    """Samples per second of an iteration, and the accelerator's peak memory so far (GiB) where there is one."""
    out = {"perf/iteration_s": seconds, "perf/samples_per_s": t.prompts_per_iter * t.group_size / max(seconds, 1e-9)}
    if torch.cuda.is_available():
        out["perf/gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


class Pulse:
    """`say()` every `every` seconds from a daemon thread while the block runs (the first after `every` seconds), so
    long work shows a line in a log file; the thread is joined on exit, so no line comes after the block."""

    def __init__(self, say, every: float, enabled: bool = True):
        self.say, self.every, self.enabled, self.stop, self.thread = say, every, enabled, threading.Event(), None

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            self.say()

    def __enter__(self):
        if self.enabled:
            self.thread = threading.Thread(target=self._run, name="pulse", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


class Timer:
    """Accumulates wall time per phase: `with timer("rollout"): ...`; `timer.pop()` -> {"time/rollout": s};
    `timer.phase`: the innermost phase running now (None between phases)."""

    def __init__(self):
        self.t: dict[str, float] = {}
        self.running: list[str] = []

    @property
    def phase(self) -> str | None:
        return self.running[-1] if self.running else None

    def __call__(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()
                timer.running.append(name)

            def __exit__(self, *exc):
                timer.running.pop()
                timer.t[name] = timer.t.get(name, 0.0) + time.perf_counter() - self.t0

        return _Ctx()

    def pop(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.t.items()}
        self.t = {}
        return out


def per_category(examples: list[dict], rewards: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """{"reward_by_category/<c>": mean reward of the valid samples whose example has category c}."""
    cats = [e.get("category") for e in examples]
    out = {}
    for c in sorted({c for c in cats if c}):
        m = torch.tensor([x == c for x in cats]) & valid
        if m.any():
            out[f"reward_by_category/{c}"] = rewards[m].mean().item()
    return out


class SignalWatch:
    """No run goes on training on nothing: an iteration whose failed rewards exceed reward.max_failed_fraction
    stops the run, naming the reward and the fix; advantages that stay all zero (constant rewards in every
    group) are warned about every `patience` iterations (train.zero_signal_patience)."""

    def __init__(self, reward_cfg, task_name: str, patience: int):
        self.reward_cfg, self.task_name, self.patience = reward_cfg, task_name, patience
        self.zero_iters = 0  # iterations in a row whose advantages were all zero

    def __call__(self, valid: torch.Tensor, adv: torch.Tensor, last_error: str | None) -> None:
        r, n = self.reward_cfg, len(valid)
        failed = int((~valid).sum())
        if failed > r.max_failed_fraction * n:
            raise RuntimeError(
                f"reward {r.name!r} failed on {failed} of {n} samples this iteration (reward.max_failed_fraction="
                f"{r.max_failed_fraction}); last error: {last_error or 'NaN/inf scores'}. Fix: use a reward that "
                f"scores this task's outputs (task.name={self.task_name!r}), fix the reward's inputs, or raise "
                f"reward.max_failed_fraction to tolerate it")
        self.zero_iters = self.zero_iters + 1 if not bool((adv[valid] != 0).any()) else 0
        if self.patience and self.zero_iters >= self.patience and self.zero_iters % self.patience == 0:
            log.warning("NO LEARNING SIGNAL: every advantage has been 0 for %d iterations (each group's rewards are "
                        "equal). Check the reward on these outputs, raise train.group_size or sampler.noise_level, or "
                        "set algo.dynamic_sampling=true", self.zero_iters)
