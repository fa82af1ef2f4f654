"""Policies. Registry: POLICIES maps model.policy to a builder `(cfg: Config) -> Policy` (imported on first use);
`package.module:build_fn` names a user's own builder."""

from mmrl.registry import Registry

POLICIES = Registry("policy", {
    "flow": "mmrl.policy.flow_build:build_flow_policy",
    "token": "mmrl.policy.token:build_token_policy",
    "janus": "mmrl.policy.janus:build_janus_policy",  # Janus-Pro: image tokens as actions (docs/token-policies.md)
})

# What each built-in policy reports per action (PolicyOutput.stats, and the rollout's per-step extras), by the actions
# its objective trains: "transitions" (sampling steps, tokens) or "forward" (noise levels of final samples). KL
# estimators, weightings and ratio transforms declare what they read (`fn.reads`); mmrl.compose checks the one
# against the other at load and writes the error from both. A user's own policy is not checked.
PROVIDES = {
    "flow": {"transitions": ("mean", "std", "velocity", "ratio_bias", "schedule_std_mean", "sigma_next"),
             "forward": ("velocity", "old_velocity", "target", "sigma")},
    "token": {"transitions": ("entropy",)},
    "janus": {"transitions": ("entropy",)},
}
