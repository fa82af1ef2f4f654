"""Pure algorithm functions, one registry per axis."""

from mmrl.algorithms import dgpo, dpo, flow_dppo  # noqa: F401  (register POLICY_LOSSES dgpo, dpo, flow_dppo)
from mmrl.algorithms.advantages import ADVANTAGES, CREDIT_ASSIGNMENTS, REWARD_AGGREGATIONS
from mmrl.algorithms.kl import KL_ESTIMATORS
from mmrl.algorithms.losses import LOSS_AGG, POLICY_LOSSES, LossContext
from mmrl.algorithms.offpolicy import OFFPOLICY
from mmrl.algorithms.ratio import RATIO_TRANSFORMS
from mmrl.algorithms.shaping import REWARD_SHAPINGS
from mmrl.algorithms.weighting import WEIGHTINGS

__all__ = ["ADVANTAGES", "CREDIT_ASSIGNMENTS", "KL_ESTIMATORS", "LOSS_AGG", "LossContext", "OFFPOLICY", "POLICY_LOSSES",
           "RATIO_TRANSFORMS", "REWARD_AGGREGATIONS", "REWARD_SHAPINGS", "WEIGHTINGS"]
