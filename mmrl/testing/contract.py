"""The contract every policy passes before it trains: `check_policy(policy, examples)`.

What the trainer relies on, checked on a real sample:
- the `Policy` protocol (mmrl/policy/base.py): every member the trainer and the algorithms use;
- shapes: a rollout of N = len(examples) * G rows with group_id [N], old_log_prob and action_mask [N, A],
  N outputs, finite old log-probs where actions are trained;
- determinism: the same generator seed gives the same outputs and old log-probs;
- on-policy ratio = 1: recomputing the log-probs of the stored actions with unchanged weights gives back the
  rollout's old log-probs (exp(logp - logp_old) = 1 within `ratio_tol`), with gradients;
- evaluation: `evaluate(examples, seed)` gives one output per example, the same for the same seed.
Raises AssertionError naming the broken clause; returns a summary dict.
"""

from __future__ import annotations

import torch

from mmrl.policy.base import Policy


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return list(a) == list(b)


def check_policy(policy, examples: list[dict], group_size: int = 2, seed: int = 0, ratio_tol: float = 1e-4) -> dict:
    missing = [m for m in Policy.__protocol_attrs__ if not hasattr(policy, m)] if hasattr(Policy, "__protocol_attrs__") \
        else []
    assert isinstance(policy, Policy), f"not a Policy: missing {missing or 'members of mmrl.policy.base.Policy'}"
    n = len(examples) * group_size
    ro = policy.sample(examples, group_size, torch.Generator().manual_seed(seed))
    assert len(ro) == n and ro.group_id.shape == (n,), f"rollout has {len(ro)} rows, expected {n}"
    assert ro.group_id.tolist() == torch.arange(len(examples)).repeat_interleave(group_size).tolist(), \
        "group_id must give each example's group_size rows one id, in example order"
    a = ro.old_log_prob.shape[1]
    assert ro.old_log_prob.shape == ro.action_mask.shape == (n, a), "old_log_prob and action_mask must be [N, A]"
    assert ro.action_mask.dtype == torch.bool and ro.action_mask.any(), "action_mask: bool, some actions trained"
    assert len(ro.outputs) == n and len(ro.examples) == n, "one output and one example per row"
    assert torch.isfinite(ro.old_log_prob[ro.action_mask]).all(), "old log-probs of trained actions must be finite"

    again = policy.sample(examples, group_size, torch.Generator().manual_seed(seed))
    assert _equal(ro.outputs, again.outputs), "the same seed must give the same outputs"
    torch.testing.assert_close(again.old_log_prob, ro.old_log_prob, rtol=0, atol=1e-5, equal_nan=True,
                               msg="the same seed must give the same old log-probs")

    out = policy.log_prob(ro, torch.arange(n))
    assert out.log_prob.shape == (n, a), f"log_prob gave {tuple(out.log_prob.shape)}, expected {(n, a)}"
    assert out.log_prob.requires_grad, "log_prob must carry gradients to the trainable parameters"
    mask = ro.action_mask
    ratio = torch.exp(out.log_prob.detach().float().cpu() - ro.old_log_prob.float())[mask]
    worst = float((ratio - 1).abs().max())
    assert worst <= ratio_tol, f"on-policy ratio must be 1: max |ratio - 1| = {worst:.2e} > {ratio_tol}"

    ev = policy.evaluate(examples, seed)
    assert len(ev) == len(examples) and _equal(ev, policy.evaluate(examples, seed)), \
        "evaluate must give one deterministic output per example"
    return {"rows": n, "actions": a, "trained_actions": int(mask.sum()), "max_ratio_error": worst}
