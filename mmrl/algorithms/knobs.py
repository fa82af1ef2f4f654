"""Knobs: a registry entry's own parameters, declared beside its function as a small dataclass (`nft.knobs =
NFTKnobs`) and set in the config section that names the entry, checked when the config loads:

    algo:
      objective: {name: nft, kwargs: {nft_beta: 2.0}}   # POLICY_LOSSES["nft"](..., knobs=NFTKnobs(...))
      shaping: {name: tempsamp, kwargs: {tau: 0.8}}     # REWARD_SHAPINGS["tempsamp"](..., knobs=TempSampKnobs(...))

Each value has one home. A knob of one entry is a dataclass field with its default, set in the section's `kwargs`.
A knob that several components read is an algo.* key (AlgoConfig): the dataclass declares it without a default (so
the loss says what it reads), it is filled from algo.<name>, and `kwargs` may not set it. The built-in ones:
clip_range, clip_range_high, clip_ratio_c (PPO's trust region: ppo_clip, awm, awm_anchored, dgpo) and adv_clip (the
advantage estimators' clip and DiffusionNFT's normalization of A). An entry without `fn.knobs` takes none (knobs=None).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Callable

from mmrl.config_files import build_dataclass
from mmrl.errors import ConfigError


def build_knobs(fn: Callable, name: str, kwargs: dict | None, where: str, algo: Any = None):
    """fn.knobs(**shared algo.* values, **kwargs), or None for an entry without knobs. `where` is the config section
    (e.g. "algo.objective"); ConfigError for an unknown or shared key (naming the valid ones) or a wrong type."""
    cls, kwargs = getattr(fn, "knobs", None), dict(kwargs or {})
    if cls is None:
        if kwargs:
            raise ConfigError(f"{where}.kwargs {sorted(kwargs)}: {name!r} declares no knobs (fn.knobs): remove them")
        return None
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(f"{name!r} declares knobs={cls!r}: declare them as a dataclass beside the function "
                          f"(@dataclass class MyKnobs: scale: float = 1.0; fn.knobs = MyKnobs; docs/extending.md)")
    fields = [f.name for f in dataclasses.fields(cls)]
    algo_keys = {f.name for f in dataclasses.fields(algo)} if dataclasses.is_dataclass(algo) else set()
    shared = [k for k in fields if k in algo_keys]
    own = [k for k in fields if k not in algo_keys]
    for key in kwargs:
        if key in shared:
            raise ConfigError(f"{where}.kwargs.{key}: several components read {key}, so it is set once, at algo.{key} "
                              f"(e.g. algo.{key}={kwargs[key]})")
        if key not in own:
            close = difflib.get_close_matches(key, own, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            reads = f" (it also reads {', '.join(f'algo.{k}' for k in shared)})" if shared else ""
            raise ConfigError(f"{where}.kwargs: {key!r} is not a knob of {name!r}.{hint} Its knobs: {own or 'none'}"
                              f"{reads}")
    try:
        return build_dataclass(cls, {**{k: getattr(algo, k) for k in shared}, **kwargs}, f"{where}.kwargs")
    except TypeError as e:  # a knob without a default that kwargs does not give
        raise ConfigError(f"{where}.kwargs of {name!r}: {e}") from None
