"""`mmrl validate` and the start of `mmrl train`: everything that can be checked before a weight loads, every problem
listed at once, in seconds.

What is checked beyond the config's keys, types and registry names (mmrl.compose.load_config):
- model.path (built-in policies): a folder (or a Hugging Face id already in the local cache) whose model_index.json / config.json
  reads, with every component folder model_index.json names;
- every file the task and the rewards name (task.prompt_file, task.kwargs *_file / annotations / *_dir /
  durations, reward kwargs *_path / *_dir / *_file): exists; prompt files are UTF-8 (file:line of a bad byte);
- every reward / task kwarg is one its factory takes (nested rewards and judges too);
- the multi-process rules for N processes (mmrl.parallel.distributed.check_parallel_config);
- `mmrl validate` builds the task as train does (compose.build_task: an empty prompt file, a JSONL line that is not
  JSON, a CSV without its prompt column, a held-out split that cannot be made ... fail here; `mmrl train` builds it
  once, first thing in the Trainer, before any weights load), except a task that writes its data (`writes_files = True`: the grounding world renders videos once, on
  rank 0); the rewards whose building loads no weights are built too (LIGHT_REWARDS, a plain reward function,
  reward.name=multi of those): their value checks (a weight out of [0, 1], a bad schedule) fail here;
- with `run_dir=(resume, overwrite)` (`mmrl validate --resume / --overwrite`), log.out_dir as train would take it
  (mmrl.runs.prepare_run_dir, read-only here): a folder holding a run without --resume / --overwrite, or
  --resume with a config that changes the saved state.
Left to train: what needs the model itself (model.lora modules that match no layer, a policy with nothing to train)
and rewards that load a model to build (CLIP-like scorers, VLM judges: their kwargs and paths are checked above).

Paths in a config are relative to the working directory (where mmrl runs); only `base:` is relative to the config
file. A path that is missing there but exists next to the config file is reported with that fix.
"""

from __future__ import annotations

import inspect
import json
import os

from mmrl import compose
from mmrl.config import Config
from mmrl.policy.kinds import kind_of
from mmrl.parallel.distributed import check_parallel_config
from mmrl.errors import ConfigError, MissingFile, UserError
from mmrl.metrics import check_report_to
from mmrl.policy.base import is_hub_id, resolve_model_path
from mmrl.reward import REWARDS, plain_function_args
from mmrl.task import TASKS

PATH_SUFFIXES = ("_file", "_path", "_dir", "annotations", "durations")
NOT_PATHS = ("root", "dataset")  # created by the task (grounding_world's root) or a datasets name
# built-in rewards whose building is value checks only (no weights, no network): validate builds them as train does
LIGHT_REWARDS = ("shapes", "motion", "grounding", "arithmetic", "preference_label", "video_frames", "multi")


