"""Policies. Registry: POLICIES maps model.policy to a builder `(cfg: Config) -> Policy` (imported lazily)."""

from mmrl.registry import Registry

POLICIES = Registry("policy")


@POLICIES.register("flow")
def _flow(cfg):
    from mmrl.policy.flow import build_flow_policy

    return build_flow_policy(cfg)
