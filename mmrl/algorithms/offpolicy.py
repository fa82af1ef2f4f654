"""Off-policy samples injected into groups (TempSamp-R1). Registry: OFFPOLICY.

`fn(policy, rollout, task) -> (rollout', stats)`. "ground_truth" replaces the last sample of every group by
the task's reference answer (`task.reference_output(example) -> str`) through `policy.replace_outputs`,
which marks the row `is_offpolicy` and recomputes its old log-prob under the current weights.
`injection_diagnostics` says what the injected rows did to the advantages of the on-policy ones.
"""

from __future__ import annotations

import torch

from mmrl.errors import ConfigError
from mmrl.registry import Registry

OFFPOLICY = Registry("off-policy injection")


@OFFPOLICY.register("none")
def none(policy, rollout, task):
    return rollout, {}


@OFFPOLICY.register("ground_truth")
def ground_truth(policy, rollout, task):
    if not hasattr(task, "reference_output"):
        raise ConfigError("algo.offpolicy=ground_truth needs a task with reference_output(example) (e.g. grounding): "
                          "set algo.offpolicy=none")
    gid = rollout.group_id
    last = torch.tensor([int((gid == g).nonzero().max()) for g in torch.unique(gid)])  # [K] one row per group
    texts = [task.reference_output(rollout.examples[i]) for i in last.tolist()]
    return policy.replace_outputs(rollout, last, texts), {"offpolicy/injected": float(len(last))}


def injection_diagnostics(rewards, group_id, valid, is_offpolicy, advantage_fn) -> dict:
    """Group-mean shift caused by the injected rows, and how many on-policy advantages change sign.

    advantage_fn(rewards, group_id, valid) -> advantages [N]; compared with the injected rows excluded.
    """
    if not is_offpolicy.any():
        return {}
    on = valid & ~is_offpolicy
    with_inj = advantage_fn(rewards, group_id, valid)
    without = advantage_fn(rewards, group_id, on)
    flips = (torch.sign(with_inj) != torch.sign(without)) & on & (without != 0)
    shift = []
    for g in torch.unique(group_id):
        m = group_id == g
        if (m & on).any() and (m & valid).any():
            shift.append(float(rewards[m & valid].mean() - rewards[m & on].mean()))
    return {"offpolicy/group_mean_shift": sum(shift) / max(len(shift), 1),
            "offpolicy/sign_flip_rate": float(flips.sum()) / max(int((on & (without != 0)).sum()), 1),
            "offpolicy/reward_mean": float(rewards[is_offpolicy & valid].mean()) if (is_offpolicy & valid).any() else 0.0}
