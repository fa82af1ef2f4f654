"""Composition: the one place where config names become objects.

The config (mmrl/config.py) knows values, not registries; the registries (POLICIES, TASKS, REWARDS, JUDGES, the
algorithm pieces) know names, not configs. Here a config is checked against the registries once, at load time
(`load_config`, `check_choices`), and turned into a policy, a task and rewards (`build_policy`, `build_task`,
`build_reward`). Any name may be a `package.module:Name` path to the user's own code.

Rewards and judges that wrap others receive them built: a factory parameter named `reward` or `judge` whose
config value (or default) is a registry name is built from that name and the sibling `reward_kwargs` /
`judge_kwargs`; `components` of `reward.name=multi` are built one by one. So a user's wrapper reward gets the
same treatment as the built-in ones.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any

from mmrl.algorithms import (ADVANTAGES, CREDIT_ASSIGNMENTS, KL_ESTIMATORS, LOSS_AGG, OFFPOLICY, POLICY_LOSSES,
                             RATIO_TRANSFORMS, REWARD_AGGREGATIONS, REWARD_SHAPINGS, WEIGHTINGS)
from mmrl.algorithms.objective import build_objective
from mmrl.algorithms.shaping import build_shaping
from mmrl.config import Config, TaskConfig, choice
from mmrl.config_files import parse_config
from mmrl.devices import resolve_device, set_tf32
from mmrl.errors import ConfigError
from mmrl.policy import POLICIES
from mmrl.policy.kinds import kind_keys, kind_of
from mmrl.registry import Registry
from mmrl.reward import REWARDS, FunctionReward, plain_function_args, weight_schedule
from mmrl.rollout.engine import ENGINES
from mmrl.rollout.pairwise import JUDGES
from mmrl.rollout.tree import FUSIONS, split_schedule
from mmrl.sampling.flow_sde import SDE_KINDS
from mmrl.task import TASKS

NESTED = {"reward": REWARDS, "judge": JUDGES}  # factory parameters that receive built objects


def load_config(path: str | None = None, overrides: list[str] | None = None) -> Config:
    """Parse and check a config (mmrl.config_files.parse_config), then check every registry name it uses."""
    return check_choices(parse_config(path, overrides))


def checked(cfg: Config) -> Config:
    """`cfg` with every registry name and choice checked: once. A config that `check_choices` passed (e.g. from
    load_config) and that has not changed since is not checked again; any other is checked now."""
    return cfg if getattr(cfg, "_checked", None) == repr(cfg) else check_choices(cfg)


@dataclass(frozen=True)
class Algorithm:
    """The config's algorithm pieces, built once: what a training pass minimizes, how rewards are shaped, how
    advantages are assigned."""
    objective: Any  # mmrl.algorithms.objective.Objective
    shaping: Any    # mmrl.algorithms.shaping.Shaping (needs_contrast: T-GRPO's contrast rollout)
    credit: Any     # CREDIT_ASSIGNMENTS[algo.credit]


def build_algorithm(cfg: Config) -> Algorithm:
    return Algorithm(build_objective(cfg.algo), build_shaping(cfg.algo), CREDIT_ASSIGNMENTS[credit_name(cfg)])


def credit_name(cfg: Config) -> str:
    if cfg.algo.credit != "auto":
        return cfg.algo.credit
    return "tree" if cfg.tree.split_steps else "step_branch" if cfg.sampler.branch_children else "group"


def check_choices(cfg: Config) -> Config:
    """Every registry name and enumerated choice of `cfg`, resolved once; ValueError naming the key and the fix."""
    POLICIES.check(cfg.model.policy, "model.policy")
    _check_kind(cfg, kind_of(cfg.model.policy))
    if cfg.model.family:
        from mmrl.models.families import FAMILIES

        FAMILIES.check(cfg.model.family, "model.family")
    TASKS.check(cfg.task.name, "task.name")
    reads = lambda name: getattr(TASKS[name], "reads_prompt_file", False)  # noqa: E731 (a task's declaration)
    if cfg.task.prompt_file and ":" not in cfg.task.name and not reads(cfg.task.name):
        readers = [n for n in TASKS if ":" not in n and reads(n)]
        raise ConfigError(f"task.prompt_file is not read by task.name={cfg.task.name}, which draws its own prompts: "
                          f"set task.name to one that reads it ({', '.join(readers)}), or remove task.prompt_file")
    for key in ("name", "eval_name"):
        if getattr(cfg.reward, key):
            REWARDS.check(getattr(cfg.reward, key), f"reward.{key}")
    POLICY_LOSSES.check(cfg.algo.objective.name, "algo.objective.name")  # its kwargs: _check_objective
    if cfg.algo.kl == "auto":  # resolved once here, so the run's saved config names the estimator it used
        cfg.algo.kl = _auto_kl(cfg)
    REWARD_SHAPINGS.check(cfg.algo.shaping.name, "algo.shaping.name")
    build_shaping(cfg.algo)  # algo.shaping.kwargs against the shaping's knobs dataclass
    for registry, key in ((ADVANTAGES, "advantage"), (LOSS_AGG, "loss_agg"), (KL_ESTIMATORS, "kl"),
                          (RATIO_TRANSFORMS, "ratio"), (REWARD_AGGREGATIONS, "reward_aggregation"),
                          (OFFPOLICY, "offpolicy")):
        registry.check(getattr(cfg.algo, key), f"algo.{key}")
    for name in cfg.algo.weighting.split("+"):
        WEIGHTINGS.check(name, "algo.weighting")
    CREDIT_ASSIGNMENTS.check(credit_name(cfg), "algo.credit")
    if cfg.tree.split_steps and credit_name(cfg) == "group":
        raise ConfigError("algo.credit=group gives one advantage per sample, but tree rollouts need one per "
                          "transition: set algo.credit=auto (or tree)")
    _check_objective(cfg)
    _check_reads(cfg)
    ENGINES.check(cfg.sampler.engine, "sampler.engine")  # a registered engine, or a user's own by import path
    choice("tree.fusion", cfg.tree.fusion, FUSIONS)
    if cfg.tree.split_steps:
        split_schedule(cfg.sampler.num_steps, cfg.tree.split_steps)
        if cfg.sampler.ode_stride > 1 or cfg.sampler.ode_solver != "euler":
            raise ConfigError("sampler.ode_stride / ode_solver=dpm2m apply to chain rollouts: remove them or "
                              "tree.split_steps")
    cfg._checked = repr(cfg)  # `checked` does not check it again while it stays as it is
    return cfg


def _check_kind(cfg: Config, kind) -> None:
    """The config against its policy kind's declaration (mmrl/policy/kinds.py), the errors written from it; a user's
    own policy (kind None) reads what it reads. Resolves algo.adv_std=auto to the kind's std, so the run's saved
    config names the std it used."""
    t, a = cfg.train, cfg.algo
    if a.adv_std == "auto":
        a.adv_std = kind.adv_std if kind is not None else "population"
    if kind is None:
        return
    for section, readers in kind_keys().items():
        default = type(getattr(cfg, section))()
        for key, names in readers.items():
            if kind.name not in names and getattr(getattr(cfg, section), key) != getattr(default, key):
                reads = ", ".join(f"{section}.{k}" for k in kind.reads.get(section, ())) or "none"
                raise ConfigError(f"{section}.{key} does not apply to model.policy={kind.name}: remove it (it is read "
                                  f"by {' and '.join(names)} policies only; {kind.name} "
                                  f"reads of {section}: {reads})")
    steps = "a flow transformer's denoising steps (model.policy=flow)"
    if t.context_parallel > 1 and not kind.denoises:
        raise ConfigError(f"train.context_parallel splits the video tokens of {steps}: set train.context_parallel=1")
    if cfg.tree.split_steps and not kind.denoises:
        raise ConfigError(f"tree.split_steps (BranchGRPO) branches {steps}: remove tree.split_steps")
    if t.micro_batch and a.ratio == "gspo" and kind.denoises:
        raise ConfigError(f"algo.ratio=gspo averages a sample's actions, which train.micro_batch splits for "
                          f"model.policy={kind.name}: set train.micro_batch=0 or algo.ratio=none")
    if a.objective.tis_cap and not kind.decodes:
        raise ConfigError(f"algo.objective.tis_cap corrects a token engine's sampling log-probs; model.policy="
                          f"{kind.name}'s old log-probs are its sampler's own, so there is nothing to correct: set "
                          f"algo.objective.tis_cap=0")


def _provided(cfg: Config) -> tuple[str, ...] | None:
    """What the policy reports for the objective's actions (its kind's `provides`); None for a user's own policy."""
    kind = kind_of(cfg.model.policy)
    return None if kind is None else kind.provides.get(build_objective(cfg.algo).actions, ())


