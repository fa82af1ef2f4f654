"""Pure algorithm functions, one registry per axis."""

from mmrl.algorithms.advantages import ADVANTAGES
from mmrl.algorithms.kl import KL_ESTIMATORS
from mmrl.algorithms.losses import LOSS_AGG, POLICY_LOSSES
from mmrl.algorithms.ratio import RATIO_TRANSFORMS
from mmrl.algorithms.weighting import WEIGHTINGS

__all__ = ["ADVANTAGES", "KL_ESTIMATORS", "LOSS_AGG", "POLICY_LOSSES", "RATIO_TRANSFORMS", "WEIGHTINGS"]
