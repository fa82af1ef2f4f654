"""Reading configs: YAML files (which may name a `base:` file, relative to themselves) and `key=value` overrides,
built into the typed schema of mmrl/config.py. Unknown keys fail with the valid ones (and other frameworks' names
with mmrl's), keys that moved with their new form (MOVED), values are coerced to the schema's types, YAML 1.2
booleans only. A run's saved config.json written before a key moved is translated, with a warning.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os
import re
import types
import typing
from typing import Any

import yaml

from mmrl.config import AlgoConfig, Config
from mmrl.errors import ConfigError, MissingFile

log = logging.getLogger(__name__)

# other frameworks' names (TRL's GRPOConfig, diffusers' training scripts) -> mmrl's key
OTHER_NAMES = {"learning_rate": "train.lr", "num_generations": "train.group_size", "beta": "algo.kl_coef",
               "epsilon": "algo.clip_range", "num_iterations": "train.inner_epochs",
               "max_completion_length": "sampler.max_new_tokens", "gradient_accumulation_steps": "train.grad_accum",
               "max_grad_norm": "train.max_grad_norm", "num_train_epochs": "train.iterations",
               "output_dir": "log.out_dir", "seed": "train.seed", "bf16": "train.mixed_precision=bf16",
               "loss_type": "algo.loss_agg", "scale_rewards": "algo.advantage",
               "num_inference_steps": "sampler.num_steps", "guidance_scale": "sampler.cfg_scale", "lora_rank": "model.lora.rank", "rank": "model.lora.rank",
               "pretrained_model_name_or_path": "model.path", "model_name_or_path": "model.path"}


# Keys that left the schema -> (their new place, the registry entries they belong to; () = any). A loss is named once,
# with its own knobs beside it (algo.objective: {name, kwargs}); so is a reward shaping (algo.shaping: {name, kwargs});
# the objective's optional terms are algo.objective.tis_cap / sft_coef.
MOVED = {
    "algo.policy_loss": ("algo.objective.name", ()),
    "algo.reward_shaping": ("algo.shaping.name", ()),
    "algo.dpo_beta": ("algo.objective.kwargs.dpo_beta", ("dpo",)),
    "algo.dgpo_beta": ("algo.objective.kwargs.dgpo_beta", ("dgpo",)),
    "algo.dppo_kl_threshold": ("algo.objective.kwargs.dppo_kl_threshold", ("flow_dppo",)),
    "algo.nft_beta": ("algo.objective.kwargs.nft_beta", ("nft", "awm_anchored")),
    "algo.tis_cap": ("algo.objective.tis_cap", ()),
    "algo.sft_coef": ("algo.objective.sft_coef", ()),
    "algo.shaping_tau": ("algo.shaping.kwargs.tau", ("tempsamp",)),
    "algo.shaping_alpha": ("algo.shaping.kwargs.alpha", ("tempsamp",)),
    "algo.tgrpo_alpha": ("algo.shaping.kwargs.alpha", ("tgrpo",)),
    "algo.tgrpo_mu": ("algo.shaping.kwargs.mu", ("tgrpo",)),
    "algo.tgrpo_threshold": ("algo.shaping.kwargs.threshold", ("tgrpo",)),
}
RENAMED = {("model", "policy"): {"vlm": "token"}}  # values renamed: (section, key) -> {old: new}
SAVED_CONFIG = "config.json"  # the name of a run's saved config (mmrl/runs.py, checkpoints): translated, not refused


def _upgrade(data: dict, saved: bool) -> tuple[dict, list[str], list[str], list[str]]:
    """(data with MOVED keys in their new places, "old moved to new" notes, unread keys' notes, touched sections).
    A knob goes to its entry only if the config names that entry (or names none: then the knob's own, e.g. nft for
    algo.nft_beta; `saved`, a run's config.json: none is guessed); otherwise it is unread (the old schema ignored it).
    The old objective's kwargs that are algo.* keys now (clip_range, adv_clip: knobs several components read) move
    there."""
    algo = data.get("algo")
    if not isinstance(algo, dict) or not any(f"algo.{k}" in MOVED for k in algo):
        return data, [], [], []
    algo, moved, unread, touched = copy.deepcopy(algo), [], [], []
    sections = {s: dict(algo.get(s) or {}) for s in ("objective", "shaping")}
    for old, (new, owners) in sorted(MOVED.items(), key=lambda kv: not kv[1][0].endswith(".name")):  # names first
        key = old.split(".", 1)[1]
        if key not in algo:
            continue
        value, (section, *rest) = algo.pop(key), new.split(".")[1:]
        sec = sections[section]
        touched += [section] if section not in touched else []
        if rest == ["name"]:  # an old algo.objective.name wins over a policy_loss left at its default
            sec["name"] = value if sec.get("name") is None or value not in ("ppo_clip", "none") else sec["name"]
        elif owners and sec.setdefault("name", None if saved else owners[0]) not in owners:
            unread.append(f"{old}={value} (a knob of {' / '.join(owners)}, not of {sec['name']})")
            continue
        elif owners:
            sec["kwargs"] = {**(sec.get("kwargs") or {})}
            sec["kwargs"].setdefault(rest[1], value)  # the old sub-config's kwargs won
        else:
            sec[rest[0]] = value
        moved.append(f"{old} moved to {new}")
    o = sections["objective"]
    for k in [k for k in (o.get("kwargs") or {}) if k in {f.name for f in dataclasses.fields(AlgoConfig)}]:
        algo[k] = o["kwargs"].pop(k)
        moved.append(f"algo.objective.kwargs.{k} moved to algo.{k} (several components read it)")
        touched += ["objective"] if "objective" not in touched else []
    algo.update({s: sections[s] for s in touched})
    return {**data, "algo": algo}, moved, unread, touched


def _renamed(data: dict) -> tuple[dict, list[str]]:
    """(data with RENAMED values in their new names, "old is now new" notes)."""
    notes = []
    for (section, key), names in RENAMED.items():
        sec = data.get(section)
        if isinstance(sec, dict) and isinstance(sec.get(key), str) and sec[key] in names:
            notes.append(f"{section}.{key}={sec[key]} is now {section}.{key}={names[sec[key]]}")
            data = {**data, section: {**sec, key: names[sec[key]]}}
    return data, notes


def check_moved(data: dict) -> None:
    """Refuse a config that names a key of MOVED or a RENAMED value, with its new form (ConfigError)."""
    if notes := _renamed(data)[1]:
        raise ConfigError("; ".join(notes) + " (the same policy under its one name)")
    new, moved, unread, touched = _upgrade(data, saved=False)
    if moved or unread:
        form = "; ".join(f"algo.{s}: " + yaml.safe_dump(new["algo"][s], default_flow_style=True, sort_keys=False,
                                                          width=1000).strip() for s in touched)
        remove = f"; remove {', '.join(unread)}" if unread else ""
        raise ConfigError(f"{', '.join(moved)}{remove} ({form})")


def upgrade_saved(data: dict, where: str) -> dict:
    """A run's saved config (config.json of an older mmrl) with its MOVED keys and RENAMED values translated; a
    warning lists them."""
    data, renamed = _renamed(data)
    new, moved, unread, _ = _upgrade(data, saved=True)
    moved = renamed + moved
    if moved or unread:
        log.warning("%s was saved by an older mmrl and is read with its moved keys translated: %s%s", where,
                    ", ".join(moved), f"; unread, dropped: {', '.join(unread)}" if unread else "")
    return new


def build_dataclass(cls, data: dict, where: str):
    """Instantiate dataclass `cls` from a dict with the schema's checks (unknown keys, types); `where` names it."""
    return _build(cls, data, where)


def _build(cls, data: dict, where: str):
    """Instantiate dataclass `cls` from a dict, recursing into nested dataclasses; unknown keys error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, list(names), n=1)
            hint = f". Did you mean {close[0]!r}?" if close else ""
            if key in OTHER_NAMES:
                hint = f". Did you mean {OTHER_NAMES[key]!r}? (docs/python-api.md maps TRL's names to mmrl's)"
            path = f"{where}.{key}" if where else key  # the suggestion first: the list of keys is long
            valid = f"valid keys{' of ' + where if where else ''}: {sorted(names)}"
            if len(names) > 10:  # a long section: the nearest keys, and where the schema lists them all
                near = difflib.get_close_matches(key, list(names), n=5, cutoff=0.0)
                valid = f"nearest keys of {where}: {near}; all {len(names)}: `mmrl/config.py` {cls.__name__}"
            raise ConfigError(f"unknown config key {path!r}{hint} ({valid})" if hint else
                              f"unknown config key {path!r}; {valid}")
        f = names[key]
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            kwargs[key] = _build(sub, value, f"{where}.{key}" if where else key)
        else:
            kwargs[key] = _coerce(value, hints[key], f"{where}.{key}" if where else key)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check `value` against the field's type hint (scalars, `X | None`, list[X], dict), recursing into lists;
    accept '3e-5' (YAML reads it as a string) and ints where a float is expected. Raise naming the fix."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, a, key)
            except ValueError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if typing.get_origin(tp) is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} expects a list ({_name(tp)}), got {value!r} "
                              f"({type(value).__name__}): write {key}=[{value}]")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    if tp is dict or typing.get_origin(tp) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} expects a mapping, got {value!r} ({type(value).__name__})")
        return value
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    if tp in (int, float, bool, str) and isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    if tp is Any:
        return value
    raise ConfigError(f"config key {key!r} expects {_name(tp)}, got {value!r} ({type(value).__name__})")


def _name(tp: Any) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    d = data
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    d[keys[-1]] = value


def parse_overrides(items: list[str]) -> dict:
    """['train.lr=1e-4', 'log.out_dir=runs/x'] -> nested dict; values parsed as YAML scalars/lists."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.lr=1e-4)")
        k, v = item.split("=", 1)
        try:
            value = yaml.load(v, Loader=Yaml12Loader) if v != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: its value is not valid YAML ({str(e).splitlines()[0]}); quote it "
                              f"for the shell, e.g. '{k.strip()}={{a: 1, b: 2}}'") from None
        _set_dotted(out, k.strip(), value)
    return out