def _auto_kl(cfg: Config) -> str:
    """algo.kl=auto: the first of flow_mean (SDE steps), flow_velocity (forward process), k3 (log-probs) whose
    declared reads the policy provides."""
    provided = _provided(cfg)
    for name in ("flow_mean", "flow_velocity", "k3"):
        if provided is None or set(getattr(KL_ESTIMATORS[name], "reads", ())) <= set(provided):
            return name
    return "k3"


def _check_reads(cfg: Config) -> None:
    """Each component that reads policy statistics (KL estimator, weightings, ratio transform: `fn.reads`) against
    what the policy provides for the objective's actions (its kind's `provides`): a missing one would fail as a
    KeyError in the first training pass, after the model has loaded."""
    provided = _provided(cfg)
    if provided is None:
        return
    a = cfg.algo
    used = [("algo.weighting", w, WEIGHTINGS) for w in a.weighting.split("+")] + [("algo.ratio", a.ratio, RATIO_TRANSFORMS)]
    if a.kl_coef > 0:
        used.append(("algo.kl", a.kl, KL_ESTIMATORS))
    for key, name, registry in used:
        missing = [r for r in getattr(registry[name], "reads", ()) if r not in provided]
        if missing:
            fits = [n for n in registry if isinstance(n, str) and ":" not in n
                    and set(getattr(registry[n], "reads", ())) <= set(provided)]
            raise ConfigError(f"{key}={name} reads {missing}, which model.policy={cfg.model.policy} does not report "
                              f"for its actions (algo.objective.name={a.objective.name}): set {key} to one of "
                              f"{fits}")


