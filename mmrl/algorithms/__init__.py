"""Pure algorithm functions, one registry per axis. Every module of this package is imported here, so a module that
registers itself (e.g. a policy loss: `POLICY_LOSSES.register("dgpo")(dgpo)` in dgpo.py) needs no other line."""

import importlib
import pkgutil

from mmrl.algorithms.advantages import ADVANTAGES, CREDIT_ASSIGNMENTS, REWARD_AGGREGATIONS
from mmrl.algorithms.kl import KL_ESTIMATORS
from mmrl.algorithms.losses import LOSS_AGG, POLICY_LOSSES, LossContext
from mmrl.algorithms.offpolicy import OFFPOLICY
from mmrl.algorithms.ratio import RATIO_TRANSFORMS
from mmrl.algorithms.shaping import REWARD_SHAPINGS, build_shaping
from mmrl.algorithms.weighting import WEIGHTINGS

__all__ = ["ADVANTAGES", "CREDIT_ASSIGNMENTS", "KL_ESTIMATORS", "LOSS_AGG", "LossContext", "OFFPOLICY", "POLICY_LOSSES",
           "RATIO_TRANSFORMS", "REWARD_AGGREGATIONS", "REWARD_SHAPINGS", "WEIGHTINGS", "build_shaping"]

for _module in pkgutil.iter_modules(__path__):  # dgpo.py, dpo.py, flow_dppo.py ... register their entries
    importlib.import_module(f"{__name__}.{_module.name}")