def _merge(base: dict, over: dict) -> dict:
    """Deep merge; a section that names another registry entry (`name`, `eval_name`) drops the base's
    `kwargs` / `eval_kwargs`, which belonged to the old entry."""
    out = dict(base)
    for k in ("name", "eval_name"):
        if k in over and over[k] != base.get(k):
            out.pop(k.replace("name", "kwargs"), None)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file (which may name `base: other.yaml`, relative to itself) <- key=value overrides.
    log.out_dir not set by the file itself (a base's does not count) nor an override: runs/<the file's name>, so a
    config never writes into another config's run folder. A run's saved config.json has its MOVED keys translated;
    any other config naming one is refused with the key's new form."""
    data = _load_yaml(path) if path else {}
    if path and os.path.basename(path) == SAVED_CONFIG:
        data = upgrade_saved(data, path)
    data = _merge(data, parse_overrides(overrides or []))
    check_moved(data)
    if path and "out_dir" not in (_read_yaml(path).get("log") or {}) and \
            "out_dir" not in (parse_overrides(overrides or []).get("log") or {}):
        data.setdefault("log", {})["out_dir"] = os.path.join("runs", os.path.splitext(os.path.basename(path))[0])
    cfg = _build(Config, data, "")
    # the keys a person set (a run's saved config.json lists every key, chosen or not): defaults that a component's
    # declaration resolves at load (mmrl.compose: a CFG-free loss's sampler.cfg_scale) are resolved only when unset
    saved = path and os.path.basename(path) == SAVED_CONFIG
    cfg._given = {} if saved else {section: set(keys) for section, keys in data.items() if isinstance(keys, dict)}
    return cfg.validate()


class Yaml12Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans: only true / false. `no`, `yes`, `on`, `off` stay strings (mixed_precision: no)."""


Yaml12Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
Yaml12Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))


def _read_yaml(path: str) -> dict:
    """One config file as a mapping (its `base:` not followed); clear errors for a missing, non-UTF-8 or
    malformed file."""
    if not os.path.isfile(path):
        raise MissingFile(f"config file {path!r} does not exist (configs live in configs/, e.g. "
                          f"configs/t2i/shapes_grpo.yaml)")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=Yaml12Loader) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of sections, got {type(data).__name__}")
    return data


def _load_yaml(path: str) -> dict:
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base:
        data = _merge(_load_yaml(os.path.join(os.path.dirname(path), base)), data)
    return data