def _check_objective(cfg: Config) -> None:
    """The objective's kwargs (its loss's knobs dataclass) and what its terms declare they need
    (mmrl/algorithms/objective.py) against the rest of the config."""
    a, s, obj, name = cfg.algo, cfg.sampler, build_objective(cfg.algo), cfg.algo.objective.name
    loss = POLICY_LOSSES[name]
    if obj.actions != "forward":
        choice("sampler.kind", s.kind, SDE_KINDS)
        kind = kind_of(cfg.model.policy)
        if getattr(loss, "flow_steps_only", False) and (not (kind and kind.denoises) or a.ratio != "none"):
            raise ConfigError(f"algo.objective.name={name} bounds the exact KL of flow SDE steps: use a flow policy "
                              f"and algo.ratio=none (its trust region replaces ratio transforms)")
        return
    choice("sampler.kind", s.kind, SDE_KINDS + ("ode",))
    kind = kind_of(cfg.model.policy)
    if getattr(loss, "guidance", None) == "none" and kind is not None and kind.denoises and s.cfg_scale != 1.0:
        if "cfg_scale" in getattr(cfg, "_given", {}).get("sampler", ()):  # chosen: refused; the default: resolved
            raise ConfigError(f"algo.objective.name={name} trains the model's own velocity without classifier-free "
                              f"guidance, and samples from it: set sampler.cfg_scale=1 (sampler.eval_cfg_scale="
                              f"{s.eval_cfg_scale:g} still guides the held-out evaluation); got sampler.cfg_scale="
                              f"{s.cfg_scale:g}")
        s.cfg_scale = 1.0  # the default scale, never chosen: resolved by the loss's declaration (as algo.kl=auto)
    fix = f"algo.objective.name={name} trains on the forward process of final samples"
    if kind is not None and "forward" not in kind.provides:
        raise ConfigError(f"{fix}, which flow policies record: set model.policy=flow or another algo.objective.name")
    if cfg.tree.split_steps:
        raise ConfigError(f"{fix}, not on tree transitions: remove tree.split_steps")
    if a.weighting != "none" or a.ratio != "none" or (a.kl_coef > 0 and a.kl == "flow_mean"):
        raise ConfigError(f"{fix}; algo.weighting, algo.ratio and algo.kl=flow_mean act on SDE steps: set "
                          f"algo.weighting=none, algo.ratio=none, algo.kl=flow_velocity")
    if obj.terms[0].needs_reference and (cfg.model.reference == "none" or (
            a.kl_reference == "ema" and cfg.train.ema_decay == 0)):
        raise ConfigError(f"algo.objective.name={name} compares each sample with a reference: set "
                          f"model.reference=auto (the frozen base), or train.ema_decay > 0 with algo.kl_reference=ema")
    if obj.needs_ema_anchor and cfg.train.ema_decay == 0:
        raise ConfigError(f"algo.objective.name={name} with kwargs.anchor=ema anchors at the EMA of the trained "
                          f"weights: set train.ema_decay (e.g. 0.9), or kwargs.anchor=reference")
    if obj.needs_whole_groups and (cfg.train.minibatches != 1 or cfg.train.micro_batch):
        raise ConfigError(f"algo.objective.name={name} sums over whole groups in one pass: set "
                          f"train.minibatches=1, train.micro_batch=0")
    if s.kind == "ode" and s.shared_noise:
        raise ConfigError("sampler.kind=ode with sampler.shared_noise: every sample of a group would be the same image "
                          "(zero advantages); set sampler.shared_noise=false")


