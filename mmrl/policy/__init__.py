"""Policies. Registry: POLICIES maps model.policy to a builder `(cfg: Config) -> Policy` (imported on first use);
`package.module:build_fn` names a user's own builder."""

from mmrl.registry import Registry

POLICIES = Registry("policy", {
    "flow": "mmrl.policy.flow_build:build_flow_policy",
    "token": "mmrl.policy.token:build_token_policy",
    "janus": "mmrl.policy.janus:build_janus_policy",  # Janus-Pro: image tokens as actions (docs/token-policies.md)
})

# What each kind reads, reports and can do: mmrl/policy/kinds.py (KINDS, kind_of).