def check(cfg: Config, nproc: int = 1, config_path: str | None = None,
          run_dir: tuple[bool, bool] | None = None) -> list[str]:
    """Every problem of `cfg` found without loading weights, each naming the key or file and the fix. run_dir:
    (resume, overwrite) to check log.out_dir as train would (validate; train checks it itself, mmrl/runs.py)."""
    problems: list[str] = []

    def run(fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except UserError as e:  # an input check; anything else is a bug and keeps its traceback
            problems.append(str(e))
            return False

    # a builder may carry its own config checks (janus: the keys it reads); a user's own policy without them reads
    # model.path its own way
    policy_check = getattr(compose.POLICIES[cfg.model.policy], "check_config", None)
    if policy_check is not None:
        run(policy_check, cfg)
    if kind_of(cfg.model.policy) is not None or policy_check is not None:
        run(_check_model, cfg, config_path)
    files_ok = run(_check_path, "task.prompt_file", cfg.task.prompt_file, config_path, True) \
        if cfg.task.prompt_file else True
    if run(_check_kwargs, compose.TASKS, cfg.task.name, cfg.task.kwargs, "task", config_path) and files_ok \
            and run_dir is not None and not getattr(TASKS[cfg.task.name], "writes_files", False):
        run(compose.build_task, cfg.task)  # validate: what train builds first (train builds it itself, once)
    for key in ("name", "eval_name"):
        name = getattr(cfg.reward, key)
        if name:
            kwargs = cfg.reward.kwargs if key == "name" else cfg.reward.eval_kwargs
            where = "reward" if key == "name" else "reward.eval"
            if run(_check_kwargs, compose.REWARDS, name, kwargs, where, config_path) and _light(name, kwargs):
                run(compose.build_reward, name, kwargs, where)
    run(check_parallel_config, cfg, nproc)
    run(check_report_to, cfg.log.report_to)
    if run_dir is not None:
        from mmrl.runs import prepare_run_dir

        run(prepare_run_dir, cfg, *run_dir, False)  # main=False: nothing deleted, nothing written
    return problems


def _light(name: str, kwargs: dict | None) -> bool:
    """Whether building reward `name` loads nothing: a plain function, or a LIGHT_REWARDS one whose wrapped rewards
    (reward=..., reward.name=multi's components) are light too; a judge (a VLM) never is."""
    kwargs, factory = kwargs or {}, REWARDS[name]
    if plain_function_args(factory):
        return True
    if name not in LIGHT_REWARDS:
        return False
    params = inspect.signature(factory).parameters
    wrapped = {key: kwargs.get(key, params[key].default if key in params else None) for key in ("reward", "judge")}
    if isinstance(wrapped["judge"], str):  # a judge is a VLM
        return False
    inner = [(wrapped["reward"], kwargs.get("reward_kwargs"))] if isinstance(wrapped["reward"], str) else []
    inner += [((spec or {}).get("name", label), (spec or {}).get("kwargs"))
              for label, spec in (kwargs.get("components") or {}).items()]
    return all(_light(n, k) for n, k in inner)


def _check_model(cfg: Config, config_path: str | None) -> None:
    path = cfg.model.path
    if not os.path.exists(path):
        if not is_hub_id(path):  # a missing folder
            _check_path("model.path", path, config_path)
        path = resolve_model_path(path)
    for name in ("model_index.json", "config.json"):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            try:
                index = json.load(open(f, encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise ConfigError(f"{f} does not read as JSON ({e}): the model folder is damaged") from None
            if name == "model_index.json":  # a diffusers pipeline: each component's folder
                from mmrl.models.families import family_for  # (imported here: diffusers loads in seconds)
                from mmrl.models.pipelines import missing_parts

                family_for(index.get("_class_name"), cfg.model.family, where=f)  # a family loads it
                missing = missing_parts(path, index)
                if missing:
                    raise MissingFile(f"model.path={path!r}: model_index.json names {missing}, but the folder "
                                      f"has no {', '.join(m + '/' for m in missing)}; copy the whole pipeline")
            return
    if os.path.isfile(os.path.join(path, "mmrl_policy.json")):
        raise ConfigError(f"model.path={path!r} is an mmrl policy checkpoint; set model.path to a base model folder "
                          f"(export the checkpoint with `mmrl export` to train on from it)")
    kind = kind_of(cfg.model.policy)
    want = kind.model_folder if kind is not None else "config.json (a transformers model)"
    raise MissingFile(f"model.path={path!r} has no {want}: point it at the model's folder")


def _check_path(key: str, path: str, config_path: str | None, text: bool = False) -> None:
    if not os.path.exists(path):
        near = os.path.join(os.path.dirname(config_path), path) if config_path and not os.path.isabs(path) else None
        hint = f"; it exists next to the config file: use {key}={os.path.abspath(near)}" \
            if near and os.path.exists(near) else ""
        raise MissingFile(f"{key}={path!r} does not exist (paths in a config are relative to the working "
                          f"directory {os.getcwd()}; only base: is relative to the config file){hint}")
    if text and os.path.isfile(path):
        with open(path, "rb") as f:
            for i, line in enumerate(f, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(f"{path}:{i}: not UTF-8 (byte {e.start + 1} of the line); save {key} as "
                                      f"UTF-8") from None


def _check_kwargs(registry, name: str, kwargs: dict, where: str, config_path: str | None) -> None:
    """compose.check_kwargs (every kwarg taken, nested ones too), and the path-like values exist."""

    def path(key: str, value) -> None:
        leaf = key.rsplit(".", 1)[-1]
        if isinstance(value, str) and value and leaf.endswith(PATH_SUFFIXES) and leaf not in NOT_PATHS \
                and not _cached_hub_id(value):
            _check_path(key, value, config_path, text=leaf.endswith(("_file", "annotations")))

    compose.check_kwargs(registry, name, kwargs, where, path)


def _cached_hub_id(value: str) -> bool:
    if not is_hub_id(value) or os.path.exists(value):
        return False
    try:
        resolve_model_path(value)
        return True
    except FileNotFoundError:
        return False