# ------------------------------------------------------------------------------------------------- building
def build_policy(cfg: Config, dist=None):
    """POLICIES[model.policy](cfg). `dist` (the run's mmrl.parallel.distributed.Distributed) goes to a builder that takes it:
    under FSDP on several processes the flow policy then builds its trained transformers without weights and loads
    them into shards when `parallelize` has sharded them, so no rank holds a whole copy at start-up."""
    factory = POLICIES[cfg.model.policy]
    set_tf32(resolve_device(cfg.model.device), cfg.train.tf32)  # before any weight meets the GPU
    if dist is not None and "dist" in inspect.signature(factory).parameters:
        return factory(cfg, dist=dist)
    return factory(cfg)


def build_task(cfg: TaskConfig):
    """TASKS[task.name](cfg.task, **task.kwargs); an unknown kwarg fails naming the valid ones."""
    return _call(TASKS, cfg.name, dict(cfg.kwargs), "task", cfg)


def build_reward(name: str, kwargs: dict | None = None, where: str = "reward"):
    """REWARDS[name](**kwargs) with the rewards / judges it wraps built first (see the module docstring)."""
    return _call(REWARDS, name, dict(kwargs or {}), where)


def build_judge(name: str, kwargs: dict | None = None, where: str = "judge"):
    return _call(JUDGES, name, dict(kwargs or {}), where)


def check_kwargs(registry: Registry, name: str, kwargs: dict, where: str, visit=None) -> None:
    """Every kwarg of `registry[name]` is one its factory takes (a reward function's inputs excluded), and so are
    those of the rewards / judges it wraps by name and of reward.name=multi's components; nothing is built.
    visit(key path, value): called for each kwarg taken (mmrl validate checks the paths among them)."""
    factory = registry[name]
    params = dict(inspect.signature(factory).parameters)
    for arg in plain_function_args(factory) if registry is REWARDS else ():  # def reward(outputs, examples, **kw)
        params.pop(arg)
    kwargs = dict(kwargs or {})
    for key, sub in NESTED.items():  # a wrapped reward / judge named by a string, with its own kwargs
        value = kwargs.get(key, params[key].default if key in params else None)
        if key in params and isinstance(value, str):
            check_kwargs(sub, value, kwargs.pop(f"{key}_kwargs", None) or {}, f"{where}.kwargs.{key}", visit)
    if "components" in params and isinstance(kwargs.get("components"), dict):  # reward.name=multi
        for label, spec in kwargs["components"].items():
            spec = dict(spec or {})
            if set(spec) - {"name", "weight", "kwargs"}:
                raise ConfigError(f"{where}.kwargs.components.{label}: unknown keys "
                                  f"{sorted(set(spec) - {'name', 'weight', 'kwargs'})}; valid: name, weight, kwargs")
            weight_schedule(spec.get("weight", 1.0), f"{where}.kwargs.components.{label}.weight")
            check_kwargs(REWARDS, spec.get("name", label), spec.get("kwargs"), f"{where}.kwargs.components.{label}",
                          visit)
    unknown = sorted(set(kwargs) - set(params))
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        valid = sorted(k for k in params if k not in ("self", "cfg", "args", "kwargs"))
        close = [c for k in unknown for c in difflib.get_close_matches(k, valid, n=1)]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise ConfigError(f"{where}.kwargs {unknown} not understood by {registry.axis} {name!r}; valid: {valid}{hint}")
    for key, value in kwargs.items() if visit else ():
        visit(f"{where}.kwargs.{key}", value)


def _call(registry: Registry, name: str, kwargs: dict, where: str, *args):
    check_kwargs(registry, name, kwargs, where)  # every level, before anything is built
    factory = registry[name]
    if registry is REWARDS and plain_function_args(factory):  # def reward(outputs, examples, **kw): TRL's habit
        return FunctionReward(factory, **kwargs)
    params = inspect.signature(factory).parameters
    for key, sub in NESTED.items():  # a wrapped reward / judge named by a string: build it
        value = kwargs.get(key, params[key].default if key in params else None)
        if key in params and isinstance(value, str):
            kwargs[key] = _call(sub, value, dict(kwargs.pop(f"{key}_kwargs", None) or {}), f"{where}.{key}")
    if "components" in params and isinstance(kwargs.get("components"), dict):  # reward.name=multi
        kwargs["components"] = {label: _component(label, spec, where) for label, spec in kwargs["components"].items()}
    try:
        return factory(*args, **kwargs)
    except TypeError as e:
        valid = sorted(k for k in params if k not in ("self", "cfg", "args", "kwargs"))
        raise ConfigError(f"{registry.axis} {name!r}: {e}; valid {where}.kwargs: {valid}") from e


def _component(label: str, spec, where: str) -> dict:
    spec = dict(spec or {})
    reward = build_reward(spec.get("name", label), spec.get("kwargs"), f"{where}.kwargs.components.{label}")
    return {"reward": reward, "weight": spec.get("weight", 1.0)}  # a number or [[iteration, weight], ...]
